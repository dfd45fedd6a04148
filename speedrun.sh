#!/usr/bin/env bash
# nanorl speedrun: tokenizer -> base -> mid -> SFT -> RL -> report, in one command.
#   bash speedrun.sh            # 8xH100 (or any CUDA node): the real pipeline on all GPUs
#   NANORL_TINY=1 bash speedrun.sh   # or any machine without CUDA: tiny model, offline curriculum, CPU
#   bash speedrun.sh --force    # rerun stages that already finished
# WANDB_RUN=name enables wandb logging. Each stage's log is in $NANORL_BASE_DIR/logs/<stage>.log.
set -euo pipefail
cd "$(dirname "$0")"
FORCE=0
[ "${1:-}" = "--force" ] && FORCE=1
export NANORL_BASE_DIR="${NANORL_BASE_DIR:-$HOME/.cache/nanorl}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
mkdir -p "$NANORL_BASE_DIR/logs" "$NANORL_BASE_DIR/done"
WANDB_RUN="${WANDB_RUN:-dummy}"
T_START=$(date +%s)

# --- environment -------------------------------------------------------------------------------
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
PY=.venv/bin/python
$PY -m pip install -q --upgrade pip >/dev/null
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && [ "${NANORL_TINY:-0}" != "1" ]; then
    TINY=0
    NGPU=$(nvidia-smi -L | wc -l)
else
    TINY=1
    NGPU=1
    $PY -c "import torch" 2>/dev/null || $PY -m pip install -q torch==2.13.0 || $PY -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
fi
$PY -m pip install -q -e ".[dev]"

if [ $TINY = 1 ]; then
    echo "== nanorl speedrun: no CUDA GPU (or NANORL_TINY=1): tiny model on the offline curriculum, CPU, no network =="
    export OMP_NUM_THREADS=$(nproc)
    RUN="$PY -m"
else
    echo "== nanorl speedrun: $NGPU GPU(s), the full pipeline =="
    RUN="$PY -m torch.distributed.run --standalone --nproc_per_node=$NGPU -m"
fi

# run one stage: skipped when it already finished (unless --force); on failure, name the stage and its log
stage() {
    local name=$1; shift
    local log="$NANORL_BASE_DIR/logs/$name.log" marker="$NANORL_BASE_DIR/done/$name"
    if [ -f "$marker" ] && [ $FORCE = 0 ]; then echo "-- $name: already done, skipping (--force to rerun)"; return; fi
    echo "-- $name: $*"
    local t0=$(date +%s)
    if ! "$@" > >(tee "$log") 2>&1; then
        echo "!! stage '$name' failed; its log is $log. Earlier stages' checkpoints and report sections are intact; rerun to resume from here." >&2
        exit 1
    fi
    echo "-- $name done in $(( $(date +%s) - t0 ))s"
    touch "$marker"
}
