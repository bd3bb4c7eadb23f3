"""A reshard request file: read and checked on rank 0, then consumed whatever its fate.

    {"layout": {"tp": 1, "pp": 2}}     the sizes that change (tp, pp, dp, ep, cp, vpp)

Whatever the file holds, it must not stop the running job, and a job restarted after it must
not meet it again: a request that cannot be taken is renamed `<file>.rejected` (`.rejected.1`,
... when that exists) and a taken one `<file>.done`.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from megatron_ext.platform.local_workers import first_line
from megatron_ext.reshard.config import SIZES

EXAMPLE = '{"layout": {"tp": 1, "pp": 2}}'


class RequestError(ValueError):
    """Why a request file cannot be taken (one line)."""


def read_request(path: str) -> dict:
    """The layout a request file asks for. Raises RequestError saying what is wrong with it."""
    try:
        with open(path, "rb") as f:
            text = f.read()
    except OSError as e:
        raise RequestError(f"cannot be read ({e.strerror})") from None
    try:
        request = json.loads(text)
    except ValueError as e:  # JSONDecodeError, or bytes that are no text at all
        raise RequestError(f"is not valid JSON ({first_line(e)}); expected {EXAMPLE}") from None
    return layout_of(request)


def layout_of(request: object) -> dict:
    """The layout of a parsed request, checked for its shape (the model's rules come later)."""
    if not isinstance(request, dict):
        raise RequestError(f"must be a JSON object like {EXAMPLE}, got {type(request).__name__}")
    unknown = sorted(set(request) - {"layout"})
    if unknown:
        raise RequestError(f"unknown key(s) {unknown}; the only key is 'layout', e.g. {EXAMPLE}")
    if "layout" not in request:
        raise RequestError(f"has no 'layout'; expected {EXAMPLE}")
    layout = request["layout"]
    if not isinstance(layout, dict):
        what = "null" if layout is None else type(layout).__name__
        raise RequestError(f"'layout' is {what}; it must name the sizes that change, e.g. {EXAMPLE}")
    unknown = sorted(set(layout) - set(SIZES))
    if unknown:
        raise RequestError(f"unknown size(s) {unknown} in 'layout'; the sizes are {list(SIZES)}")
    for name, value in layout.items():
        if not _is_size(value) and not (name == "vpp" and value is None):
            raise RequestError(f"layout.{name} must be a positive integer, got {json.dumps(value)}")
    return layout


def retire(path: str, suffix: str) -> Optional[str]:
    """Rename the request file to `<path>.<suffix>` (`.done` is replaced; `.rejected` gets a
    counter rather than hiding an earlier rejected request). Returns the new name, or None
    when it cannot be renamed."""
    target = f"{path}.{suffix}"
    if suffix != "done":
        count = 0
        while os.path.exists(target):
            count += 1
            target = f"{path}.{suffix}.{count}"
    try:
        os.replace(path, target)
    except OSError:
        return None
    return target


def _is_size(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
