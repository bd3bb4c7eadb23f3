"""Where a run keeps its rewrite of a checkpoint whose optimizer state its layout cannot read
(`dp_reshardable` saved in another layout): under `data.cache_dir`, named by the source and the
layout. The launcher writes it before the workers start (training/relayout.py); preflight and
the Trainer find it here.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from megatron_ext.checkpointing import torch_dist as ckpt
from megatron_ext.checkpointing.megatron_lm import layout_key, optimizer_layout_problem
from megatron_ext.config.schema import Config


def needs_relayout(cfg: Config, root: str, iteration: int) -> bool:
    """Whether resuming checkpoint `iteration` of `root` with `cfg` restores an optimizer state
    that only its saving layout reads (`dp_reshardable` saved in another layout)."""
    if not cfg.checkpoint.load_optim or cfg.checkpoint.finetune:
        return False
    return optimizer_layout_problem(ckpt.load_common(root, iteration), layout_key(cfg.parallel)) is not None


def relaid_copy(cfg: Config, root: str, iteration: int) -> Path:
    """Where a run in `cfg`'s layout keeps its rewrite of checkpoint `iteration` of `root`:
    under `data.cache_dir`, named by the source and the layout (a later run reuses it)."""
    digest = hashlib.sha256(json.dumps([os.path.realpath(root), iteration, layout_key(cfg.parallel)]).encode())
    return Path(os.path.expanduser(cfg.data.cache_dir), "relayout", digest.hexdigest()[:16])


def relaid_copy_ready(cfg: Config, root: str, iteration: int) -> bool:
    """Whether `relaid_copy` holds the whole rewrite (it is renamed into place when complete)."""
    copy = relaid_copy(cfg, root, iteration)
    return copy.is_dir() and ckpt.latest_iteration(copy) == iteration


