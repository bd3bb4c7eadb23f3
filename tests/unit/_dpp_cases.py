"""A small CPU-scale cost model shared by the DPP unit tests."""

from megatron_ext.dpp.planning.costmodel import CostModel

TOY = CostModel(
    alpha=1e-6, beta=2e-9, gamma=1e-4, bwd_ratio=2.0, t0=64.0, head_s_token=5e-7, p2p_s_token=1e-8, p2p_latency_s=1e-5,
    act_bytes_token=1000.0, act_bytes_attn=2.0, act_bytes_key=40.0, ckpt_bytes_token=100.0, kv_bytes_token=50.0,
    head_bytes_token=300.0, attn_freed_bytes_token=500.0, attn_bwd_bytes_pair=20.0, attn_bwd_bytes_key=80.0,
    attn_bwd_bytes_query=40.0, state_bytes_param=16.0, layer_params=10_000, embedding_params=20_000, head_params=20_000,
    num_layers=4,
)
