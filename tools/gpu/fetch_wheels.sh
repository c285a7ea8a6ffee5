#!/usr/bin/env bash
# Download, on this machine, the wheels the lent GPU machine lacks, into .whl/
# (ignored by git), cut to fit the device tool's 64 MiB per call.
#
#   tools/gpu/fetch_wheels.sh            # mlx[cuda13] 0.32.4, mlx-lm 0.32.2
#   MLX_LM_VERSION=0.31.3 tools/gpu/fetch_wheels.sh
#
# The GPU machine has no network. Its python3 (3.12) already holds numpy,
# transformers, tokenizers, httpx, pluggy, pytest, hypothesis and the NVIDIA
# CUDA 13 wheels libmlx loads (see the device library's KINDS.md); what is
# missing travels as wheels. mlx-cuda-13 (~90 MB; ~70 MB even under xz -9)
# is over the per-call limit, so it travels in two pieces:
#
#   .whl/part1/   the first PART1_MB of the mlx-cuda-13 wheel        (call 1)
#   .whl/part2/   its rest, every other wheel, and SHA256SUMS        (call 2)
#
# tools/gpu/device_setup.sh (run on the device) keeps piece 1 in /tmp between
# the two calls, joins the pieces, checks the checksum and installs everything
# into /tmp/site. tools/gpu/run_on_device.md gives the device-tool calls.
set -euo pipefail

MLX_VERSION=${MLX_VERSION:-0.32.4}
MLX_LM_VERSION=${MLX_LM_VERSION:-0.32.2}
PART1_MB=${PART1_MB:-50}
PYTHON=${PYTHON:-python3}

repo=$(git rev-parse --show-toplevel)
cd "$repo"

# The wheels must not travel as untracked files (they would count twice)
# nor be committed.
exclude=.git/info/exclude
mkdir -p .git/info
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"

# The device's python3 is CPython 3.12 on x86-64, glibc 2.35 or newer.
download() {
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --disable-pip-version-check \
        --python-version 3.12 --implementation cp \
        --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl/download "$@"
}

# One version of each: two versions of a name stop the device's install.
# mlx-lm's own needs (transformers, sentencepiece, protobuf, pyyaml, jinja2)
# and pluggy, httpx, pytest, pytest-timeout, hypothesis, requests are there.
# openai (tests/test_openai_sdk.py) brings httpx2 and pydantic, which are not.
WHEELS=(
    "mlx==$MLX_VERSION" "mlx-cuda-13==$MLX_VERSION" "mlx-lm==$MLX_LM_VERSION"
    structlog==26.1.0 watchdog==7.1.0
    openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
    pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    typing_extensions==4.16.0 jiter==0.19.0 sniffio==1.3.1
)

rm -rf .whl/part1 .whl/part2
mkdir -p .whl/download .whl/part1 .whl/part2
download "${WHEELS[@]}"

# The guardian itself, for its metadata: its plugins are entry points. The
# tree's own guardian/ comes first on sys.path there (python -m runs from the
# repository root), so the code under test is always the checkout's.
"$PYTHON" -m pip wheel -q --no-deps --disable-pip-version-check -w .whl/download .

cuda_wheel=$(ls .whl/download/mlx_cuda_13-"$MLX_VERSION"-*.whl)
name=$(basename "$cuda_wheel")
# shasum -a 256 writes what sha256sum writes (macOS has the first alone before 14).
(cd .whl/download && { sha256sum "$name" 2>/dev/null || shasum -a 256 "$name"; }) > .whl/part2/SHA256SUMS
split -b "${PART1_MB}M" -a 1 "$cuda_wheel" ".whl/split-"  # .whl/split-a, -b, ... (BSD split has no -d)
mv .whl/split-a ".whl/part1/$name.part0"
mv .whl/split-b ".whl/part2/$name.part1"
[ ! -e .whl/split-c ] || { echo "mlx-cuda-13 needs more than two pieces: raise PART1_MB" >&2; exit 1; }
for wheel in .whl/download/*.whl; do
    [ "$wheel" = "$cuda_wheel" ] || cp "$wheel" .whl/part2/
done

# The incident's mlx-lm as well, for a second run over the same install
# (EXTRA_WHEELS=.whl/mlx-lm-0.31.3, tools/gpu/run_on_device.md).
if [ "$MLX_LM_VERSION" != 0.31.3 ]; then
    rm -rf .whl/mlx-lm-0.31.3 && mkdir -p .whl/mlx-lm-0.31.3
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --disable-pip-version-check \
        -d .whl/mlx-lm-0.31.3 mlx-lm==0.31.3
fi

# Each call carries one part beside the working tree (tracked and untracked
# files, not ignored ones): together they must stay under 64 MiB.
tree_kb=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | "$PYTHON" -c '
import os, sys
print(sum(os.path.getsize(p) for p in sys.stdin.buffer.read().split(b"\0") if p and os.path.isfile(p)) // 1024)')
for part in part1 part2; do
    part_kb=$(du -sk ".whl/$part" | cut -f1)
    total_mib=$(( (tree_kb + part_kb) / 1024 ))
    echo ".whl/$part: $((part_kb / 1024)) MiB; with the working tree: ${total_mib} MiB of 64"
    [ "$total_mib" -lt 63 ] || { echo "over the device's 64 MiB per call" >&2; exit 1; }
done
