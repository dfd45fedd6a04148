"""
Sizing a stage's batch to its device: the largest device batch whose training (or eval) step fits in memory, agreed
by every rank, tried on the very model object the stage steps (torch.compile'd on CUDA).
"""

import torch
import torch.distributed as dist

from nanorl.logger import synchronize


def batch_candidates(largest, total_tokens, row_tokens):
    """Device batches to try, largest first: largest, largest / 2, ... 1, keeping those whose micro-steps of
    batch x row_tokens (row_tokens = sequence length x ranks) add up exactly to total_tokens per optimizer step."""
    out, b = [], largest
    while b >= 1:
        if total_tokens % (b * row_tokens) == 0:
            out.append(b)
        b //= 2
    return out


def _step_fits(try_step, batch):
    try:
        try_step(batch)
        return True
    except torch.OutOfMemoryError:
        pass  # out of the except block before freeing: its traceback still holds the failed step's tensors
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return False


def fit_device_batch(try_step, candidates, device=None):
    """
    The largest device batch of `candidates` (largest first) whose training step fits in memory: try_step(batch)
    runs one forward+backward at that batch and raises torch.OutOfMemoryError when it does not fit. Under
    torch.distributed all ranks try the same batch and move on together when any of them ran out of memory, so
    they agree on the smallest batch every rank can take. Returns (batch, the larger candidates that did not fit).
    """
    too_big = []
    for batch in candidates:
        fits = _step_fits(try_step, batch)
        if dist.is_available() and dist.is_initialized():
            flag = torch.tensor([int(fits)], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            fits = bool(flag.item())
        if fits:
            return batch, too_big
        too_big.append(batch)
    raise SystemExit(
        f"out of memory even at a device batch of {candidates[-1]} row(s) (tried {too_big}): "
        f"use a smaller model or --max-seq-len, or shard it with --fsdp"
    )


def compile_model(model, device, no_compile=False):
    """What a training stage steps: on CUDA torch.compile of the model (dynamic=False: one graph per batch shape),
    elsewhere, or with --no-compile, the model itself (eager)."""
    return torch.compile(model, dynamic=False) if torch.device(device).type == "cuda" and not no_compile else model


def oom_is_catchable(device):
    """Whether running out of memory on `device` raises an exception a batch-size trial can catch (CUDA's allocator);
    elsewhere it is the OS killing the process, and there is nothing to try."""
    return torch.device(device).type == "cuda"


def fit_batch(try_step, candidates, device, what="device batch"):
    """The batch of every stage that fits its batch to memory (base_train, mid_train, chat_sft, chat_eval): where out
    of memory can be caught, the largest of `candidates` whose try_step fits on every rank (fit_device_batch), else
    the largest. -> (batch, the line that says which and why)"""
    batch, too_big = fit_device_batch(try_step, candidates, device) if oom_is_catchable(device) else (candidates[0], [])
    why = f", the largest that fits in memory ({', '.join(map(str, too_big))} did not)" if too_big else ""
    return batch, f"{what} (auto): {batch} rows{why}"


def training_trial(run_step, optimizer, device, offloaded=False):
    """fit_batch's try_step for a training stage: run_step(batch) runs one forward and backward at `batch` rows, as
    training runs them (the same model object, so the same compiled graph). The optimizer's state, allocated at its
    first step, does not exist yet: the trial holds that many bytes aside (none with --cpu-offload, where it lives in
    host memory), and throws the gradients away after."""
    state_bytes = 0 if offloaded else optimizer.state_bytes()

    def trial(batch):
        held = torch.empty(state_bytes, dtype=torch.uint8, device=device)
        try:
            run_step(batch)
            synchronize(torch.device(device).type)
        finally:
            optimizer.zero_grad(set_to_none=True)
            del held

    return trial
