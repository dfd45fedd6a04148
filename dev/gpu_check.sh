#!/usr/bin/env bash
# The one command that proves the GPU path:
#   bash dev/gpu_check.sh OUT.md          # one CUDA GPU: ~10 minutes on one H100, +2.5 for the 7B LoRA step
#   bash dev/gpu_check.sh OUT.md --cpu    # tiny CPU mode (also what runs on a machine without an NVIDIA GPU)
#   ONLY="tests" bash dev/gpu_check.sh OUT.md   # only these kinds of step (tests pipeline train decode rl hf), e.g.
#                                               # to fit a 10-minute limit per command: "tests", then "pipeline", ...
# A GPU that nvidia-smi shows but torch cannot use (a CPU build of torch, or one built for a newer CUDA than the
# driver's) fails at once, with the driver's version and the torch build to install.
# On a GPU it runs the tests marked `gpu` (CUDA-graph engine == eager engine, bf16 engine vs trainer log-prob gap,
# compiled == eager loss, base_train's batch trial compiling the graph its DDP steps run (no recompile), flex ==
# dense-mask gradients, a packed SFT step at d20 shape, a GRPO step at d12, a 2-rank NCCL run when 2 GPUs exist), then
# the pipeline step (dev/pipeline_check.py: NANORL_REHEARSAL=1 bash speedrun.sh on every visible GPU, no engine
# decoding eagerly, chat_web -i rl answering, one profiled batch-1 decode step of d20),
# then bench train d12 and d20, bench decode d20 at batch 1/64/256 (512-token prompts,
# 256 new tokens, the engine RL samples with), bench rl d20 (16 prompts x 16 samples, 256 new tokens), bench train d20
# --fsdp (FSDP2 over one rank: its cost against plain d20, and the sampler weight-gather time), bench hf (Qwen2.5-0.5B's
# shape on random weights: --hf-model load, nanorl vs transformers greedy decode at batch 1/64/256, a GRPO step), and
# bench hf --size 7b --lora-rank 16 (LoRA RL of Qwen2.5-7B's shape on one GPU, docs/lora.md), and
# writes one markdown table of the figures to OUT.md. Each step's full output is kept in OUT_logs/ next to OUT.md.
# The CPU mode runs the same steps at tiny sizes: its figures say the command works, not how fast anything is.
# Exit status 1 if any step failed (the table still lists every step, failures included). Needs the test
# dependencies: bash tests/run.sh (or pip install -e ".[dev]") first.
set -uo pipefail
OUT=${1:?usage: bash dev/gpu_check.sh OUT.md [--cpu]}
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
MODE=gpu
if [ "${2:-}" = "--cpu" ]; then
    MODE=cpu
elif ! $PY -c "import sys; from nanorl.gpu_setup import cuda_available; sys.exit(0 if cuda_available() else 1)"; then
    # a GPU that torch cannot use is a failure, not a reason to measure the CPU: gpu_setup names the driver and
    # the torch build to install; only a machine with no NVIDIA GPU at all falls back to the CPU mode
    $PY -m nanorl.gpu_setup check >/dev/null || exit 1
    MODE=cpu
fi
LOGS="${OUT%.md}_logs"
rm -rf "$LOGS" && mkdir -p "$LOGS"
T0=$(date +%s)
N=0

# step KIND LABEL CMD...: run CMD, keep its output in $LOGS, note (file, kind, label, exit status) for the table
step() {
    local kind=$1 label=$2; shift 2
    [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $kind "* ]] && return  # not asked for this time
    N=$((N + 1))
    local log="$LOGS/$(printf %02d $N)_$kind.log" t=$(date +%s) rc=0
    echo "== $label: $*"
    "$@" > "$log" 2>&1 || rc=$?
    echo "   exit $rc in $(( $(date +%s) - t ))s ($log)"
    printf '%s\t%s\t%s\t%s\n' "$(basename "$log")" "$kind" "$label" "$rc" >> "$LOGS/index.tsv"
}

step tests "gpu tests" $PY -m pytest -q -s -m gpu -p no:cacheprovider tests/test_gpu.py
# the gpu tests above put the engine's CUDA-graph self-check in the table, a row per GPU. With two GPUs visible,
# chat_web --num-gpus 2: its replica on cuda:1 must capture its graphs there and answer as the one on cuda:0
if [ $MODE = gpu ] && [ "$($PY -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
    step tests "chat_web --num-gpus 2" $PY -m pytest -q -s -m gpu -p no:cacheprovider tests/test_chat_web.py -k num_gpus_2
fi
if [ $MODE = gpu ]; then
    step pipeline "pipeline" $PY dev/pipeline_check.py "$LOGS/pipeline"
    step train "train d12" $PY -m scripts.bench train --depth 12 --batch 32 --seq-len 2048 --warmup 2 --steps 5
    step train "train d20" $PY -m scripts.bench train --depth 20 --n-kv-head 2 --batch 32 --seq-len 2048 --warmup 2 --steps 5
    for B in 1 64 256; do
        step decode "decode d20 batch $B" $PY -m scripts.bench decode --depth 20 --n-kv-head 2 --batch $B --prompt-len 512 --new-tokens 256
    done
    step rl "rl d20 step (16x16)" $PY -m scripts.bench rl --depth 20 --n-kv-head 2 --prompts 16 --samples 16 --prompt-len 150 --new-tokens 256
    # FSDP2's wrapping on one GPU (against "train d20" above) and the sampler's weight gather; 3 timed steps, compile dominates
    step train "train d20 --fsdp" $PY -m scripts.bench train --depth 20 --n-kv-head 2 --batch 32 --seq-len 2048 --warmup 2 --steps 3 --fsdp
    step hf "hf qwen2 0.5b" $PY -m scripts.bench hf --arch qwen2 --size 0.5b --batches 1 64 256 --prompt-len 128 --new-tokens 128 \
        --rl-prompts 8 --rl-samples 8 --rl-prompt-len 150 --rl-new-tokens 256
    # LoRA: a frozen bf16 7B base the engine shares, rank-16 adapters trained (full-weight RL of this shape needs ~110 GB)
    step hf "hf qwen2 7b --lora-rank 16" $PY -m scripts.bench hf --arch qwen2 --size 7b --batches 1 64 --prompt-len 128 \
        --new-tokens 128 --rl-prompts 16 --rl-samples 16 --rl-prompt-len 150 --rl-new-tokens 256 --max-tokens-per-gpu 4096 \
        --lora-rank 16
else
    TINY="--head-dim 64 --vocab-size 4096 --device-type cpu --threads 1"
    # the rehearsal itself is tests/test_speedrun.py's (2 CPU ranks); here the profiled decode step alone
    step pipeline "pipeline" $PY dev/pipeline_check.py "$LOGS/pipeline" --depth 2 --cpu
    step train "train d2" $PY -m scripts.bench train --depth 2 --batch 2 --seq-len 64 --warmup 1 --steps 2 $TINY
    for B in 1 4; do  # two batch sizes: the CPU mode checks the commands, not the curve
        step decode "decode d2 batch $B" $PY -m scripts.bench decode --depth 2 --batch $B --prompt-len 16 --new-tokens 32 $TINY
    done
    step rl "rl d2 step (2x2)" $PY -m scripts.bench rl --depth 2 --prompts 2 --samples 2 --prompt-len 16 --new-tokens 8 $TINY
    step train "train d2 --fsdp" $PY -m scripts.bench train --depth 2 --batch 2 --seq-len 64 --warmup 1 --steps 2 --fsdp $TINY
    step hf "hf qwen2 tiny" $PY -m scripts.bench hf --arch qwen2 --size tiny --batches 1 2 4 --prompt-len 8 --new-tokens 8 \
        --rl-prompts 2 --rl-samples 2 --rl-prompt-len 8 --rl-new-tokens 8 --device-type cpu --threads 1
    step hf "hf qwen2 tiny --lora-rank 4" $PY -m scripts.bench hf --arch qwen2 --size tiny --batches 1 2 --prompt-len 8 \
        --new-tokens 8 --rl-prompts 2 --rl-samples 2 --rl-prompt-len 8 --rl-new-tokens 8 --device-type cpu --threads 1 \
        --lora-rank 4
fi
$PY dev/gpu_table.py "$LOGS" "$OUT" $MODE $(( $(date +%s) - T0 ))
