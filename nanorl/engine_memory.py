"""
The engine's memory: its own copy of the weights for sampling (one flat buffer, refreshed in place by
Engine.load_weights) and its KV cache, sized against the memory that is free before it is allocated.
"""

import torch

from nanorl.common import low_precision_dtype


@torch.no_grad()
def inference_copy(model, dtype):
    """A frozen copy of model for sampling -> (copy, flat): every parameter of the copy is a view of one flat
    buffer `flat` of dtype, so the whole set of weights is one tensor (one copy, one broadcast). Tied parameters
    stay tied; buffers (the rotary tables) keep their own dtype."""
    with torch.device("meta"):
        twin = type(model)(model.config)
    unique = {id(p): p for p in model.parameters()}
    flat = torch.empty(sum(p.numel() for p in unique.values()), dtype=dtype, device=next(model.parameters()).device)
    views, offset = {}, 0
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in views:
            view = flat[offset : offset + p.numel()].view(p.shape).copy_(p.detach())
            views[id(p)], offset = torch.nn.Parameter(view, requires_grad=False), offset + p.numel()
        module, _, attr = name.rpartition(".")
        setattr(twin.get_submodule(module), attr, views[id(p)])
    for name, b in model.named_buffers():
        module, _, attr = name.rpartition(".")
        twin.get_submodule(module)._buffers[attr] = b.detach().clone()
    if any(t.is_meta for t in [*twin.parameters(), *twin.buffers()]):
        raise ValueError(
            f"{type(model).__name__} has parameters or buffers its own constructor does not make: "
            "the engine cannot copy it (pass share_weights=True)"
        )
    return twin.eval(), flat


def new_kv_cache(model, batch_size, max_len, device):
    """The engine's KV cache (bf16 on CUDA, fp32 elsewhere), refused in one line when it cannot fit in free memory."""
    cfg = model.config
    dtype = low_precision_dtype(device)
    nbytes = 2 * cfg.n_layer * batch_size * cfg.n_kv_head * max_len * model.head_dim * dtype.itemsize
    avail = _free_memory(device)
    msg = (
        f"the KV cache for batch_size={batch_size}, max_len={max_len} needs {nbytes / 1e9:.2f} GB"
        + (f" but only {avail / 1e9:.2f} GB is free" if avail is not None else "")
        + ": use a smaller batch_size (or max_len, or a model with fewer KV heads)"
    )
    if avail is not None and nbytes > avail:
        raise MemoryError(msg)
    try:
        return model.new_kv_cache(batch_size, max_len, dtype=dtype)
    except torch.OutOfMemoryError as e:
        raise MemoryError(msg) from e


def _free_memory(device):
    """Bytes a new allocation on device can get, or None when it cannot be told."""
    if device.type == "cuda":  # free on the GPU, plus what torch's caching allocator holds but does not use
        return (
            torch.cuda.mem_get_info(device)[0]
            + torch.cuda.memory_reserved(device)
            - torch.cuda.memory_allocated(device)
        )
    if device.type == "cpu":
        try:  # MemAvailable counts reclaimable page cache, unlike "free"
            with open("/proc/meminfo") as f:
                return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
        except (OSError, StopIteration, ValueError):
            return None
    return None
