#!/usr/bin/env bash
# The first lent GPU's check (docs/platform.md, "A lent GPU"): at most 8 minutes on one GPU,
# everything into one JSON (--out), written after each part. On the GPU machine the packages
# its image lacks come from the wheelhouse .whl/ (scripts/gpu/wheelhouse.sh, built beforehand on
# a machine with a package registry), installed into .whl/site/ beside the machine's own torch,
# which is left alone. --dry-run runs every part on the CPU at tiny sizes with the Python
# environment as it is (what CI runs). $PYTHON: the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/../.."
python="${PYTHON:-python3}"
dry_run=0
for arg in "$@"; do
    [ "$arg" = "--dry-run" ] && dry_run=1
done
if [ "$dry_run" = 0 ]; then
    if ! ls .whl/*.whl >/dev/null 2>&1; then
        echo "scripts/gpu/check.sh: no wheels in .whl/: run scripts/gpu/wheelhouse.sh where pip reaches a registry, and carry .whl" >&2
        exit 2
    fi
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .whl/site .whl/*.whl
    export PYTHONPATH="$PWD/.whl/site${PYTHONPATH:+:$PYTHONPATH}"
fi
# The working tree's megatron_ext, the one under check, ahead of any installed copy.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" scripts/gpu/check.py "$@"
