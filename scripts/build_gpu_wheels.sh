#!/usr/bin/env bash
# Build the wheels that scripts/gpu_check.sh installs on a GPU machine with no package registry: this project,
# DeepSpeed (the version installed in .venv), the small dependencies of DeepSpeed and of the project that a CUDA
# torch + transformers image may lack or have in another version (pydantic and its parts, msgpack, psutil, ...), and
# pytest with its dependencies (for tests/gpu), each pinned to what .venv runs. Binary wheels come for every CPython
# in GPU_PYTHON_VERSIONS (default 3.10 3.11 3.12 3.13), so one folder fits the image whatever its Python.
#
# The folder also gets requirements.txt: each requirement on a carried distribution (and on the ones the checks import
# but that are not carried, such as transformers) as the project, DeepSpeed or the carried wheel that needs it declares
# it. On the GPU machine scripts/gpu_check_install.py reads it and installs a carried wheel only where the image's
# version is missing or does not fit (the project and DeepSpeed always).
#
#   bash scripts/build_gpu_wheels.sh [OUT_DIR]      # default build/gpu_wheels (ignored by git: /build/)
#   GPU_PYTHON_VERSIONS=3.12 bash scripts/build_gpu_wheels.sh   # binary wheels for one Python only
#   GPU_PLATFORM=manylinux2014_aarch64 bash scripts/build_gpu_wheels.sh   # another platform (default x86_64)
#
# Then carry OUT_DIR to the GPU machine next to the checkout (e.g. the device tool's carry=["build/gpu_wheels"])
# and run `bash scripts/gpu_check.sh` there. The folder is about 16 MiB (the carry limit is 64 MiB).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-build/gpu_wheels}"
PY="${PYTHON:-.venv/bin/python}"
PYVERS="${GPU_PYTHON_VERSIONS:-${GPU_PYTHON_VERSION:-3.10 3.11 3.12 3.13}}"
PLATFORM="${GPU_PLATFORM:-manylinux2014_x86_64}"

rm -rf "$OUT" && mkdir -p "$OUT"
version_of() { "$PY" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$1"; }
DS_VERSION="$(version_of deepspeed)"

# The project: a pure-Python wheel (assets included), built with the venv's setuptools.
"$PY" -m pip wheel --no-deps --no-build-isolation -q -w "$OUT" .
# DeepSpeed as a pure-Python wheel (no pre-built ops: ZeRO with torch's AdamW needs none). The sdist's setup.py
# imports torch, hence no build isolation (the venv's torch is used only to build; nothing of it goes in the wheel).
DS_BUILD_OPS=0 "$PY" -m pip wheel --no-deps --no-build-isolation -q -w "$OUT" "deepspeed==$DS_VERSION" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
# DeepSpeed's requirements that a plain CUDA-torch + transformers image may lack (torch, numpy, packaging, tqdm come
# with torch and transformers), pydantic's own, the project's psutil, and pytest's; pinned to what the venv runs.
DEPS=()
for dist in hjson msgpack ninja py-cpuinfo einops pydantic pydantic-core annotated-types typing-inspection \
    typing-extensions psutil pytest pluggy iniconfig pygments; do
    DEPS+=("$dist==$(version_of "$dist")")
done
for pyver in $PYVERS; do
    # pip skips a file it has downloaded already (the pure wheels, and abi3 ones such as psutil's)
    "$PY" -m pip download --no-deps --only-binary=:all: -q --python-version "$pyver" --platform "$PLATFORM" \
        --implementation cp -d "$OUT" "${DEPS[@]}" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
done
"$PY" scripts/gpu_check_install.py requirements "$OUT"

ls -1 "$OUT"
echo "requirements ($OUT/requirements.txt):"
sed 's/^/  /' "$OUT/requirements.txt"
echo "wheels in $OUT: $(du -sh "$OUT" | cut -f1) (deepspeed $DS_VERSION, python $PYVERS, $PLATFORM)"
