#!/usr/bin/env bash
# The wheels a lent GPU machine needs beyond its image (docs/platform.md, "A lent GPU"), built
# here into .whl/ (git-ignored), for scripts/gpu/check.sh to install there with no registry.
# That machine runs CPython 3.12 on x86-64 Linux with its own CUDA torch, which stays as it is;
# its image already holds numpy, scipy, psutil, tokenizers, sentencepiece, protobuf,
# tensorboard, tqdm, safetensors, jinja2, pyyaml, packaging, requests, transformers, triton and
# pytest. What megatron_ext imports at run time besides those is listed below, each at the
# version CI runs. megatron_ext itself is not a wheel here: check.sh runs the working tree the
# device tool carries, so the code checked is the code of the tree, never an older build of it.
# Refuses two versions of one package (they would stop pip's install there) and a wheelhouse of
# 64 MB or more (the device tool carries 64 MiB in all); prints the size.
set -euo pipefail
cd "$(dirname "$0")/../.."
python="${PYTHON:-python3}"
# Binary wheels for CPython 3.12 on manylinux x86-64 (pip matches each glibc level exactly).
binary=(
    megatron-core==0.16.1
    hydra-core==1.3.8
    omegaconf==2.3.1
    gguf==0.19.0
)
# Published as a source distribution only (hydra-core and omegaconf need 4.9.*): pure Python, so
# the wheel built here serves any Python 3.
from_source=(antlr4-python3-runtime==4.9.3)
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
rm -rf .whl && mkdir .whl
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "${binary[@]}"
"$python" -m pip wheel -q --no-deps -w .whl "${from_source[@]}"
names=$(for w in .whl/*.whl; do basename "$w" | cut -d- -f1 | tr 'A-Z' 'a-z'; done)
twice=$(echo "$names" | sort | uniq -d)
if [ -n "$twice" ]; then
    echo "wheelhouse: more than one version of: $twice" >&2
    exit 1
fi
bytes=$(cat .whl/*.whl | wc -c)
if [ "$bytes" -ge 64000000 ]; then
    echo "wheelhouse: .whl/ holds $bytes bytes, over the 64 MB the device tool carries" >&2
    exit 1
fi
echo "wheelhouse: $(ls .whl/*.whl | wc -l) wheels, $bytes bytes ($((bytes / 1000)) kB) in .whl/"
