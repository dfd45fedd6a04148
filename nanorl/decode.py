"""
What the engine runs on the device for a decode step: its own copy of the model, the KV cache and the attention over
it, the lean step of rows that stand at one position, the CUDA graphs that step is replayed from, and the sampler that
turns its logits into tokens. nanorl/engine.py schedules requests over these; this file is what each step computes.

- the engine's model (inference_copy): a frozen copy of the weights in one flat buffer, bf16 on CUDA, fp32 elsewhere,
  Linear weights stored column-major on the CPU; engine_autocast() is the precision its forwards run in
- the KV cache (KVCache): every layer's keys and values with its own position per row, so one batch mixes prompts of
  different lengths and rows refilled at different times (continuous batching). new_kv_cache() sizes one against the
  free memory; a forward that is given one calls its begin(), then attend() once per layer, so nanorl/gpt.py needs
  nothing from this file. attend_cached() folds grouped-query heads into the query length so each KV head is
  read once, never repeated, on the SDPA kernels attention_backends() pins
- LockstepDecode: the step of rows that all stand at one position (batch 1, a prompt's samples), which reads a
  prompt's keys and values once for all its samples (attend_shared_prefix)
- CUDA graphs of the decode step, one per ladder batch size and attention-length bucket, captured up front on the
  engine's device and each replayed once against the eager step before the engine trusts it
- the sampler: pure functions of logits and per-row settings, its randomness counter-based (uniform_from_counter)
- greedy_decode(): the one cached decode outside the engine, a training log's samples through a cache of one row
"""

import collections
import sys
from typing import NamedTuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from nanorl.gpt import CausalSelfAttention
from nanorl.precision import bf16_matmuls, cuda_dtypes, low_precision_dtype

# --- the engine's copy of the model -----------------------------------------------------------------------------------


def column_major_groups(model):
    """{id(weight): the weights laid out together} for the engine's CPU copy: every untied, plain nn.Linear weight
    alone, and c_q, c_k and c_v of an attention together (so fuse_qkv still finds them as one view). F.linear on a
    weight stored as its (in, out) transpose runs MKL's plain GEMM instead of its transposed-B path: the same
    speed at one row, 2.2-2.7x at 8 rows and 1.3-1.5x at 32 (a prompt's samples decoding in lockstep), at the
    price of another summation order than the trainer's (log-probs agree to float32 rounding, not bit for bit)."""
    uses = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))

    def plain(m):
        return type(m) is nn.Linear and m.bias is None and uses[id(m.weight)] == 1

    groups = {}
    for m in model.modules():
        if isinstance(m, CausalSelfAttention) and all(plain(getattr(m, n)) for n in ("c_q", "c_k", "c_v")):
            ws = [m.c_q.weight, m.c_k.weight, m.c_v.weight]
            groups.update({id(w): ws for w in ws})
    for m in model.modules():
        if type(m) is nn.Linear and uses[id(m.weight)] == 1 and id(m.weight) not in groups:
            groups[id(m.weight)] = [m.weight]
    return groups


@torch.no_grad()
def inference_copy(model, dtype):
    """A frozen copy of model for sampling -> (copy, flat): every parameter of the copy is a view of one flat
    buffer `flat` of dtype, so the whole set of weights is one tensor (one copy, one broadcast). Tied parameters
    stay tied; buffers (the rotary tables) keep their own dtype. On CPU each Linear's weight (out, in) is the
    transposed view of an (in, out) block, and c_q, c_k, c_v share one block (column_major_groups says why)."""
    with torch.device("meta"):
        twin = type(model)(model.config)
    unique = {id(p): p for p in model.parameters()}
    flat = torch.empty(sum(p.numel() for p in unique.values()), dtype=dtype, device=next(model.parameters()).device)
    groups = column_major_groups(model) if flat.device.type == "cpu" else {}
    views, offset = {}, 0
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in views:
            if id(p) in groups:  # an (in, sum of outs) block, each weight a column range of it seen transposed
                ws = groups[id(p)]
                width, C = sum(w.size(0) for w in ws), ws[0].size(1)
                block, start = flat[offset : offset + width * C].view(C, width), 0
                for w in ws:
                    views[id(w)] = block[:, start : start + w.size(0)].t()
                    start += w.size(0)
            else:
                ws, block = [p], flat[offset : offset + p.numel()].view(p.shape)
                views[id(p)] = block
            for w in ws:
                views[id(w)] = torch.nn.Parameter(views[id(w)].copy_(w.detach()), requires_grad=False)
            offset += block.numel()
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
    for m in twin.modules():
        if isinstance(m, CausalSelfAttention):
            m.fuse_qkv()  # q, k and v from one view of the flat buffer
    return twin.eval(), flat


def engine_autocast(device, weight_dtype):
    """bf16 autocast only for fp32 weights on CUDA (share_weights); cache_enabled=False: autocast's weight-cast
    cache must not outlive a CUDA graph capture. The engine makes it once and enters it at every forward: every
    context returned here can be entered again once it is left."""
    if cuda_dtypes(device) and weight_dtype == torch.float32:
        return torch.amp.autocast(device.type, dtype=torch.bfloat16, cache_enabled=False)
    return bf16_matmuls(device)  # a bf16 copy on a CPU without bf16 matrix kernels: its matmuls in fp32


# --- the KV cache and the attention over it ---------------------------------------------------------------------------


class KVCache:
    """
    A pre-allocated KV cache with its own position per row, so one batch holds prompts of different
    lengths and rows that are refilled at different times (continuous batching).
    k, v: (n_layer, B, n_kv_head, max_len, head_dim), the halves of kv. pos[b] = how many tokens row b holds.
    A forward with the cache calls begin() once (which moves each row's position past the new tokens), then attend()
    once per layer.
    """

    def __init__(self, n_layer, batch_size, n_kv_head, max_len, head_dim, device, dtype):
        # keys and values in one tensor, so copy_rows moves both at once; k and v are its two halves (views)
        self.kv = torch.zeros((2, n_layer, batch_size, n_kv_head, max_len, head_dim), device=device, dtype=dtype)
        self.k, self.v = self.kv
        self.pos = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.max_len = max_len
        # each cache row's index and each key's position, made once: begin() indexes them for every forward
        self.row_ids = torch.arange(batch_size, device=device)
        self.key_pos = torch.arange(max_len, device=device)
        self.attend_len = None  # how much of the cache attention reads: worked out each forward unless static
        self.static = False  # True: the caller fixed attend_len (static shapes for CUDA graphs)
        # which cache rows the forward's batch rows are: a slice of leading rows (views, no copies: the engine
        # decodes its busy rows 0..n-1 this way) or a LongTensor of rows (gathered: the engine prefills a few new
        # prompts straight into free rows of the big decode cache). slice(None) = all rows, in order.
        self.rows = slice(None)
        self.write_pos = self.write_rows = None  # (B, T) positions and cache rows the current forward writes (begin())

    def begin(self, T):
        """Positions (B, T) of the next T tokens of each row, and the (B, 1, T, attend_len) attention mask. The rows'
        positions move past these tokens now: the layers' attend() only reads what begin() worked out (write_pos)."""
        start = self.pos[self.rows]
        if not self.static:
            # eager path: read only the used part of the cache (one host sync). A caller that wants
            # static shapes (CUDA graphs) sets static and attend_len itself and skips this check.
            self.attend_len = int(start.max()) + T
            if self.attend_len > self.max_len:
                raise ValueError(f"KV cache is full: position {self.attend_len - 1} >= max_len {self.max_len}")
        self.write_pos = start[:, None] + torch.arange(T, device=start.device)[None, :]
        # the cache row each (b, t) writes to, the same for every layer
        self.write_rows = self.row_ids[self.rows, None].expand_as(self.write_pos)
        self.pos[self.rows] += T  # after start is read: a slice of rows makes it a view of pos
        return self.write_pos, (self.key_pos[: self.attend_len] <= self.write_pos[:, :, None])[:, None]

    def attend(self, layer, q, k, v, mask):
        """One layer's attention in a cached forward: its new keys/values k, v (B, Hkv, T, D) written at write_pos,
        then q (B, H, T, D) over the forward's rows of the cache with begin()'s mask (attend_cached). The model asks
        the cache to attend, so nanorl/gpt.py never imports this module."""
        kc, vc = self.k[layer], self.v[layer]
        kc[self.write_rows, :, self.write_pos] = k.transpose(1, 2).to(kc.dtype)
        vc[self.write_rows, :, self.write_pos] = v.transpose(1, 2).to(vc.dtype)
        # leading rows read views of the cache, other rows a gathered copy
        return attend_cached(q, kc[self.rows, :, : self.attend_len], vc[self.rows, :, : self.attend_len], mask)

    def lockstep(self, B):
        """The one position rows 0..B-1 all stand at (LockstepDecode's case), or None (one host sync)."""
        lo, hi = torch.stack(self.pos[:B].aminmax()).tolist()
        return lo if lo == hi else None

    def reset(self, rows=None):
        if rows is None:
            self.pos.zero_()
        else:
            self.pos[rows] = 0

    def copy_rows(self, src, dst):
        """Copy the cached tokens of rows src into rows dst. Prefix sharing: prefill a prompt once, then fan it out
        to the n rows that sample from it; and moving a row."""
        L = int(self.pos[src].max())
        self.kv[:, :, dst, :, :L] = self.kv[:, :, src, :, :L]
        self.pos[dst] = self.pos[src]


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
    G = H // k.size(1)
    if G > 1 and T > 1:  # (one token: the (B, 1, 1, L) mask broadcasts over the G folded rows as it is)
        mask = mask.repeat(1, 1, G, 1)  # row g * T + t of the folded query uses token t's mask
    # query head h = kv_head * G + g, as enable_gqa groups them
    y = F.scaled_dot_product_attention(q.to(k.dtype).reshape(B, k.size(1), G * T, D), k, v, attn_mask=mask)
    return y.reshape(B, H, T, D).to(q.dtype)


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


# --- the decode step of rows at one position --------------------------------------------------------------------------


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


class LockstepDecode:
    """
    The engine's step when rows 0..B-1 of its cache all hold pos tokens (batch 1, or one prompt's samples decoding
    together): decode = LockstepDecode(model, cache); decode(idx, pos) -> logits (B, V) of the token after idx (B,),
    the numbers of model(idx[:, None], kv_cache=cache)[:, 0] bit for bit (tests/test_gpt.py, every architecture
    switch), in a fifth less time at batch 1 on a CPU, where a one-token step is mostly host work per op: every
    layer's weights and cache views are gathered once here, and the loop calls F.linear and F.rms_norm on them (no
    nn.Module calls, no time axis), one rotary row serves every row, each layer's KV is written into and read from
    plain slices of its cache (no positions, mask or scatter). decode(idx, pos, shared=P, group=n) says the rows
    come in groups of n rows (all of them by default) whose first P keys are one prompt's, fanned out from one
    prefill: attention reads them once for each group (attend_shared_prefix; equal to float rounding, not bit for
    bit), ~13% of a d8 step with 32 samples of a 64-token prompt on a CPU.
    Only for the engine's own copy (inference_copy): its modules carry no hooks or adapters, its weights are in the
    compute dtype and refreshed in place (load_weights), so the views gathered here stay right.
    """

    def __init__(self, model, cache):
        self.model, self.cache = model, cache
        cfg = model.config
        self.H, self.Hkv, self.D, self.C = cfg.n_head, cfg.n_kv_head, model.head_dim, cfg.n_embd
        # a shared prompt is read once only from an fp32 cache: attend_shared_prefix's scores and softmax are in the
        # cache dtype, where SDPA's kernels keep fp32 (bf16 scores would cost the log-probs their agreement)
        self.fp32 = cache.k.dtype == torch.float32
        self.layers = []
        for b, k, v in zip(model.transformer.h, cache.k, cache.v):
            n1, n2, mlp = b.norm_attn, b.norm_mlp, b.mlp
            gate = mlp.c_gate.weight if mlp.swiglu else None
            w = (n1.weight, n1.eps, b.attn.c_proj.weight, n2.weight, n2.eps, gate, mlp.c_fc.weight)
            self.layers.append((b.attn, *w, mlp.c_proj.weight, k, v))

    def __call__(self, idx, pos, shared=0, group=None):
        if pos >= self.cache.max_len:
            raise ValueError(f"KV cache is full: position {pos} >= max_len {self.cache.max_len}")
        model, (B,), H, Hkv, D = self.model, idx.shape, self.H, self.Hkv, self.D
        C, norm_f = (self.C,), model.transformer.norm_f
        cos, sin = model.cos[pos], model.sin[pos]
        x = F.embedding(idx, model.transformer.wte.weight)  # (B, C)
        if not model.config.norm_weight:
            x = F.rms_norm(x, C)
        for attn, w1, e1, wo, w2, e2, gate, fc, proj, kc, vc in self.layers:
            h = F.rms_norm(x, C, w1, e1)
            q, k, v = attn.heads(h, cos, sin)
            kc[:B, :, pos], vc[:B, :, pos] = k, v
            if shared and self.fp32:  # the rows' first `shared` keys are one prompt's: read once (see there)
                y = attend_shared_prefix(q, kc[:B], vc[:B], shared, pos + 1, group)
            else:  # a KV head's G query heads side by side, as attend_cached folds them
                y = F.scaled_dot_product_attention(q.view(B, Hkv, -1, D), kc[:B, :, : pos + 1], vc[:B, :, : pos + 1])
            x = x + F.linear(y.view(B, H * D), wo)
            h = F.rms_norm(x, C, w2, e2)
            u = F.linear(h, fc)  # MLP.forward
            u = F.relu(u).square() if gate is None else F.silu(F.linear(h, gate)) * u
            x = x + F.linear(u, proj)
        self.cache.pos[:B] += 1
        return model.logits_from_hidden(F.rms_norm(x, C, norm_f.weight, norm_f.eps))


# --- CUDA graphs of the decode step -----------------------------------------------------------------------------------


@torch.no_grad()
def capture_decode_graphs(forward_step, cache, sizes, buckets, device):
    """{(size, L): (graph, logits)}: forward_step(size) captured per (ladder batch size, attention-length bucket)
    while the cache is empty, so the warm-up runs cannot overwrite anyone's KV. A step then replays the smallest
    batch that holds its busy rows and the smallest bucket that covers its longest row: static shapes, one launch,
    and neither idle slots nor short rows pay for the whole cache. The graphs read the weights in place: an
    in-place copy (Engine.load_weights) is seen, swapped tensors are not.
    Everything happens on `device`, the engine's, whatever the current device is: a capture on another device's
    stream records none of the engine's kernels (PyTorch only warns) and its replays return stale logits."""
    graphs = {}
    cache.static = True
    try:
        with torch.cuda.device(device):
            pool = torch.cuda.graph_pool_handle()
            # one side stream on the engine's device for the warm-ups and every capture (torch.cuda.graph's own
            # default stream is made once per process, on whichever device was current then)
            side = torch.cuda.Stream(device)
            for size in sizes:
                for L in buckets:
                    cache.attend_len = L
                    side.wait_stream(torch.cuda.current_stream(device))
                    with torch.cuda.stream(side):  # warm up outside the capture (cuBLAS workspaces, kernel choice)
                        for _ in range(2):
                            cache.pos.zero_()
                            forward_step(size)
                    torch.cuda.current_stream(device).wait_stream(side)
                    cache.pos.zero_()
                    graph = torch.cuda.CUDAGraph()
                    # one pool for all graphs: they never run at once, and each step reads its logits right away
                    with torch.cuda.graph(graph, pool=pool, stream=side):
                        logits = forward_step(size)
                    graphs[size, L] = (graph, logits)
    finally:
        cache.static, cache.attend_len = False, None
        cache.pos.zero_()
    return graphs


@torch.no_grad()
def checked_decode_graphs(forward_step, cache, sizes, buckets, input_ids, vocab_size):
    """capture_decode_graphs, then first_stale_graph: the graphs, or {} with one warning when one of them does not
    reproduce the eager step (a wrong graph would decode garbage without an error; the engine then runs eagerly)."""
    graphs = capture_decode_graphs(forward_step, cache, sizes, buckets, input_ids.device)
    stale = first_stale_graph(graphs, forward_step, cache, input_ids, vocab_size)
    if stale is None:
        return graphs
    print(
        f"warning: the CUDA graph of decode batch {stale[0]}, attention length {stale[1]} on {input_ids.device} does "
        "not reproduce the eager step: this engine decodes eagerly (same tokens, slower)",
        file=sys.stderr,
        flush=True,
    )
    return {}


def first_stale_graph(graphs, forward_step, cache, input_ids, vocab_size):
    """The (size, L) of the first graph whose replay does not give the eager step's logits, or None when all do.
    Each graph is replayed on tokens it was not captured with (1, 2, 3, ...) and compared with forward_step(size) at
    the same static shapes: a graph that recorded nothing returns its capture's logits and is caught here, at start,
    rather than decoding garbage. The cache is left empty and the tokens zero."""
    tokens = 1 + torch.arange(input_ids.numel(), device=input_ids.device) % (vocab_size - 1)
    cache.static = True
    try:
        for (size, L), (graph, logits) in graphs.items():
            input_ids[:size] = tokens[:size]
            cache.attend_len = L
            cache.pos.zero_()
            graph.replay()
            replayed = logits.to(torch.float32, copy=True)  # the static logits outlive this replay
            cache.pos.zero_()
            eager = forward_step(size).float()
            # the same kernels at the same shapes: equal up to rounding; a stale or empty graph is off by O(1)
            if (replayed - eager).abs().max() > 1e-2 * eager.abs().max() + 1e-3:
                return size, L
    finally:
        cache.static, cache.attend_len = False, None
        cache.pos.zero_()
        input_ids.zero_()
    return None


# --- the sampler ------------------------------------------------------------------------------------------------------


# Counter-based randomness: token t of a sample gets uniform_from_counter(row seed, t), a splitmix64 hash computed on
# the host (a few numpy ops a step), so a sample never depends on what else shares its batch and no generator object
# is stepped per request. tempered() is the distribution the engine samples from and records the log-probs of;
# sample_tokens() draws one token per row by inverse-CDF sampling, with per-row temperature, top-k and top-p;
# sample_with_logprobs() is the engine's step: the sampled tokens and their log_softmax(tempered) log-probs.

_MASK64 = (1 << 64) - 1
_GOLDEN, _M1, _M2 = (np.uint64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))
_BELOW_ONE = 1 - 2**-24  # the largest float32 below 1


def _mix64(x):
    """splitmix64's finalizer on uint64 numpy arrays, which wrap and shift logically as it wants (the shift counts are
    uint64: numpy 1 would promote a Python int to float)."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def row_seed(seed, index):
    """The seed of sample `index` of a request seeded `seed` (any int), as the signed int64 a device tensor holds:
    the finalizer turns (seed, sample index) into well-spread row seeds."""
    x = _mix64(np.array([seed & _MASK64], dtype=np.uint64)) + np.uint64(index)
    return int(_mix64(x).view(np.int64)[0])


def uniform_from_counter(seed, counter):
    """(B,) int64 row seeds and token counters (numpy) -> (B,) float64 uniforms in [0, 1): splitmix64.
    Counter-based: token t of a sample gets the same number whatever else is in the batch, and no
    per-request generator object has to be stepped in Python. Token t gets splitmix64's output t + 1 (its state
    advances before it mixes): output 0 of seed 0 would be exactly 0, and u = 0 draws token id 0 whatever its
    probability (row_seed(0, 0) is 0, so every first sample of a request seeded 0 began with that token).
    On the host: a dozen numpy ops on B numbers cost a fifth of as many device ops, and the engine keeps each slot's
    seed and counter there anyway."""
    x = np.asarray(seed, dtype=np.int64).view(np.uint64)
    x = x + (np.asarray(counter, dtype=np.int64).view(np.uint64) + np.uint64(1)) * _GOLDEN
    return (_mix64(x) >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def tempered(logits, temperature):
    """(logits - row max) / T per row (T = 1 where T = 0, greedy): the log-probs the engine records are
    log_softmax of this. Subtracting the max first keeps it total for any T > 0: at T = 1e-40 the top
    token gets 0 and the rest -inf, where logits / T would overflow to inf - inf = NaN."""
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    return (logits - logits.amax(dim=-1, keepdim=True)) / t[:, None]


class SamplerSettings(NamedTuple):
    """Each row's sampler, on the logits' device: temperature (B,) fp32 (0 = greedy), top_k (B,) long (V = off),
    top_p (B,) fp32 (1 = off)."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor


def sample_tokens(logits, settings, uniform, filtered=True):
    """
    One token per row of fp32 logits (B, V) by inverse-CDF sampling with one uniform per row, as each row's
    SamplerSettings say; filtered=False skips the sort when no row uses top-k/top-p. Total: whatever the values, the
    most likely token stays a candidate.
    """
    return sample_with_logprobs(logits, settings, uniform, filtered)[0]


def sample_with_logprobs(logits, settings, uniform, filtered=True, greedy=True, forced=None, unit=False):
    """sample_tokens(), then each row's token replaced by forced[row] where that is >= 0 (tool output), and the
    log-prob of every token under the distribution sampled from: log_softmax(tempered), before top-k/top-p (the
    trainer cannot apply those filters). greedy=False promises no row has temperature 0 (skips an argmax),
    unit=True that every row's is 1 or 0 (skips a division: softmax and log_softmax subtract the row max
    themselves, first and alone, on CPU and CUDA, so raw logits give the same bits as tempered() ones without its two
    passes over the vocab), uniform=None that every row is greedy (the argmax alone: no softmax, cumsum or search, as
    an all-greedy eval needs). -> (tokens (B,) long, log-probs (B,) fp32)."""
    x = logits if unit else tempered(logits, settings.temperature)
    if uniform is None:
        tok = logits.argmax(-1)
    else:
        if filtered:
            # only the rows that filter are sorted: a row's token must not depend on whether a filtering request
            # shares its batch (inverse-CDF sampling in sorted order picks another token for the same uniform)
            V = x.size(-1)
            rank = torch.arange(V, device=logits.device).expand_as(x)
            sorts = ((settings.top_k < V) | (settings.top_p < 1))[:, None]
            x_sorted, order_sorted = x.sort(dim=-1, descending=True)
            order = torch.where(sorts, order_sorted, rank)
            probs = torch.softmax(torch.where(sorts, x_sorted, x), dim=-1)
            # top-k and top-p both keep a prefix of the sorted tokens; rank 0 is kept whatever top_p is (a top_p of
            # 1e-50 is 0 in float32, and "mass before it < 0" would keep nothing)
            keep = (rank < settings.top_k[:, None]) & (probs.cumsum(-1) - probs < settings.top_p[:, None])
            probs = probs * (keep | (rank == 0) | ~sorts)
        else:
            probs = torch.softmax(x, dim=-1)
        cdf = probs.cumsum(-1)
        # u < total strictly (a float32 u below 1 times total rounds below it; a float64 u near 1 rounds to 1.0 in
        # float32), so the search lands before the end, on a token whose own probability is > 0
        u = uniform.float().clamp(max=_BELOW_ONE)[:, None] * cdf[:, -1:]
        idx = torch.searchsorted(cdf, u, right=True)
        # a parallel cumsum (CUDA) is not exactly monotone; in the rare case that lands on a removed token, take the
        # top one (the check reads one bool per step on the host: cheaper than an argmax over the vocab every step).
        # CPU's cumsum adds each row in order in float64: its cdf is monotone, cdf[i] > u >= cdf[i - 1] means p[i] > 0
        if probs.is_cuda:
            landed = probs.gather(1, idx) > 0
            if not bool(landed.all()):
                idx = torch.where(landed, idx, probs.argmax(-1, keepdim=True))
        if filtered:
            idx = order.gather(1, idx)
        tok = idx[:, 0]
        if greedy:
            tok = torch.where(settings.temperature > 0, tok, logits.argmax(-1))
    if forced is not None:
        tok = torch.where(forced >= 0, forced, tok)
    return tok, torch.log_softmax(x, dim=-1).gather(1, tok[:, None])[:, 0]


# --- outside the engine -----------------------------------------------------------------------------------------------


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
