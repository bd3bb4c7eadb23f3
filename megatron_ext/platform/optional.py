"""Optional accelerator libraries: found or not, never required."""

import importlib.util


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


# Transformer Engine: `pip install megatron_ext[gpu]`, or NVIDIA's PyTorch containers.
HAVE_TE = _importable("transformer_engine")
# NVIDIA Apex (fused kernels): only from NVIDIA's containers or a source build. The PyPI package
# named `apex` is an unrelated project; this checks for NVIDIA's module, not that name.
HAVE_APEX = _importable("apex") and _importable("amp_C")
# Mamba2 CUDA kernels (megatron's MambaMixer needs them); without them the hybrid model uses
# the pure-PyTorch mixer.
HAVE_MAMBA_SSM = _importable("mamba_ssm")
# Apex's fused weight-gradient accumulation kernel (megatron's gradient_accumulation_fusion).
HAVE_WGRAD_ACCUMULATION = _importable("fused_weight_gradient_mlp_cuda")
