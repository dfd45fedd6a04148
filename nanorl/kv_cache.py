"""
The KV cache the engine decodes with, and attention over it.

KVCache holds every layer's keys and values with its own position per row, so one batch mixes prompts of different
lengths and rows refilled at different times (continuous batching); new_kv_cache() makes one, and a forward
that is given one reads and extends it (the model calls its begin(), attend() and end(), so nanorl/gpt.py imports
nothing of this module). attend_cached() is the attention over the cache: grouped-query heads are
folded into the query length so each KV head is read once, never repeated, on the SDPA kernels attention_backends()
pins. greedy_decode() is its simplest client: a training log's sample, a few greedy tokens through a cache of one row.
"""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from nanorl.precision import low_precision_dtype


class KVCache:
    """
    A pre-allocated KV cache with its own position per row, so one batch holds prompts of different
    lengths and rows that are refilled at different times (continuous batching).
    k, v: (n_layer, B, n_kv_head, max_len, head_dim). pos[b] = how many tokens row b holds.
    A forward with the cache calls begin() once, attend() once per layer, end() once.
    """

    def __init__(self, n_layer, batch_size, n_kv_head, max_len, head_dim, device, dtype):
        shape = (n_layer, batch_size, n_kv_head, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.pos = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.max_len = max_len
        self.attend_len = None  # how much of the cache attention reads: worked out each forward unless static
        self.static = False  # True: the caller fixed attend_len (static shapes for CUDA graphs)
        # which cache rows the forward's batch rows are: a slice of leading rows (views, no copies: the engine
        # decodes its busy rows 0..n-1 this way) or a LongTensor of rows (gathered: the engine prefills a few new
        # prompts straight into free rows of the big decode cache). None = all rows, in order.
        self.rows = None
        self.write_pos = self.write_rows = None  # (B, T) positions and cache rows the current forward writes (begin())

    def _rows(self):
        return slice(None) if self.rows is None else self.rows

    def begin(self, T):
        """Positions (B, T) of the next T tokens of each row, and the (B, 1, T, attend_len) attention mask."""
        rows = self._rows()
        start = self.pos[rows]
        B = start.size(0)
        if not self.static:
            # eager path: read only the used part of the cache (one host sync). A caller that wants
            # static shapes (CUDA graphs) sets static and attend_len itself and skips this check.
            top = int(start.max()) + T
            if top > self.max_len:
                raise ValueError(f"KV cache is full: position {top - 1} >= max_len {self.max_len}")
            self.attend_len = top
        pos = start[:, None] + torch.arange(T, device=start.device)[None, :]
        self.write_pos = pos
        # the cache row each (b, t) writes to, the same for every layer (leading rows: the batch's own index)
        b = torch.arange(B, device=pos.device) if isinstance(rows, slice) else rows
        self.write_rows = b[:, None].expand(B, T)
        key_pos = torch.arange(self.attend_len, device=pos.device)
        return pos, (key_pos[None, None, :] <= pos[:, :, None])[:, None]

    def attend(self, layer, q, k, v, mask):
        """One layer's attention in a cached forward: its new keys/values k, v (B, Hkv, T, D) written at write_pos,
        then q (B, H, T, D) over the forward's rows of the cache with begin()'s mask (attend_cached). The model asks
        the cache to attend, so nanorl/gpt.py never imports this module."""
        kc, vc = self.k[layer], self.v[layer]
        kc[self.write_rows, :, self.write_pos] = k.transpose(1, 2).to(kc.dtype)
        vc[self.write_rows, :, self.write_pos] = v.transpose(1, 2).to(vc.dtype)
        rows = self._rows()  # leading rows read views of the cache, other rows a gathered copy
        return attend_cached(q, kc[rows, :, : self.attend_len], vc[rows, :, : self.attend_len], mask)

    def lockstep(self, B):
        """The one position rows 0..B-1 all stand at (engine_model.LockstepDecode's case), or None (one host sync)."""
        lo, hi = torch.stack(self.pos[:B].aminmax()).tolist()
        return lo if lo == hi else None

    def end(self, T):
        self.pos[self._rows()] += T
        self.write_pos = self.write_rows = None

    def reset(self, rows=None):
        if rows is None:
            self.pos.zero_()
        else:
            self.pos[rows] = 0

    def copy_rows(self, src, dst, source=None):
        """Copy the cached tokens of rows src (of `source`, default this cache) into rows dst. Prefix sharing:
        prefill a prompt once, then fan it out to the n rows that sample from it; and moving a row."""
        source = self if source is None else source
        L = int(source.pos[src].max())
        self.k[:, dst, :, :L] = source.k[:, src, :, :L]
        self.v[:, dst, :, :L] = source.v[:, src, :, :L]
        self.pos[dst] = source.pos[src]


KERNEL_NAMES = {
    SDPBackend.MATH: "math",
    SDPBackend.FLASH_ATTENTION: "flash (CPU)",
    SDPBackend.EFFICIENT_ATTENTION: "memory-efficient",
}


def attention_backends(device):
    """The SDPA backends attention over the cache is pinned to (the engine's prefill and decode, greedy_decode).
    Pinned, not left to SDPA's choice: a graph freezes whichever kernel ran at capture, so a torch or cuDNN upgrade
    must not swap it silently (left to the dispatcher, torch 2.13 on an H100 would pick a cuDNN kernel for a prefill
    that no test here exercises). On CUDA memory-efficient attention, the kernel that takes a boolean mask (flash
    takes none); on CPU the fused flash kernel, which takes the mask too and reads each row's keys and values once
    (the math kernel materialises scores, a float mask and their sum: 1.3-1.4x slower at 32 rows of 128-wide heads);
    math elsewhere."""
    if device.type == "cuda":
        return [SDPBackend.EFFICIENT_ATTENTION]
    if device.type == "cpu":
        return [SDPBackend.FLASH_ATTENTION]
    return [SDPBackend.MATH]


def attend_cached(q, k, v, mask):
    """
    Attention of q (B, H, T, D) over cached k, v (B, Hkv, L, D) with a boolean mask (B, 1, T, L), or None (every key visible).
    GQA: the G query heads sharing a KV head are folded into the query length, so each KV head is read
    once and never expanded (SDPA's enable_gqa with a mask would fall back to a kernel that repeats K/V
    G times, and decode is bound by exactly those bytes). q is cast to the cache dtype, never the reverse.
    """
    B, H, T, D = q.shape
    Hkv = k.size(1)
    G = H // Hkv
    dtype = q.dtype
    q = q.to(k.dtype).reshape(B, Hkv, G * T, D)  # query head h = kv_head * G + g, as enable_gqa groups them
    if G > 1 and T > 1:  # (one token: the (B, 1, 1, L) mask broadcasts over the G folded rows as it is)
        mask = mask.repeat(1, 1, G, 1)  # row g * T + t of the folded query uses token t's mask
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return y.reshape(B, H, T, D).to(dtype)


def attend_shared_prefix(q, kc, vc, P, L, n=None):
    """
    Attention of one query per row, q (B, H, D), over keys 0..L-1 of cache rows kc, vc (B, Hkv, max_len, D) whose
    rows come in groups of n (all B rows by default), the first P keys of a group's rows the same (the samples of
    one prompt, fanned out from one prefill): each group's prompt keys and values are read once, from its first row,
    for all its rows' queries together (one GEMM per group and KV head), and only keys P..L-1 row by row. A decode
    step reads every row's whole cache, so with n samples of a P-token prompt this reads (n - 1) * P fewer keys and
    values per group and layer. One softmax over both parts' scores: the attention over the whole rows, up to float
    rounding (another summation order than SDPA's). -> (B, H * D)
    """
    B, H, D = q.shape
    n = n or B
    Hkv = kc.size(1)
    G, groups = H // Hkv, B // n
    q = q.view(B, Hkv, G, D)
    kp, vp = kc[::n, :, :P], vc[::n, :, :P]  # (groups, Hkv, P, D): each group's first row's copy of its prompt
    ks, vs = kc[:, :, P:L], vc[:, :, P:L]  # (B, Hkv, L - P, D): each row's own tokens

    def by_group(x):  # (B, Hkv, G, k) -> (groups, Hkv, n * G, k): a group's queries of a KV head as one GEMM's rows
        return x.view(groups, n, Hkv, G, -1).transpose(1, 2).reshape(groups, Hkv, n * G, -1)

    def by_row(x):  # the inverse: (groups, Hkv, n * G, k) -> (B, Hkv, G, k)
        return x.view(groups, Hkv, n, G, -1).transpose(1, 2).reshape(B, Hkv, G, -1)

    prefix = by_row(by_group(q) @ kp.transpose(-1, -2))
    p = torch.cat([prefix, q @ ks.transpose(2, 3)], -1).mul_(D**-0.5).softmax(-1)  # (B, Hkv, G, L)
    y = by_row(by_group(p[..., :P]) @ vp)
    return (y + p[..., P:] @ vs).reshape(B, H * D)


@torch.no_grad()
def greedy_decode(model, ids, max_tokens, device):
    """The greedy continuation of the token list ids (at most max_tokens, less where the context ends). `device` is
    where it computes, which is not where the parameters are under FSDP's --cpu-offload: the cache and the inputs go
    there, never to a parameter's device. Attention runs on the engine's pinned kernels (attention_backends),
    not on whichever SDPA's dispatcher picks for a masked call."""
    device = torch.device(device)
    cache = new_kv_cache(model, 1, min(len(ids) + max_tokens, model.config.sequence_len), device)
    x, out = torch.tensor([ids], device=device), []
    for _ in range(max_tokens):
        with sdpa_kernel(attention_backends(device)):
            out.append(int(model(x, kv_cache=cache)[0, -1].argmax()))
        if int(cache.pos[0]) >= cache.max_len:
            break
        x = torch.tensor([[out[-1]]], device=device)
    return out


# -----------------------------------------------------------------------------------------------
# a cache, sized against the memory that is free before it is allocated


def new_kv_cache(model, batch_size, max_len, device):
    """A KV cache for model's forwards on `device` (bf16 on CUDA, fp32 elsewhere), refused in one line when it is
    longer than the model's context or cannot fit in free memory. `device` is where the forwards compute, which is
    not where the parameters are under FSDP's --cpu-offload."""
    cfg, device = model.config, torch.device(device)
    if max_len > cfg.sequence_len:
        raise ValueError(f"KV cache length {max_len} exceeds the model's context {cfg.sequence_len}")
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
        return KVCache(cfg.n_layer, batch_size, cfg.n_kv_head, max_len, model.head_dim, device, dtype)
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
