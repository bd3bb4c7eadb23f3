"""megatron_ext: training on NVIDIA Megatron-Core that does not stand still."""

import warnings

# Known, harmless notices megatron-core and torch print on every rank on a CPU machine; they
# would bury the progress bar. Anything else still shows.
for _message in (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"full scope is deprecated",
    r"The \.grad attribute of a Tensor that is not a leaf Tensor",
    r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
    # megatron's checkpoint loader calls these deprecated torch functions on every resume
    r"`load_state_dict` is deprecated",
    r"Please use DTensor instead and we are deprecating ShardedTensor",
):
    warnings.filterwarnings("ignore", message=_message)

from megatron_ext.platform.versions import require_checked_versions  # noqa: E402

require_checked_versions()  # torch and megatron-core within what platform/ was checked against

from megatron_ext.platform.eager_fusions import install as _install_eager_fusions  # noqa: E402

_install_eager_fusions()
