"""
How the engine's decode step runs on the device: the attention kernels it is pinned to, its precision, and the
CUDA graphs it is replayed from (one per ladder batch size and attention-length bucket, captured up front).
"""

from contextlib import nullcontext

import torch
from torch.nn.attention import SDPBackend

from nanorl.common import cuda_dtypes

KERNEL_NAMES = {
    SDPBackend.MATH: "math",
    SDPBackend.FLASH_ATTENTION: "flash (CPU)",
    SDPBackend.EFFICIENT_ATTENTION: "memory-efficient",
}


def decode_backends(device):
    """The SDPA backends allowed inside a decode step. Pinned, not left to SDPA's choice: a graph freezes whichever
    kernel ran at capture, so a torch or cuDNN upgrade must not swap it silently. Memory-efficient attention is the
    CUDA kernel that takes a boolean mask (flash takes none); on CPU the plain math kernel."""
    if device.type == "cuda":
        return [SDPBackend.EFFICIENT_ATTENTION]
    return [SDPBackend.MATH]


def prefill_backends(device):
    """The SDPA backends allowed in a prefill: on CUDA memory-efficient attention, the kernel decode runs (it
    takes the boolean mask; left to the dispatcher, torch 2.13 on an H100 would pick a cuDNN kernel no test
    here exercises); on CPU the fused flash kernel SDPA's dispatcher picks there; math elsewhere."""
    if device.type == "cuda":
        return [SDPBackend.EFFICIENT_ATTENTION]
    if device.type == "cpu":
        return [SDPBackend.FLASH_ATTENTION]
    return [SDPBackend.MATH]


def engine_autocast(device, weight_dtype):
    """bf16 autocast only for fp32 weights on CUDA (share_weights); cache_enabled=False: autocast's weight-cast
    cache must not outlive a CUDA graph capture."""
    if cuda_dtypes(device) and weight_dtype == torch.float32:
        return torch.amp.autocast(device.type, dtype=torch.bfloat16, cache_enabled=False)
    return nullcontext()


@torch.no_grad()
def capture_decode_graphs(forward_step, cache, sizes, buckets):
    """{(size, L): (graph, logits)}: forward_step(size) captured per (ladder batch size, attention-length bucket)
    while the cache is empty, so the warm-up runs cannot overwrite anyone's KV. A step then replays the smallest
    batch that holds its busy rows and the smallest bucket that covers its longest row: static shapes, one launch,
    and neither idle slots nor short rows pay for the whole cache. The graphs read the weights in place: an
    in-place copy (Engine.load_weights) is seen, swapped tensors are not."""
    graphs, pool = {}, torch.cuda.graph_pool_handle()
    cache.static = True
    try:
        for size in sizes:
            for L in buckets:
                cache.attend_len = L
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # warm up outside the capture (cuBLAS workspaces, kernel choice)
                    for _ in range(2):
                        cache.pos.zero_()
                        forward_step(size)
                torch.cuda.current_stream().wait_stream(side)
                cache.pos.zero_()
                graph = torch.cuda.CUDAGraph()
                # one pool for all graphs: they never run at once, and each step reads its logits right away
                with torch.cuda.graph(graph, pool=pool):
                    logits = forward_step(size)
                graphs[size, L] = (graph, logits)
    finally:
        cache.static, cache.attend_len = False, None
        cache.pos.zero_()
    return graphs
