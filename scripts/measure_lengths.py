"""Measure a frozen length histogram from text files on this machine.

Lengths are in tokens estimated as bytes / BYTES_PER_TOKEN (3.6, a typical BPE ratio for source
code; the project's byte tokenizer would count one token per byte). The result is a JSON
histogram (log-spaced bins, counts) under megatron_ext/dpp/planning/data/, read by
megatron_ext.dpp.planning.lengths; it is committed, so planning does not depend on what is installed.

    python scripts/measure_lengths.py --name python_stdlib            # the stdlib .py files
    python scripts/measure_lengths.py --name site_packages --root "$(python -c 'import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))')"
"""

from __future__ import annotations

import argparse
import json
import math
import sysconfig
from pathlib import Path

import numpy as np

BYTES_PER_TOKEN = 3.6
OUT_DIR = Path(__file__).resolve().parents[1] / "megatron_ext" / "dpp" / "data"


def file_tokens(root: Path, suffixes: tuple[str, ...]) -> list[int]:
    sizes = [p.stat().st_size for p in root.rglob("*") if p.suffix in suffixes and p.is_file() and not p.is_symlink()]
    return [max(1, math.ceil(s / BYTES_PER_TOKEN)) for s in sizes if s > 0]


def histogram(tokens: list[int], bins_per_octave: int = 2) -> tuple[list[int], list[int]]:
    top = math.ceil(math.log2(max(tokens) + 1) * bins_per_octave)
    edges = sorted({max(1, round(2 ** (i / bins_per_octave))) for i in range(0, top + 1)})
    counts, _ = np.histogram(tokens, bins=edges)
    return edges, counts.tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", default="python_stdlib")
    ap.add_argument("--root", default=sysconfig.get_paths()["stdlib"])
    ap.add_argument("--suffixes", default=".py", help="comma-separated file suffixes")
    ap.add_argument("--out-dir", default=str(OUT_DIR))
    args = ap.parse_args()
    tokens = file_tokens(Path(args.root), tuple(args.suffixes.split(",")))
    edges, counts = histogram(tokens)
    # The last edge must exceed the longest file, so every file lands in a bin.
    edges[-1] = max(edges[-1], max(tokens) + 1)
    out = {
        "name": args.name,
        "source": f"{args.suffixes} files under {Path(args.root).name}/, tokens = ceil(bytes / {BYTES_PER_TOKEN})",
        "files": len(tokens),
        "total_tokens": int(sum(tokens)),
        "edges": edges,
        "counts": counts,
    }
    path = Path(args.out_dir) / f"lengths_{args.name}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    t = np.array(tokens)
    print(f"{path}: {len(t)} files; " + ", ".join(f"<= {k // 1024}K {np.mean(t <= k):.1%}" for k in (2048, 4096, 16384, 65536)) + f"; max {t.max()}")


if __name__ == "__main__":
    main()
