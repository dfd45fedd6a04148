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
[ "${NANORL_SKIP_INSTALL:-0}" = "1" ] || $PY -m pip install -q --upgrade pip >/dev/null
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && [ "${NANORL_TINY:-0}" != "1" ]; then
    TINY=0
    NGPU=$(nvidia-smi -L | wc -l)
else
    TINY=1
    NGPU=1
    $PY -c "import torch" 2>/dev/null || $PY -m pip install -q torch==2.13.0 || $PY -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
fi
[ "${NANORL_SKIP_INSTALL:-0}" = "1" ] || $PY -m pip install -q -e ".[dev]"

if [ $TINY = 1 ]; then
    echo "== nanorl speedrun: no CUDA GPU (or NANORL_TINY=1): tiny model on the offline curriculum, CPU, no network =="
    export OMP_NUM_THREADS=$(nproc --all)  # --all: plain nproc echoes OMP_NUM_THREADS back
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
    echo $(( $(date +%s) - t0 )) > "$marker"  # the marker holds the stage's seconds, for the report's total
}

# --- the stages ------------------------------------------------------------------------------------
# tiny-run sizes; NANORL_SMOKE=1 shrinks them to a couple of minutes (the CI test of the whole pipeline)
if [ "${NANORL_SMOKE:-0}" = "1" ]; then
    BASE_ITERS=20; MID_ITERS=6; SFT_ITERS=6; RL_ROLLOUTS=2; RL_PROMPTS=4; EVAL_N=16; RL_EVAL_N=8; GEN=48; NUM_EX=1000; EVAL_TOK=4096
else
    BASE_ITERS=250; MID_ITERS=80; SFT_ITERS=80; RL_ROLLOUTS=24; RL_PROMPTS=8; EVAL_N=200; RL_EVAL_N=64; GEN=128; NUM_EX=20000; EVAL_TOK=16384
fi
if [ $TINY = 1 ]; then
    stage tok_train  $PY -m scripts.tok_train --vocab-size 4096 --max-chars 20000000
    stage tok_eval   $PY -m scripts.tok_eval
    stage base_train $PY -m scripts.base_train --depth 4 --head-dim 64 --max-seq-len 256 --device-batch-size 16 \
        --total-batch-size 4096 --num-iterations $BASE_ITERS --warmdown-ratio 0.3 --eval-every $(( BASE_ITERS / 2 )) --eval-tokens $EVAL_TOK --sample-every $BASE_ITERS --run "$WANDB_RUN"
    # no CORE offline: the eval bundle is a download, and its 22 tasks would take the tiny run minutes on a CPU
    stage base_eval  $PY -m scripts.base_eval --eval bpb,sample --device-batch-size 16 --split-tokens $EVAL_TOK
    stage mid_train  $PY -m scripts.mid_train --num-iterations $MID_ITERS --device-batch-size 16 --eval-every $(( MID_ITERS / 2 )) --eval-tokens $EVAL_TOK --num-examples $NUM_EX --run "$WANDB_RUN"
    stage eval_mid   $PY -m scripts.chat_eval -i mid -a offline -x $EVAL_N -m $GEN --levels 1,2
    stage eval_mid_sampled $PY -m scripts.chat_eval -i mid -a offline -x $EVAL_N -m $GEN --levels 1,2 -n 4 -t 1.0
    stage chat_sft   $PY -m scripts.chat_sft --num-iterations $SFT_ITERS --device-batch-size 16 --eval-every $(( SFT_ITERS / 2 )) --eval-tokens $EVAL_TOK --num-examples $NUM_EX --run "$WANDB_RUN"
    stage eval_sft   $PY -m scripts.chat_eval -i sft -a offline -x $EVAL_N -m $GEN --levels 1,2
    stage eval_sft_sampled $PY -m scripts.chat_eval -i sft -a offline -x $EVAL_N -m $GEN --levels 1,2 -n 4 -t 1.0
    stage chat_rl    $PY -m scripts.chat_rl --levels 1,2 --num-rollouts $RL_ROLLOUTS --rollout-batch-size $RL_PROMPTS --n-samples-per-prompt 8 \
        --max-response-len $GEN --eval-interval 8 --eval-max-problems $RL_EVAL_N --n-samples-per-eval-prompt 4 --save-interval 8 --run "$WANDB_RUN"
    stage eval_rl    $PY -m scripts.chat_eval -i rl -a offline -x $EVAL_N -m $GEN --levels 1,2
    stage eval_rl_sampled $PY -m scripts.chat_eval -i rl -a offline -x $EVAL_N -m $GEN --levels 1,2 -n 4 -t 1.0
else
    # real data: the first shards now, the rest in the background while the tokenizer trains.
    # How many: d20 with --n-kv-head 2 and a 32,768 vocab has 424.7M params; Chinchilla 20x = 16,200 steps of
    # 524,288 = 8.49B tokens. The loader crops the document that overflows each 2,049-token row and drops its
    # rest, an estimated 32-43% of the stream, so it reads up to 8.49B / 0.57 = 14.9B tokens. A shard is ~250M
    # chars, at most ~52M tokens (4.8 chars/token, a 65k vocab's rate; 32k compresses less, giving more tokens):
    # 14.9B / 52M = 287 training shards (240 would cover only the 32%-waste case). 300 = 299 train + 1 val.
    stage data_first $PY -m nanorl.dataset -n 8
    $PY -m nanorl.dataset -n 300 > "$NANORL_BASE_DIR/logs/data_download.log" 2>&1 &
    DATA_PID=$!
    stage tok_train  $PY -m scripts.tok_train --max-chars 2000000000
    stage tok_eval   $PY -m scripts.tok_eval
    wait $DATA_PID || { echo "!! data download failed; see $NANORL_BASE_DIR/logs/data_download.log" >&2; exit 1; }
    stage base_train $RUN scripts.base_train -- --depth 20 --n-kv-head 2 --run "$WANDB_RUN"
    stage base_eval  $RUN scripts.base_eval
    stage mid_train  $RUN scripts.mid_train -- --data hub --run "$WANDB_RUN"
    stage eval_mid   $RUN scripts.chat_eval -- -i mid -a arc-easy,arc-challenge,mmlu,gsm8k,humaneval,spellingbee,offline
    stage chat_sft   $RUN scripts.chat_sft -- --data hub --run "$WANDB_RUN"
    stage eval_sft   $RUN scripts.chat_eval -- -i sft -a arc-easy,arc-challenge,mmlu,gsm8k,humaneval,spellingbee,offline
    # RL as nanochat's RL stage reads GSM8K: one epoch of its train split (7,473 prompts / 16 a rollout = 467 rollouts),
    # 16 samples per prompt, 256 new tokens, T=1, on-policy with advantages r - mean and a token-mean loss (Dr. GRPO:
    # nanochat's objective); the held-out pass@k is nanochat's too: 400 test problems x 8 samples at T=1. Estimated
    # ~10 min on 8xH100 (dev/LOG.md, derived from FLOPs and decode latency, not measured yet).
    stage chat_rl    $RUN scripts.chat_rl -- --task gsm8k --num-rollouts 467 --rollout-batch-size 16 --n-samples-per-prompt 16 \
        --max-response-len 256 --disable-grpo-std-normalization --eval-every 60 --eval-max-problems 400 \
        --n-samples-per-eval-prompt 8 --pass-k 1,8 --save-every 60 --run "$WANDB_RUN"
    stage eval_rl    $RUN scripts.chat_eval -- -i rl -a arc-easy,arc-challenge,mmlu,gsm8k,humaneval,spellingbee,offline
    # GSM8K pass@k of the RL model as nanochat samples it (T=1, top-k 50, 256 tokens, 400 problems x 8), beside the greedy row
    stage eval_rl_sampled $RUN scripts.chat_eval -- -i rl -a gsm8k -x 400 -n 8 -k 1,8 -t 1.0 --top-k 50 -m 256
fi

# --- the report -----------------------------------------------------------------------------------
# total = the sum of the stages' own times, so a rerun that skips finished stages still reports the whole pipeline;
# report.md goes where NANORL_REPORT says, its plots beside the stages' sections in $NANORL_BASE_DIR/report/
STAGE_SECONDS=$(cat "$NANORL_BASE_DIR"/done/* 2>/dev/null | awk '{s += $1} END {print s + 0}')
$PY -m nanorl.report --out "${NANORL_REPORT:-report.md}" --wall-time "$STAGE_SECONDS"
echo "== done in $(( ($(date +%s) - T_START) / 60 )) min; see ${NANORL_REPORT:-report.md} =="
