"""GGUF import on small synthetic files written with gguf.GGUFWriter: names, reversed shapes,
llama.cpp's RoPE row order, dequantization, config; and every bad input refused with a message
that names the file and the tensor, before anything is written."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import quantize

from megatron_ext.config.schema import ModelConfig
from megatron_ext.models.convert import gguf as convert_gguf
from megatron_ext.models.convert import llama
from megatron_ext.models.convert.checkpoint import import_checkpoint

CFG = ModelConfig(
    num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
    vocab_size=80, tie_embeddings=False, rotary_base=5000.0, norm_epsilon=1e-5, seq_length=256,
)


def random_hf(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=g) for name, shape in llama.expected_hf_shapes(cfg).items()}


def llama_cpp_rope_order(w: torch.Tensor, heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to Q and K: the two rotated halves of a head interleaved."""
    rows, columns = w.shape
    return w.reshape(heads, 2, rows // heads // 2, columns).transpose(1, 2).reshape(rows, columns)


def write_gguf(
    path: Path,
    hf: dict[str, torch.Tensor],
    cfg: ModelConfig = CFG,
    arch: str = "llama",
    types: Optional[dict[str, Q]] = None,
) -> Path:
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_layers)
    writer.add_context_length(cfg.seq_length)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.ffn_hidden_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_query_groups)
    writer.add_rope_freq_base(cfg.rotary_base)
    writer.add_layer_norm_rms_eps(cfg.norm_epsilon)
    writer.add_vocab_size(cfg.vocab_size)
    for name, tensor in hf.items():
        gguf_name = convert_gguf.gguf_name(name)
        if ".attn_q." in gguf_name or ".attn_k." in gguf_name:
            heads = cfg.num_attention_heads if ".attn_q." in gguf_name else cfg.num_query_groups
            tensor = llama_cpp_rope_order(tensor, heads)
        qtype = (types or {}).get(gguf_name, Q.F32)
        if qtype == Q.F32:
            writer.add_tensor(gguf_name, tensor.numpy())
        else:
            writer.add_tensor(gguf_name, quantize(tensor.numpy(), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_names_map_both_ways():
    for name in llama.expected_hf_shapes(CFG):
        assert convert_gguf.hf_name(convert_gguf.gguf_name(name)) == name
    assert convert_gguf.gguf_name("model.layers.1.self_attn.q_proj.weight") == "blk.1.attn_q.weight"


def test_rope_rows_are_put_back_in_rotate_half_order():
    w = torch.arange(8 * 3.0).view(8, 3)  # 2 heads of dim 4
    assert torch.equal(convert_gguf.unpermute_rope_rows(llama_cpp_rope_order(w, 2), 2), w)
    # Row 1 of llama.cpp's head is the first row of the second half of Hugging Face's head.
    assert torch.equal(llama_cpp_rope_order(w, 2)[1], w[2])


def test_f32_file_reads_back_exactly(tmp_path):
    hf = random_hf(CFG)
    pretrained = convert_gguf.read_gguf(write_gguf(tmp_path / "m.gguf", hf))
    assert pretrained.config == dataclasses.replace(CFG, name="llama", max_position_embeddings=CFG.seq_length)
    assert set(pretrained.tensors) == set(hf)
    assert all(torch.equal(pretrained.tensors[n], hf[n]) for n in hf)


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_quantized_tensors_dequantize(tmp_path, qtype):
    hf = random_hf(CFG)
    name = "model.layers.0.self_attn.k_proj.weight"  # a RoPE-ordered one
    path = write_gguf(tmp_path / "m.gguf", hf, types={convert_gguf.gguf_name(name): qtype})
    got = convert_gguf.read_gguf(path).tensors[name]
    # 4-bit blocks of 32 keep about one part in 8 of the block's range.
    tolerance = {Q.F16: 1e-3, Q.BF16: 2e-2, Q.Q8_0: 3e-2, Q.Q4_0: 0.5, Q.Q4_1: 0.5}[qtype]
    assert got.dtype == torch.float32 and (got - hf[name]).abs().max() < tolerance


def test_tied_when_there_is_no_output_tensor(tmp_path):
    hf = random_hf(CFG)
    del hf["lm_head.weight"]
    assert convert_gguf.read_gguf(write_gguf(tmp_path / "m.gguf", hf)).config.tie_embeddings


def refused(tmp_path, path: Path, match: str) -> None:
    """Refused by the reader and by the converter, which writes nothing."""
    with pytest.raises(ValueError, match=match):
        convert_gguf.read_gguf(path)
    out = tmp_path / "ckpt"
    with pytest.raises(ValueError, match=match):
        import_checkpoint(str(path), str(out), tp=1, pp=1)
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == [path.name]


def test_other_architecture_is_refused(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", random_hf(CFG), arch="qwen2")
    refused(tmp_path, path, r"m\.gguf: architecture 'qwen2' is not supported")


def test_unsupported_quantization_is_refused(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", random_hf(CFG), types={"blk.1.ffn_up.weight": Q.Q5_0})
    refused(tmp_path, path, r"m\.gguf: tensor blk\.1\.ffn_up\.weight has type Q5_0")


def test_missing_tensor_is_refused(tmp_path):
    hf = random_hf(CFG)
    del hf["model.layers.1.post_attention_layernorm.weight"]
    path = write_gguf(tmp_path / "m.gguf", hf)
    refused(tmp_path, path, r"m\.gguf: missing tensor blk\.1\.ffn_norm\.weight")


def test_shape_mismatch_is_refused(tmp_path):
    hf = random_hf(CFG)
    hf["model.layers.0.mlp.down_proj.weight"] = torch.zeros(64, 95)
    path = write_gguf(tmp_path / "m.gguf", hf)
    refused(tmp_path, path, r"m\.gguf: tensor blk\.0\.ffn_down\.weight .* has shape \(64, 95\), expected \(64, 96\)")
