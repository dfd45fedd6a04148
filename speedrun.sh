#!/usr/bin/env bash
# nanorl speedrun: tokenizer -> base -> mid -> SFT -> RL -> report, in one command.
#   bash speedrun.sh                      # 8xH100 (or any CUDA node): the real pipeline on all GPUs
#   NANORL_TINY=1 bash speedrun.sh        # or any machine without CUDA: tiny model, offline curriculum, CPU
#   NANORL_REHEARSAL=1 bash speedrun.sh   # the GPU pipeline's own stages at tiny sizes, every download from a mirror it
#                                         # serves on 127.0.0.1: on all GPUs, or on 2 CPU ranks without one
#   bash speedrun.sh --force              # rerun every stage from scratch, finished or not
#   bash speedrun.sh --dry-run            # print the stages' commands, run none (and install nothing)
# A rerun skips finished stages and continues a stopped one from its last checkpoint. WANDB_RUN=name logs to wandb.
# NANORL_MIRROR=URL takes every download from a mirror (nanorl/mirror.py). The GPU run keeps its files in
# NANORL_BASE_DIR, the tiny run in its tiny/ and the rehearsal in its rehearsal/: no run reads another's markers,
# data or checkpoints.
set -euo pipefail
cd "$(dirname "$0")"
FORCE=0; DRY=0
for arg in "$@"; do
    case $arg in --force) FORCE=1;; --dry-run) DRY=1;; *) echo "usage: bash speedrun.sh [--force] [--dry-run]" >&2; exit 2;; esac
done
[ $DRY = 0 ] || export NANORL_SKIP_INSTALL=1
BASE_DIR="${NANORL_BASE_DIR:-$HOME/.cache/nanorl}"
CALLER_OMP="${OMP_NUM_THREADS:-}"; export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # the tiny run: see below
WANDB_RUN="${WANDB_RUN:-dummy}"
T_START=$(date +%s)
source install.sh bwrap:bubblewrap  # .venv with nanorl and the right torch, the sandbox (as tests/run.sh); sets PY, TINY
SETUP_SECONDS=$(( $(date +%s) - T_START ))  # the report shows the venv and installs apart from the stages
RUN=gpu; [ $TINY = 1 ] && RUN=tiny; [ "${NANORL_REHEARSAL:-0}" = 1 ] && RUN=rehearsal
RUN_DIR=$BASE_DIR; [ $RUN = gpu ] || RUN_DIR=$BASE_DIR/$RUN
# a tiny run from before the runs had their own directories left its markers where the GPU run keeps its own
# (eval_mid_sampled is a stage of the tiny run only): the GPU run would skip every stage and report the tiny model
if [ $RUN = gpu ] && [ -f "$BASE_DIR/done/eval_mid_sampled" ]; then
    fail "$BASE_DIR holds an older tiny run's files (done/eval_mid_sampled), which the GPU run would take for its own: move that directory aside (mv $BASE_DIR $BASE_DIR.tiny) or set NANORL_BASE_DIR to another one"
fi
export NANORL_BASE_DIR=$RUN_DIR NANORL_PIPELINE=1  # every stage's files go there; stages write the pipeline's report
[ $DRY = 1 ] || mkdir -p "$NANORL_BASE_DIR/logs" "$NANORL_BASE_DIR/done" "$NANORL_BASE_DIR/started"

# stage NAME CMD...: skipped once finished (not with --force), logged to logs/NAME.log; a failure names both. A training
# stage stopped part-way goes on with --resume (not --overwrite, which moves steps aside) from a step it saved.
resumable() {  # --resume would load a step saved since the stage started: its tag's newest complete step (meta_*.json)
    local root; case $1 in base_train) root=base;; mid_train) root=mid;; chat_sft) root=sft;; chat_rl) root=rl;; *) return 1;; esac
    for tag in "$NANORL_BASE_DIR/${root}_checkpoints"/*/; do [ "$(ls "$tag"meta_*.json 2>/dev/null | tail -1)" -nt "$2" ] && return 0; done; return 1
}
stage() {
    local name=$1 log="$NANORL_BASE_DIR/logs/$1.log" started="$NANORL_BASE_DIR/started/$1" append="" t0=$(date +%s); shift
    if [ $DRY = 1 ]; then echo "-- $name: $*"; return; fi
    if [ -f "$NANORL_BASE_DIR/done/$name" ] && [ $FORCE = 0 ]; then echo "-- $name: already done, skipping (--force to rerun)"; return; fi
    if [ $FORCE = 0 ] && [ -f "$started" ] && resumable "$name" "$started"; then  # its log goes on after the stopped attempt's
        local args=(); for a in "$@"; do [ "$a" = --overwrite ] || args+=("$a"); done; set -- "${args[@]}" --resume; append=-a
    else touch "$started"; fi
    echo "-- $name: $*"
    "$@" > >(tee $append "$log") 2>&1 || fail "stage '$name' failed; its log is $log. Earlier stages' checkpoints and report sections are intact; rerun to continue from here."
    echo "-- $name done in $(( $(date +%s) - t0 ))s"
    echo $(( $(date +%s) - t0 )) > "$NANORL_BASE_DIR/done/$name" && rm "$started"  # its seconds, for the report's total
}
# ranks_stage NAME MODULE ARGS...: torchrun, one rank per GPU, each told --device-type cuda so that no stage can quietly
# fall back to the CPU (the rehearsal without a GPU: 2 CPU ranks on gloo, told --device-type cpu)
ranks_stage() { stage "$1" $PY -m torch.distributed.run --standalone --nproc_per_node=$NRANKS -m "$2" -- --device-type $DEVICE "${@:3}"; }
# background NAME CMD...: started now, logged to logs/NAME.log; wait_background waits for it and fails if it failed
background() {
    if [ $DRY = 1 ]; then echo "-- $1 (in the background): ${*:2}"; return; fi
    BG_NAME=$1; "${@:2}" > "$NANORL_BASE_DIR/logs/$1.log" 2>&1 & BG_PID=$!
}
wait_background() { [ $DRY = 1 ] || wait $BG_PID || fail "$BG_NAME failed; see $NANORL_BASE_DIR/logs/$BG_NAME.log"; }
# size FULL SMALL: a size of the full run, or of the small one (the tiny run's NANORL_SMOKE=1; the rehearsal)
SMALL=0
size() { [ $SMALL = 1 ] && echo "$2" || echo "$1"; }

# The GPU pipeline, one list for the real run and its rehearsal: only sizes come through size() (a FULL of "" drops
# the flag; a batch the ranks share is a multiple of their count), the launcher's rank count and device through
# ranks_stage, and the data through NANORL_MIRROR.
# tests/test_speedrun.py compares the two listings (--dry-run) and allows nothing else.
gpu_pipeline() {
    stage data_first $PY -m nanorl.dataset -n $(size 8 2)  # FineWeb-Edu: 8 shards now, the rest while the tokenizer trains
    background data_download $PY -m nanorl.dataset -n $(size 300 3)  # d20 reads ~287 (docs/training.md)
    stage tok_train  $PY -m scripts.tok_train --vocab-size $(size 32768 2048) --max-chars $(size 2000000000 1000000)
    stage tok_eval   $PY -m scripts.tok_eval
    wait_background
    # -1 iterations: Chinchilla's 20 tokens a parameter; a rerun goes on from the last save
    ranks_stage base_train scripts.base_train --depth $(size 20 2) --head-dim $(size 128 64) --n-kv-head 2 \
        --max-seq-len $(size 2048 512) --total-batch-size $(size 524288 $((512 * NRANKS))) --num-iterations $(size -1 4) \
        --eval-every $(size 250 2) --eval-tokens $(size 5242880 1024) --sample-every $(size 2000 4) --save-every $(size 2000 2) --run "$WANDB_RUN"
    ranks_stage base_eval  scripts.base_eval --device-batch-size $(size 32 1) --split-tokens $(size 10485760 1024)
    local sft_sizes="--num-iterations $(size -1 4) --device-batch-size $(size 16 1) --eval-every $(size 100 2) --eval-tokens $(size 200000 1024) --num-examples $(size 20000 200)"
    ranks_stage mid_train  scripts.mid_train --data hub $sft_sizes --run "$WANDB_RUN"
    local tasks="arc-easy,arc-challenge,mmlu,gsm8k,humaneval,spellingbee,offline" eval_sizes="$(size "" "-x 4 -m 32")"
    ranks_stage eval_mid   scripts.chat_eval -i mid -a $tasks $eval_sizes
    ranks_stage chat_sft   scripts.chat_sft --data hub $sft_sizes --run "$WANDB_RUN"
    ranks_stage eval_sft   scripts.chat_eval -i sft -a $tasks $eval_sizes
    # RL as nanochat's: one epoch of GSM8K (7,473 prompts / 16), 16 samples, T=1, Dr. GRPO; pass@k on 400 x 8 samples
    ranks_stage chat_rl    scripts.chat_rl --overwrite --task gsm8k --num-rollouts $(size 467 3) --rollout-batch-size $(size 16 $NRANKS) \
        --n-samples-per-prompt $(size 16 2) --max-new-tokens $(size 256 16) --disable-grpo-std-normalization --eval-every $(size 60 2) \
        --eval-max-problems $(size 400 4) --n-samples-per-eval-prompt $(size 8 2) --pass-k $(size 1,8 1,2) --save-every $(size 60 1) --run "$WANDB_RUN"
    ranks_stage eval_rl    scripts.chat_eval -i rl -a $tasks $eval_sizes
    ranks_stage eval_rl_sampled scripts.chat_eval -a gsm8k -i rl -x $(size 400 4) -n $(size 8 2) -k $(size 1,8 1,2) -t 1.0 --top-k 50 -m $(size 256 16)  # as nanochat samples
}

if [ $RUN = tiny ]; then
    echo "== nanorl speedrun: no CUDA GPU (or NANORL_TINY=1): tiny model on the offline curriculum, CPU, no network =="
    SMALL=${NANORL_SMOKE:-0}
    # the CPU also on a GPU machine (torch and every stage's GPU check see none), on every core unless the caller chose
    export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=${CALLER_OMP:-$(nproc --all)}
    # a CPU with bf16 matrix units (AMX) takes CUDA's dtypes (bf16 autocast, a bf16 engine): ~3x faster steps; =0: fp32
    export NANORL_CUDA_DTYPES=${NANORL_CUDA_DTYPES:-$($PY -c "import torch; print(int(torch.cpu._is_amx_tile_supported()))")}
    BASE_ITERS=$(size 250 10)    # base_train steps
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
    # RL trains where SFT still fails (levels 3,4; 1,2 are near their ceiling after mid-training), with RLOO's
    # leave-one-out baseline: of the recipes measured there, the one that kept every levels-1,2 number (dev/LOG.md)
    RL_RECIPE="--levels 3,4 --advantage-estimator rloo"
    RL_SAVE_EVERY=$(size 8 1)    # RL checkpoints every N steps (smoke: every step, so a stopped run has one to go on from)
    stage tok_train  $PY -m scripts.tok_train --vocab-size 4096 --max-chars $(size 20000000 2000000)
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
    stage chat_rl    $PY -m scripts.chat_rl --overwrite $RL_RECIPE --num-rollouts $RL_ROLLOUTS --rollout-batch-size $RL_PROMPTS --n-samples-per-prompt 8 \
        --max-new-tokens $GEN --eval-every $RL_EVAL_EVERY --eval-max-problems $RL_EVAL_N --n-samples-per-eval-prompt 4 --save-every $RL_SAVE_EVERY --run "$WANDB_RUN"
    stage eval_rl    $PY -m scripts.chat_eval -i rl -a offline -x $EVAL_N -m $GEN --levels 1,2 --levels 3,4
    stage eval_rl_sampled $PY -m scripts.chat_eval -i rl -a offline -x $EVAL_N -m $GEN --levels 1,2 -n 4 -t 1.0
else
    # HumanEval runs the model's code: with no sandbox here the evals skip it (and say so), not the run
    [ $DRY = 1 ] || $PY -c "from nanorl.execution import sandbox_missing as m; w = m(); w and print('note: HumanEval will be skipped:', w)"
    if [ $TINY = 0 ]; then
        # one rank per GPU torch sees; none: one line naming the driver and the fix (a dry run lists an 8-GPU node's)
        if [ $DRY = 1 ]; then NGPU=$($PY -m nanorl.gpu_setup check 2>/dev/null || echo 8); else NGPU=$($PY -m nanorl.gpu_setup check); fi
        [ "$NGPU" -gt 0 ] || fail "torch sees no GPU: CUDA_VISIBLE_DEVICES='${CUDA_VISIBLE_DEVICES:-}' hides them all"
        NRANKS=$NGPU DEVICE=cuda
    else  # the rehearsal without a GPU: 2 ranks of one thread on the CPU, in CUDA's dtypes (docs/testing.md)
        export CUDA_VISIBLE_DEVICES="" NANORL_CUDA_DTYPES=1 OMP_NUM_THREADS=1
        NRANKS=2 DEVICE=cpu
    fi
    if [ $RUN = rehearsal ]; then
        SMALL=1
        echo "== nanorl speedrun rehearsal: the GPU pipeline's stages at tiny sizes on $NRANKS $DEVICE rank(s) =="
        if [ -z "${NANORL_MIRROR:-}" ] && [ $DRY = 0 ]; then  # no mirror of the caller's: serve a small one here
            [ -d "$RUN_DIR/mirror" ] || $PY -m nanorl.rehearsal make "$RUN_DIR/mirror" > "$RUN_DIR/logs/mirror.log" 2>&1 \
                || fail "could not make the mirror: see $RUN_DIR/logs/mirror.log"
            rm -f "$RUN_DIR/mirror.url"
            $PY -m nanorl.rehearsal serve "$RUN_DIR/mirror" "$RUN_DIR/mirror.url" >> "$RUN_DIR/logs/mirror.log" 2>&1 & MIRROR_PID=$!
            trap 'kill $MIRROR_PID 2>/dev/null || true' EXIT  # stopped with the run, however it ends
            for _ in $(seq 100); do [ -s "$RUN_DIR/mirror.url" ] && break; sleep 0.1; done
            NANORL_MIRROR=$(cat "$RUN_DIR/mirror.url" 2>/dev/null) || fail "the mirror's server did not start: see $RUN_DIR/logs/mirror.log"
            export NANORL_MIRROR
        fi
    else
        echo "== nanorl speedrun: $NGPU GPU(s), the full pipeline =="
    fi
    # a mirror that cannot be read stops the run here, in one line naming it
    [ -z "${NANORL_MIRROR:-}" ] || [ $DRY = 1 ] || $PY -m nanorl.mirror check > /dev/null || exit 1
    gpu_pipeline
fi
[ $DRY = 0 ] || exit 0
$PY -m nanorl.report --out "${NANORL_REPORT:-report.md}" --setup-time "$SETUP_SECONDS"  # its total: the stages' own times
echo "== done in $(( ($(date +%s) - T_START) / 60 )) min; the report card is in ${NANORL_REPORT:-report.md} =="
echo "Chat with the RL model it trained:"  # everything was installed into .venv: a new shell activates it first
echo "  source .venv/bin/activate"
[ "$RUN_DIR" = "$HOME/.cache/nanorl" ] || echo "  export NANORL_BASE_DIR=$RUN_DIR   # where this run's checkpoints are"
echo "  python -m scripts.chat_cli -i rl      # in the terminal"
echo "  python -m scripts.chat_web -i rl      # the chat page at http://127.0.0.1:8000 (and the OpenAI API under /v1)"
