#!/usr/bin/env bash
# nanorl speedrun: tokenizer -> base -> mid -> SFT -> RL -> report, in one command.
#   bash speedrun.sh                 # 8xH100 (or any CUDA node): the real pipeline on all GPUs
#   NANORL_TINY=1 bash speedrun.sh   # or any machine without CUDA: tiny model, offline curriculum, CPU
#   bash speedrun.sh --force         # rerun every stage from scratch, finished or not
# A rerun skips finished stages and continues a stopped one from its last checkpoint. WANDB_RUN=name logs to wandb.
set -euo pipefail
cd "$(dirname "$0")"
FORCE=0; [ "${1:-}" = "--force" ] && FORCE=1
export NANORL_BASE_DIR="${NANORL_BASE_DIR:-$HOME/.cache/nanorl}" NANORL_PIPELINE=1  # stages write the pipeline's report
CALLER_OMP="${OMP_NUM_THREADS:-}"; export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # the tiny run: see below
WANDB_RUN="${WANDB_RUN:-dummy}"
mkdir -p "$NANORL_BASE_DIR/logs" "$NANORL_BASE_DIR/done" "$NANORL_BASE_DIR/started"
T_START=$(date +%s)
source install.sh bwrap:bubblewrap  # .venv with nanorl and the right torch, the sandbox (as tests/run.sh); sets PY, TINY
SETUP_SECONDS=$(( $(date +%s) - T_START ))  # the report shows the venv and installs apart from the stages

# stage NAME CMD...: skipped once finished (not with --force), logged to logs/NAME.log; a failure names both. A training
# stage stopped part-way goes on with --resume (not --overwrite, which moves steps aside) from a step it saved.
resumable() {  # --resume would load a step saved since the stage started: its tag's newest complete step (meta_*.json)
    local root; case $1 in base_train) root=base;; mid_train) root=mid;; chat_sft) root=sft;; chat_rl) root=rl;; *) return 1;; esac
    for tag in "$NANORL_BASE_DIR/${root}_checkpoints"/*/; do [ "$(ls "$tag"meta_*.json 2>/dev/null | tail -1)" -nt "$2" ] && return 0; done; return 1
}
stage() {
    local name=$1 log="$NANORL_BASE_DIR/logs/$1.log" started="$NANORL_BASE_DIR/started/$1" append="" t0=$(date +%s); shift
    if [ -f "$NANORL_BASE_DIR/done/$name" ] && [ $FORCE = 0 ]; then echo "-- $name: already done, skipping (--force to rerun)"; return; fi
    if [ $FORCE = 0 ] && [ -f "$started" ] && resumable "$name" "$started"; then  # its log goes on after the stopped attempt's
        local args=(); for a in "$@"; do [ "$a" = --overwrite ] || args+=("$a"); done; set -- "${args[@]}" --resume; append=-a
    else touch "$started"; fi
    echo "-- $name: $*"
    "$@" > >(tee $append "$log") 2>&1 || fail "stage '$name' failed; its log is $log. Earlier stages' checkpoints and report sections are intact; rerun to continue from here."
    echo "-- $name done in $(( $(date +%s) - t0 ))s"
    echo $(( $(date +%s) - t0 )) > "$NANORL_BASE_DIR/done/$name" && rm "$started"  # its seconds, for the report's total
}
# gpu_stage: one rank per GPU, each told --device-type cuda, so that no stage can quietly fall back to the CPU
gpu_stage() { stage "$1" $PY -m torch.distributed.run --standalone --nproc_per_node=$NGPU -m "$2" -- --device-type cuda "${@:3}"; }
size() { [ "${NANORL_SMOKE:-0}" = "1" ] && echo "$2" || echo "$1"; }  # the tiny run's `size full smoke` (NANORL_SMOKE=1)

if [ $TINY = 1 ]; then
    echo "== nanorl speedrun: no CUDA GPU (or NANORL_TINY=1): tiny model on the offline curriculum, CPU, no network =="
    # the CPU also on a GPU machine (torch and every stage's GPU check see none), on every core unless the caller chose
    export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=${CALLER_OMP:-$(nproc --all)}
    # a CPU with bf16 matrix units (AMX) takes CUDA's dtypes (bf16 autocast, a bf16 engine): ~3x faster steps; =0: fp32
    export NANORL_CUDA_DTYPES=${NANORL_CUDA_DTYPES:-$($PY -c "import torch; print(int(torch.cpu._is_amx_tile_supported()))")}
    BASE_ITERS=$(size 250 20)    # base_train steps
    MID_ITERS=$(size 240 6)      # mid_train steps (80 left it under-trained: dev/LOG.md)
    SFT_ITERS=$(size 80 6)       # chat_sft steps
    ROWS=$(size 16 4)            # rows of 256 tokens per step
    NUM_EX=$(size 20000 1000)    # offline conversations generated for mid and SFT
    EVAL_TOK=$(size 16384 2048)  # tokens per val loss / bpb eval
    EVAL_N=$(size 200 16)        # chat_eval problems
    GEN=$(size 128 48)           # new tokens per answer (eval and RL)
    RL_ROLLOUTS=$(size 24 2)     # RL steps
    RL_PROMPTS=$(size 16 4)      # prompts per RL step, 8 samples each (16, not 8: steadier across seeds, dev/LOG.md)
    RL_EVAL_EVERY=$(size 24 8)   # RL's held-out pass@k: at the start, every N steps and at the end
    RL_EVAL_N=$(size 64 8)       # RL's held-out problems
    RL_SAVE_EVERY=$(size 8 1)    # RL checkpoints every N steps (smoke: every step, so a stopped run has one to go on from)
    stage tok_train  $PY -m scripts.tok_train --vocab-size 4096 --max-chars 20000000
    stage tok_eval   $PY -m scripts.tok_eval
    stage base_train $PY -m scripts.base_train --depth 4 --head-dim 64 --max-seq-len 256 --device-batch-size $ROWS \
        --total-batch-size $(( ROWS * 256 )) --num-iterations $BASE_ITERS --warmdown-ratio 0.3 --eval-every $(( BASE_ITERS / 2 )) --eval-tokens $EVAL_TOK --sample-every $BASE_ITERS --run "$WANDB_RUN"
    stage base_eval  $PY -m scripts.base_eval --eval bpb,sample --device-batch-size $ROWS --split-tokens $EVAL_TOK  # no CORE: a download
    stage mid_train  $PY -m scripts.mid_train --num-iterations $MID_ITERS --device-batch-size $ROWS --eval-every $(( MID_ITERS / 2 )) --eval-tokens $EVAL_TOK --num-examples $NUM_EX --run "$WANDB_RUN"
    stage eval_mid   $PY -m scripts.chat_eval -i mid -a offline -x $EVAL_N -m $GEN --levels 1,2 --levels 3,4
    stage eval_mid_sampled $PY -m scripts.chat_eval -i mid -a offline -x $EVAL_N -m $GEN --levels 1,2 -n 4 -t 1.0
    stage chat_sft   $PY -m scripts.chat_sft --num-iterations $SFT_ITERS --device-batch-size $ROWS --eval-every $(( SFT_ITERS / 2 )) --eval-tokens $EVAL_TOK --num-examples $NUM_EX --run "$WANDB_RUN"
    stage eval_sft   $PY -m scripts.chat_eval -i sft -a offline -x $EVAL_N -m $GEN --levels 1,2 --levels 3,4
    stage eval_sft_sampled $PY -m scripts.chat_eval -i sft -a offline -x $EVAL_N -m $GEN --levels 1,2 -n 4 -t 1.0
    stage chat_rl    $PY -m scripts.chat_rl --overwrite --levels 1,2 --num-rollouts $RL_ROLLOUTS --rollout-batch-size $RL_PROMPTS --n-samples-per-prompt 8 \
        --max-new-tokens $GEN --eval-every $RL_EVAL_EVERY --eval-max-problems $RL_EVAL_N --n-samples-per-eval-prompt 4 --save-every $RL_SAVE_EVERY --run "$WANDB_RUN"
    stage eval_rl    $PY -m scripts.chat_eval -i rl -a offline -x $EVAL_N -m $GEN --levels 1,2 --levels 3,4
    stage eval_rl_sampled $PY -m scripts.chat_eval -i rl -a offline -x $EVAL_N -m $GEN --levels 1,2 -n 4 -t 1.0
else
    # HumanEval runs the model's code: with no sandbox here the evals skip it (and say so), not the run
    $PY -c "from nanorl.execution import sandbox_missing as m; w = m(); w and print('note: HumanEval will be skipped:', w)"
    NGPU=$($PY -m nanorl.gpu_setup check)  # one rank per GPU torch sees; none: one line naming the driver and the fix
    [ "$NGPU" -gt 0 ] || fail "torch sees no GPU: CUDA_VISIBLE_DEVICES='${CUDA_VISIBLE_DEVICES:-}' hides them all"
    echo "== nanorl speedrun: $NGPU GPU(s), the full pipeline =="
    stage data_first $PY -m nanorl.dataset -n 8  # FineWeb-Edu: 8 shards now, the rest while the tokenizer trains
    $PY -m nanorl.dataset -n 300 > "$NANORL_BASE_DIR/logs/data_download.log" 2>&1 & DATA_PID=$!  # d20 reads ~287 (docs/training.md)
    stage tok_train  $PY -m scripts.tok_train --max-chars 2000000000
    stage tok_eval   $PY -m scripts.tok_eval
    wait $DATA_PID || fail "data download failed; see $NANORL_BASE_DIR/logs/data_download.log"
    gpu_stage base_train scripts.base_train --depth 20 --n-kv-head 2 --save-every 2000 --run "$WANDB_RUN"  # a rerun goes on from there
    gpu_stage base_eval  scripts.base_eval
    gpu_stage mid_train  scripts.mid_train --data hub --run "$WANDB_RUN"
    gpu_stage eval_mid   scripts.chat_eval -i mid -a arc-easy,arc-challenge,mmlu,gsm8k,humaneval,spellingbee,offline
    gpu_stage chat_sft   scripts.chat_sft --data hub --run "$WANDB_RUN"
    gpu_stage eval_sft   scripts.chat_eval -i sft -a arc-easy,arc-challenge,mmlu,gsm8k,humaneval,spellingbee,offline
    # RL as nanochat's: one epoch of GSM8K (7,473 prompts / 16), 16 samples, T=1, Dr. GRPO; pass@k on 400 x 8 samples
    gpu_stage chat_rl    scripts.chat_rl --overwrite --task gsm8k --num-rollouts 467 --rollout-batch-size 16 --n-samples-per-prompt 16 \
        --max-new-tokens 256 --disable-grpo-std-normalization --eval-every 60 --eval-max-problems 400 --n-samples-per-eval-prompt 8 --pass-k 1,8 --save-every 60 --run "$WANDB_RUN"
    gpu_stage eval_rl    scripts.chat_eval -i rl -a arc-easy,arc-challenge,mmlu,gsm8k,humaneval,spellingbee,offline
    gpu_stage eval_rl_sampled scripts.chat_eval -a gsm8k -i rl -x 400 -n 8 -k 1,8 -t 1.0 --top-k 50 -m 256  # as nanochat samples
fi

$PY -m nanorl.report --out "${NANORL_REPORT:-report.md}" --setup-time "$SETUP_SECONDS"  # its total: the stages' own times
echo "== done in $(( ($(date +%s) - T_START) / 60 )) min; the report card is in ${NANORL_REPORT:-report.md} =="
echo "Chat with the RL model it trained:"  # everything was installed into .venv: a new shell activates it first
echo "  source .venv/bin/activate"
echo "  python -m scripts.chat_cli -i rl      # in the terminal"
echo "  python -m scripts.chat_web -i rl      # the chat page at http://127.0.0.1:8000 (and the OpenAI API under /v1)"
