#!/usr/bin/env bash
# GPU acceptance checks on one GPU (an H200 is what it was written for), in under 8 minutes, each check in a worker
# process with its own time limit: ZeRO-3 bf16 training steps of the actor and the critic on a Qwen2-0.5B-shaped model
# (tokens/s, MFU = 6 * matmul weights * tokens / s / 989 TFLOP/s) with an offload/reload round trip, zero.Init's
# construction memory, a weight sync through the project's own transport (WeightSender -> a receiver in another
# process, cuda_ipc, in buckets, twice: GB/s, bit-exact), attention on padded vs unpadded rows and packed vs padded
# log-probs (sdpa, flash_attention_2 when installed), the HF rollout engine's generate + load_state_dict, a ZeRO-3
# checkpoint save/step/load round trip, and pytest tests/gpu. One JSON line per check, then a summary line (always
# last, also after a check that hung or crashed); exit 1 if any check failed. Details: scripts/gpu_check/__init__.py.
#
# The GPU machine needs a CUDA torch and transformers; no Ray, no vLLM and no package registry. The project and
# DeepSpeed come as wheels built here by scripts/build_gpu_wheels.sh (build/gpu_wheels/, about 16 MiB, binary wheels
# for CPython 3.10-3.13) and carried with the checkout; they are installed with pip --no-index --no-deps into a private
# folder put first on PYTHONPATH. The project and DeepSpeed always; any other carried wheel only where the machine's
# version is missing or does not satisfy the requirement in build/gpu_wheels/requirements.txt (one log line each on
# stderr: scripts/gpu_check_install.py). The machine's own torch and transformers stay as they are.
#
#   bash scripts/build_gpu_wheels.sh                                  # here, once: build/gpu_wheels/*.whl
#   bash scripts/gpu_check.sh [--wheels DIR] [--only LIST]            # on the GPU machine
#   bash scripts/gpu_check.sh --dry-run                               # CPU: tiny models, gloo, fp32 (CI)
#
# --only: a comma-separated subset of train_actor, train_critic (train: both), zero_init, weight_sync (also: ipc),
# attention, packing, hf_generate, ds_checkpoint, pytest_gpu.
# Environment: PYTHON (default: .venv/bin/python if present, else python3); GPU_CHECK_LIMIT_<CHECK> (seconds, e.g.
# GPU_CHECK_LIMIT_TRAIN_ACTOR=120: one check's time limit; the defaults sum to 440 s on the GPU); GPU_CHECK_TIMEOUT
# (seconds, default 450: all checks together; a check starts with at most what is left of it).
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
        -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument '$1' (expected --dry-run, --wheels DIR, --only LIST)" >&2; exit 2 ;;
    esac
    shift
done

if [[ -n "${PYTHON:-}" ]]; then PY="$PYTHON"
elif [[ -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"
else PY="$(command -v python3 || command -v python)"; fi

export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export MASTER_ADDR=127.0.0.1 RANK=0 WORLD_SIZE=1 LOCAL_RANK=0
if ((DRY)); then
    export RLHF_DEVICE=cpu CUDA_VISIBLE_DEVICES=""
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
else
    export RLHF_DEVICE=cuda
fi

# (found, not imported: DeepSpeed's import takes seconds and logs to stdout)
if "$PY" -c 'import importlib.util as u, sys; sys.exit(not (u.find_spec("rlhf_core") and u.find_spec("deepspeed")))' \
    && [[ ! -d "$WHEELS" ]]; then
    : # the project and DeepSpeed are importable already (the CPU venv, or a prepared GPU image)
elif [[ -d "$WHEELS" ]] && ! ((DRY)); then
    SITE="${TMPDIR:-/tmp}/rlhf_gpu_check_site"
    rm -rf "$SITE" && mkdir -p "$SITE"
    # decided against what the machine has now (SITE is empty and not on the path yet): one stderr line per decision
    PLAN="$("$PY" "$ROOT/scripts/gpu_check_install.py" plan "$WHEELS")" || exit 2
    mapfile -t TO_INSTALL <<<"$PLAN"
    echo "gpu_check: installing ${#TO_INSTALL[@]} wheel(s) from $WHEELS into $SITE" >&2
    "$PY" -m pip install -q --no-index --no-deps --ignore-requires-python --target "$SITE" "${TO_INSTALL[@]}" >&2
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    export PATH="$SITE/bin:$PATH"
elif ! ((DRY)); then
    echo "gpu_check: no wheels at $WHEELS and rlhf_core/deepspeed not importable: run scripts/build_gpu_wheels.sh" \
         "here and carry build/gpu_wheels, or pass --wheels DIR" >&2
    exit 2
fi

# Each check has its own time limit inside, and the summary line comes last whatever a check does; this outer limit
# only guards against the driver itself hanging.
exec timeout --kill-after=5 "$((${GPU_CHECK_TIMEOUT:-450} + 20))" "$PY" "$ROOT/scripts/gpu_check" "${PASS[@]}"
