#!/usr/bin/env bash
# GPU acceptance checks of the PPO roles on one GPU (an H200 is what it was written for), in under 8 minutes:
# ZeRO-3 bf16 training steps of the actor and the critic on a Qwen2-0.5B-shaped model (tokens/s, MFU), zero.Init's
# construction memory, CUDA-IPC weight handoff into another process (GB/s), and attention on padded vs unpadded rows
# (sdpa, flash_attention_2 when installed). One JSON line per check, then a summary line; exit 1 if any check failed.
# What each check measures, and the FLOPs formula: scripts/gpu_check.py's docstring.
#
# The GPU machine needs a CUDA torch and transformers; no Ray, no vLLM and no package registry. The project and
# DeepSpeed come as wheels built here by scripts/build_gpu_wheels.sh (build/gpu_wheels/, about 6 MiB) and carried
# with the checkout; they are installed with pip --no-index --no-deps into a private folder put first on PYTHONPATH
# (the machine's own packages stay as they are; a dependency wheel is installed only when that package is missing).
#
#   bash scripts/build_gpu_wheels.sh                                  # here, once: build/gpu_wheels/*.whl
#   bash scripts/gpu_check.sh [--wheels DIR] [--only train,zero_init,ipc,attention]   # on the GPU machine
#   bash scripts/gpu_check.sh --dry-run                               # CPU: tiny models, gloo, fp32 (CI)
#
# Environment: PYTHON (default: .venv/bin/python if present, else python3), GPU_CHECK_TIMEOUT (seconds, default 470).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

DRY=0
WHEELS="$ROOT/build/gpu_wheels"
PASS=()
while (($#)); do
    case "$1" in
        --dry-run) DRY=1; PASS+=("--dry-run") ;;
        --wheels) WHEELS="$2"; shift ;;
        --wheels=*) WHEELS="${1#--wheels=}" ;;
        --only) PASS+=("--only" "$2"); shift ;;
        --only=*) PASS+=("$1") ;;
        -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument '$1' (expected --dry-run, --wheels DIR, --only LIST)" >&2; exit 2 ;;
    esac
    shift
done

if [[ -n "${PYTHON:-}" ]]; then PY="$PYTHON"
elif [[ -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"
else PY="$(command -v python3 || command -v python)"; fi

export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export MASTER_ADDR=127.0.0.1 RANK=0 WORLD_SIZE=1 LOCAL_RANK=0
export MASTER_PORT="${MASTER_PORT:-$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
if ((DRY)); then
    export RLHF_DEVICE=cpu CUDA_VISIBLE_DEVICES=""
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
else
    export RLHF_DEVICE=cuda
fi

if "$PY" -c 'import rlhf_core, deepspeed' 2>/dev/null && [[ ! -d "$WHEELS" ]]; then
    : # the project and DeepSpeed are importable already (the CPU venv, or a prepared GPU image)
elif [[ -d "$WHEELS" ]] && ! ((DRY)); then
    SITE="${TMPDIR:-/tmp}/rlhf_gpu_check_site"
    # the project and DeepSpeed always from the wheels; any other wheel only if that distribution is missing
    mapfile -t TO_INSTALL < <("$PY" - "$WHEELS" <<'PYEOF'
import importlib.metadata as md, pathlib, sys
for whl in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    dist = whl.name.split("-")[0].replace("_", "-")
    try:
        md.version(dist)
        present = dist not in ("rlhf-pipeline", "deepspeed")
    except md.PackageNotFoundError:
        present = False
    if not present:
        print(whl)
PYEOF
    )
    rm -rf "$SITE" && mkdir -p "$SITE"
    echo "gpu_check: installing ${#TO_INSTALL[@]} wheel(s) from $WHEELS into $SITE" >&2
    "$PY" -m pip install -q --no-index --no-deps --ignore-requires-python --target "$SITE" "${TO_INSTALL[@]}" >&2
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    export PATH="$SITE/bin:$PATH"
elif ! ((DRY)); then
    echo "gpu_check: no wheels at $WHEELS and rlhf_core/deepspeed not importable: run scripts/build_gpu_wheels.sh" \
         "here and carry build/gpu_wheels, or pass --wheels DIR" >&2
    exit 2
fi

exec timeout "${GPU_CHECK_TIMEOUT:-470}" "$PY" "$ROOT/scripts/gpu_check.py" "${PASS[@]}"
