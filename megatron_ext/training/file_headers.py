"""Is a weights file whole? Its header read, not its tensors: a GGUF file's or a safetensors
file's header says where every tensor's bytes lie, so a file cut short (an interrupted download
or copy) is found in milliseconds, before any worker starts, instead of as a reshape error deep
inside a rank. Each check raises ValueError saying what is wrong, without the config field.
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import BinaryIO

import gguf
import numpy as np


class _Truncated(Exception):
    pass


def _read(f: BinaryIO, size: int) -> bytes:
    data = f.read(size)
    if len(data) < size:
        raise _Truncated
    return data


def _unpack(f: BinaryIO, fmt: str):
    return struct.unpack("<" + fmt, _read(f, struct.calcsize("<" + fmt)))[0]


def _skip_string(f: BinaryIO) -> None:
    f.seek(_unpack(f, "Q"), os.SEEK_CUR)


def _scalar_size(value_type: int) -> int:
    return np.dtype(gguf.GGUFReader.gguf_scalar_to_np[gguf.GGUFValueType(value_type)]).itemsize


def _skip_value(f: BinaryIO, value_type: int) -> None:
    if value_type == gguf.GGUFValueType.STRING:
        _skip_string(f)
    elif value_type == gguf.GGUFValueType.ARRAY:
        item_type, count = _unpack(f, "I"), _unpack(f, "Q")
        if item_type in (gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY):
            for _ in range(count):
                _skip_value(f, item_type)
        else:
            f.seek(count * _scalar_size(item_type), os.SEEK_CUR)
    else:
        f.seek(_scalar_size(value_type), os.SEEK_CUR)


def _tensor_bytes(dims: list[int], tensor_type: int) -> int:
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(tensor_type)]
    return math.prod(dims) // block * size


def gguf_size(path: str) -> int:
    """The size in bytes that the GGUF header of `path` promises (header + aligned tensor data);
    ValueError when it is no GGUF file, a version this reader does not know, or cut short."""
    with open(path, "rb") as f:
        try:
            magic = _unpack(f, "I")
            if magic != gguf.GGUF_MAGIC:
                raise ValueError(f"{path} is not a GGUF file (it starts with {struct.pack('<I', magic)!r})")
            version = _unpack(f, "I")
            if version not in (2, 3):
                raise ValueError(f"{path} is GGUF version {version}; versions 2 and 3 can be read")
            tensor_count, kv_count = _unpack(f, "Q"), _unpack(f, "Q")
            alignment = gguf.GGUF_DEFAULT_ALIGNMENT
            for _ in range(kv_count):
                key = _read(f, _unpack(f, "Q"))
                value_type = _unpack(f, "I")
                if key == b"general.alignment" and value_type == gguf.GGUFValueType.UINT32:
                    alignment = _unpack(f, "I")
                else:
                    _skip_value(f, value_type)
            end = 0
            for _ in range(tensor_count):
                _skip_string(f)
                dims = [_unpack(f, "Q") for _ in range(_unpack(f, "I"))]
                tensor_type, offset = _unpack(f, "I"), _unpack(f, "Q")
                end = max(end, offset + _tensor_bytes(dims, tensor_type))
            header = f.tell()
        except _Truncated:
            raise ValueError(f"{path} is cut short inside its GGUF header") from None
        except (ValueError, KeyError) as e:  # an unknown value or tensor type
            if str(e).startswith(path):
                raise
            raise ValueError(f"{path} has a damaged GGUF header ({e})") from None
    return -(-header // alignment) * alignment + end


def check_gguf(path: str) -> None:
    promised, size = gguf_size(path), os.path.getsize(path)
    if size < promised:
        raise ValueError(f"{path} is truncated: its GGUF header promises {promised} bytes, the file has {size}")


def check_safetensors(path: str) -> None:
    """The header (8-byte length + JSON) parses and every tensor's data lies inside the file."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else None
        if length is None or 8 + length > size:
            raise ValueError(f"{path} is cut short inside its safetensors header")
        try:
            header = json.loads(f.read(length))
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError):
            raise ValueError(f"{path} has no valid safetensors header") from None
    if 8 + length + end > size:
        raise ValueError(f"{path} is truncated: its safetensors header promises {8 + length + end} bytes, the file has {size}")
