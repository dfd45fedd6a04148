"""
How the engine's decode step runs on the device: the attention kernels it is pinned to, its precision, and the
CUDA graphs it is replayed from (one per ladder batch size and attention-length bucket, captured up front on the
engine's device, and each replayed once against the eager step before the engine trusts it).
"""

import torch
from torch.nn.attention import SDPBackend

from nanorl.precision import bf16_matmuls, cuda_dtypes

KERNEL_NAMES = {
    SDPBackend.MATH: "math",
    SDPBackend.FLASH_ATTENTION: "flash (CPU)",
    SDPBackend.EFFICIENT_ATTENTION: "memory-efficient",
}


def attention_backends(device):
    """The SDPA backends the engine's prefill and decode steps (and kv_cache.greedy_decode) are pinned to. Pinned, not
    left to SDPA's choice: a graph freezes whichever kernel ran at capture, so a torch or cuDNN upgrade must not swap
    it silently (left to the dispatcher, torch 2.13 on an H100 would pick a cuDNN kernel for a prefill that no test
    here exercises). On CUDA memory-efficient attention, the kernel that takes a boolean mask (flash takes none); on
    CPU the fused flash kernel, which takes the mask too and reads each row's keys and values once (the math kernel
    materialises scores, a float mask and their sum: 1.3-1.4x slower at 32 rows of 128-wide heads); math elsewhere."""
    if device.type == "cuda":
        return [SDPBackend.EFFICIENT_ATTENTION]
    if device.type == "cpu":
        return [SDPBackend.FLASH_ATTENTION]
    return [SDPBackend.MATH]


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
