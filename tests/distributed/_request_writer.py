"""A training run whose reshard request file is rewritten while it trains, for
test_reshard_live.py.

    python tests/distributed/_request_writer.py SUMMARY.json plugins=[requests,reshard] \
        requests.file=REQ requests.cases=CASES.json reshard.request_file=REQ ...overrides

The `requests` plugin (listed before reshard, so it runs first at each step) writes the k-th
text of CASES.json (a JSON list of strings, each character one byte: any bytes can be written)
to `requests.file` before step k, on rank 0.
The run's summary (losses and notes) is written to SUMMARY.json.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

from megatron_ext.plugin import Plugin, register_plugin


@dataclass
class RequestsConfig:
    file: str = ""
    cases: str = ""  # the JSON list of texts, one per step from step 1


@register_plugin
class RequestsPlugin(Plugin):
    name = "requests"
    config_class = RequestsConfig

    def setup(self, trainer) -> None:
        with open(self.cfg.cases) as f:
            self._cases = json.load(f)

    def on_step_begin(self, trainer, step: int) -> None:
        import torch.distributed as dist

        if dist.get_rank() == 0 and step <= len(self._cases):
            with open(self.cfg.file, "wb") as f:  # latin-1: one byte per character
                f.write(self._cases[step - 1].encode("latin-1"))


if __name__ == "__main__":
    from megatron_ext.train import run_from_overrides

    summary = run_from_overrides(sys.argv[2:])
    with open(sys.argv[1], "w") as f:
        json.dump(summary, f)
