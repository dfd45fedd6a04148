"""
The engine's model: its own frozen copy of the weights (inference_copy: one flat buffer, bf16 on CUDA, fp32
elsewhere, Linear weights stored column-major on the CPU), the lean decode step of rows that all stand at one
position (LockstepDecode), the precision its forwards run in (engine_autocast), and the CUDA graphs its decode step
is replayed from (one per ladder batch size and attention-length bucket, captured up front on the engine's device,
and each replayed once against the eager step before the engine trusts it). nanorl/engine.py builds and calls them.
"""

import collections
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanorl.gpt import CausalSelfAttention
from nanorl.kv_cache import attend_shared_prefix
from nanorl.precision import bf16_matmuls, cuda_dtypes


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
        m, (B,), H, Hkv, D = self.model, idx.shape, self.H, self.Hkv, self.D
        C, n = (self.C,), m.transformer.norm_f
        cos, sin = m.cos[pos], m.sin[pos]
        x = F.embedding(idx, m.transformer.wte.weight)  # (B, C)
        if not m.config.norm_weight:
            x = F.rms_norm(x, C)
        for attn, w1, e1, wo, w2, e2, gate, fc, proj, kc, vc in self.layers:
            h = F.rms_norm(x, C, w1, e1)
            q, k, v = attn.heads(h, cos, sin)
            kc, vc = kc[:B], vc[:B]
            kc[:, :, pos], vc[:, :, pos] = k, v
            if shared and self.fp32:  # the rows' first `shared` keys are one prompt's: read once (see there)
                y = attend_shared_prefix(q, kc, vc, shared, pos + 1, group)
            else:  # a KV head's G query heads side by side, as attend_cached folds them
                y = F.scaled_dot_product_attention(
                    q.view(B, Hkv, H // Hkv, D), kc[:, :, : pos + 1], vc[:, :, : pos + 1]
                )
            x = x + F.linear(y.view(B, H * D), wo)
            h = F.rms_norm(x, C, w2, e2)
            u = F.linear(h, fc)  # MLP.forward
            u = F.relu(u).square() if gate is None else F.silu(F.linear(h, gate)) * u
            x = x + F.linear(u, proj)
        self.cache.pos[:B] += 1
        return m.logits_from_hidden(F.rms_norm(x, C, n.weight, n.eps))


def engine_autocast(device, weight_dtype):
    """bf16 autocast only for fp32 weights on CUDA (share_weights); cache_enabled=False: autocast's weight-cast
    cache must not outlive a CUDA graph capture. The engine makes it once and enters it at every forward: every
    context returned here can be entered again once it is left."""
    if cuda_dtypes(device) and weight_dtype == torch.float32:
        return torch.amp.autocast(device.type, dtype=torch.bfloat16, cache_enabled=False)
    return bf16_matmuls(device)  # a bf16 copy on a CPU without bf16 matrix kernels: its matmuls in fp32


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
