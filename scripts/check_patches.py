"""Check that patches/*.diff apply, in order, to the installed megatron-core.

    python scripts/check_patches.py [--patches DIR] [--keep DIR]

The diffs are upstream-ready versions of the runtime fixes in megatron_ext/platform/cpu_compat.py
and target megatron-core 0.16.1. This copies the installed `megatron/core` to a temporary folder,
applies every patch (a dry run first, then for real), byte-compiles the files they touch and
imports those modules from the patched copy (which catches import cycles and missing imports).
Exit status: 0 when all pass or when another megatron-core version is installed (with a warning:
the diffs are not meant for it), 1 on any failure.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import py_compile
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

TARGET_VERSION = "0.16.1"
REPO = Path(__file__).resolve().parents[1]


def installed_megatron_core() -> Path:
    """The `megatron/core` folder Python imports (found without importing it: that takes
    seconds)."""
    spec = importlib.util.find_spec("megatron.core")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("megatron-core is not installed")
    return Path(list(spec.submodule_search_locations)[0])


def patch_command(patch_file: Path, root: Path, dry_run: bool) -> list[str]:
    if shutil.which("patch"):
        cmd = ["patch", "-p1", "--batch", "--forward", "--no-backup-if-mismatch", "-d", str(root)]
        return cmd + (["--dry-run"] if dry_run else []) + ["-i", str(patch_file)]
    # `git apply` outside a repository applies to the working directory, like patch.
    return ["git", "apply", "-p1"] + (["--check"] if dry_run else []) + [str(patch_file)]


def apply(patch_file: Path, root: Path) -> tuple[bool, str]:
    for dry_run in (True, False):
        done = subprocess.run(
            patch_command(patch_file, root, dry_run), cwd=root, capture_output=True, text=True
        )
        if done.returncode != 0:
            return False, (done.stdout + done.stderr).strip()
    return True, ""


def touched_files(patch_file: Path) -> list[str]:
    """Paths (relative to the folder holding `megatron/`) that the diff writes."""
    return [
        line[len("+++ b/") :].split("\t")[0].strip()
        for line in patch_file.read_text().splitlines()
        if line.startswith("+++ b/")
    ]


def import_modules(root: Path, files: list[str]) -> tuple[bool, str]:
    """Import the patched modules from the copy, in a fresh interpreter."""
    modules = sorted({f[: -len(".py")].replace("/", ".") for f in files})
    code = (
        "import importlib, megatron.core\n"
        f"assert megatron.core.__file__.startswith({str(root)!r}), megatron.core.__file__\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
    )
    pythonpath = os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=pythonpath)
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code], env=env, capture_output=True, text=True
    )
    return done.returncode == 0, done.stderr.strip()[-2000:]


def check(patches: list[Path], root: Path) -> bool:
    ok = True
    files: list[str] = []
    for patch_file in patches:
        applied, output = apply(patch_file, root)
        print(f"{'OK' if applied else 'FAILED':6} {patch_file.name}")
        if not applied:
            print("       " + output.replace("\n", "\n       "))
            ok = False
            continue
        files += touched_files(patch_file)
    for f in sorted(set(files)):
        try:
            py_compile.compile(str(root / f), doraise=True)
        except py_compile.PyCompileError as e:
            print(f"FAILED compile {f}: {e.msg}")
            ok = False
    if ok and files:
        imported, output = import_modules(root, files)
        print(f"{'OK' if imported else 'FAILED':6} import of the {len(set(files))} patched modules")
        if not imported:
            print("       " + output.replace("\n", "\n       "))
            ok = False
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--patches", type=Path, default=REPO / "patches")
    parser.add_argument(
        "--keep", type=Path, help="build the patched copy in this (new) folder and keep it"
    )
    args = parser.parse_args(argv)

    version = importlib.metadata.version("megatron-core")
    if version != TARGET_VERSION:
        print(
            f"WARNING: megatron-core {version} is installed; patches/ targets {TARGET_VERSION}. "
            "Not checked."
        )
        return 0
    patches = sorted(args.patches.glob("*.diff"))
    if not patches:
        print(f"FAILED no patches in {args.patches}")
        return 1

    with tempfile.TemporaryDirectory(prefix="check_patches_") as tmp:
        root = args.keep or Path(tmp)
        shutil.copytree(
            installed_megatron_core(),
            root / "megatron" / "core",
            ignore=shutil.ignore_patterns("__pycache__"),
        )
        ok = check(patches, root)
    print(f"{len(patches)} patches against megatron-core {version}: {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
