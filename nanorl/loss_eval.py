"""Bits per byte: the validation loss that does not depend on the tokenizer's vocabulary."""

import math

import torch
import torch.distributed as dist


@torch.no_grad()
def evaluate_bpb(model, loader, steps, token_bytes):
    """Sum of per-token losses (nats) over the bytes those tokens stand for, over `steps` batches of loader.
    Special tokens (0 bytes) are left out of both sums."""
    total_nats = torch.zeros((), dtype=torch.float64, device=token_bytes.device)
    total_bytes = torch.zeros((), dtype=torch.float64, device=token_bytes.device)
    for _ in range(steps):
        try:
            x, y = loader.next_batch()
        except StopIteration:
            break
        loss = model(x, targets=y, loss_reduction="none").reshape(-1).double()
        nbytes = token_bytes[y.reshape(-1)]
        total_nats += (loss * (nbytes > 0)).sum()
        total_bytes += nbytes.sum()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total_nats)
        dist.all_reduce(total_bytes)
    if total_bytes.item() == 0:
        return float("inf")
    return total_nats.item() / (math.log(2) * total_bytes.item())
