#!/usr/bin/env bash
# Build the wheels that scripts/gpu_check.sh installs on a GPU machine with no package registry: this project,
# DeepSpeed (the version installed in .venv) and DeepSpeed's own small dependencies, for the GPU machine's Python.
# The GPU machine is assumed to have a CUDA torch and transformers (hence numpy, packaging, pyyaml, tqdm, fsspec);
# gpu_check.sh installs a dependency wheel only when that distribution is missing there.
#
#   bash scripts/build_gpu_wheels.sh [OUT_DIR]      # default build/gpu_wheels (ignored by git: /build/)
#   GPU_PYTHON_VERSION=3.12 bash scripts/build_gpu_wheels.sh   # binary wheels for another Python (default 3.11)
#
# Then carry OUT_DIR to the GPU machine next to the checkout (e.g. the device tool's carry=["build/gpu_wheels"])
# and run `bash scripts/gpu_check.sh` there. The folder is about 7 MiB (the carry limit is 64 MiB).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-build/gpu_wheels}"
PY="${PYTHON:-.venv/bin/python}"
PYVER="${GPU_PYTHON_VERSION:-3.11}"
PLATFORM="${GPU_PLATFORM:-manylinux2014_x86_64}"

rm -rf "$OUT" && mkdir -p "$OUT"
DS_VERSION="$("$PY" -c 'import importlib.metadata as m; print(m.version("deepspeed"))')"

# The project: a pure-Python wheel (assets included), built with the venv's setuptools.
"$PY" -m pip wheel --no-deps --no-build-isolation -q -w "$OUT" .
# DeepSpeed as a pure-Python wheel (no pre-built ops: ZeRO with torch's AdamW needs none). The sdist's setup.py
# imports torch, hence no build isolation (the venv's torch is used only to build; nothing of it goes in the wheel).
DS_BUILD_OPS=0 "$PY" -m pip wheel --no-deps --no-build-isolation -q -w "$OUT" "deepspeed==$DS_VERSION"
# DeepSpeed's requirements a plain CUDA-torch + transformers image may lack, and the project's (psutil), pinned to
# what the venv runs; binary ones for the GPU machine's Python and platform.
DEPS=()
for dist in hjson msgpack ninja py-cpuinfo einops pydantic pydantic-core annotated-types typing-inspection psutil; do
    DEPS+=("$dist==$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$dist")")
done
"$PY" -m pip download --no-deps --only-binary=:all: -q --python-version "$PYVER" --platform "$PLATFORM" \
    --implementation cp -d "$OUT" "${DEPS[@]}"

ls -1 "$OUT"
echo "wheels in $OUT: $(du -sh "$OUT" | cut -f1) (deepspeed $DS_VERSION, python $PYVER, $PLATFORM)"
