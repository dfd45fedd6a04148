"""
The precision policy: which dtypes a run computes in (CUDA's layout: bf16 autocast over fp32 master weights, a bf16
embedding, bf16 inference copies and KV caches; fp32 elsewhere unless NANORL_CUDA_DTYPES=1), the autocast context the
stages enter, and bf16 matmuls on a CPU that has no bf16 matrix kernels.
"""

import os
import threading
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import noop_context_fn

CUDA_DTYPES_ENV = "NANORL_CUDA_DTYPES"


def cuda_dtypes(device):
    """Whether a run on `device` (a torch.device or its type) uses CUDA's dtypes and precision policies: the bf16
    token embedding, bf16 inference copies and KV caches, bf16 autocast, FSDP's bf16 gathers, Muon's bf16
    Newton-Schulz. Always on CUDA; on the CPU only with NANORL_CUDA_DTYPES=1, which makes the CPU run exactly the
    GPU's dtype layout so that its tests find the GPU path's dtype bugs (docs/testing.md), and which the tiny
    speedrun sets on a CPU with bf16 matrix units (AMX), where its steps run ~3x faster. Elsewhere: fp32."""
    device_type = getattr(device, "type", device)
    return device_type == "cuda" or (device_type == "cpu" and os.environ.get(CUDA_DTYPES_ENV) == "1")


def precision_line(device):
    """One line for a stage's log: the dtypes it trains and samples in on `device`."""
    if cuda_dtypes(device):
        how = "" if getattr(device, "type", device) == "cuda" else f" (CUDA's layout on the CPU: {CUDA_DTYPES_ENV}=1)"
        return f"precision: bf16 autocast over fp32 weights, bf16 embedding, bf16 engine copy and KV cache{how}"
    return f"precision: fp32 ({CUDA_DTYPES_ENV}=1 on a CPU with bf16 matrix units runs bf16 instead)"


def low_precision_dtype(device):
    """bf16 where cuda_dtypes(device), else fp32: the dtype of inference copies, KV caches and the bf16 embedding."""
    return torch.bfloat16 if cuda_dtypes(device) else torch.float32


class _Bf16MatmulsInFp32(TorchFunctionMode):
    """bf16 matmuls and attention on a CPU that has no bf16 matrix kernels: the inputs rounded to bf16, multiplied in
    fp32, the result rounded to bf16. That is a bf16 GEMM's value (exact bf16 products, an fp32 sum, as CUDA's) up to
    the order of the sum, and the rounding points of the backward pass are the same; torch's own bf16 GEMM on such a
    CPU (AVX2 without AVX512) runs ~50x slower than fp32 (1 GFLOP/s), which made CUDA's layout there unusable."""

    OPS = {
        F.linear,
        F.scaled_dot_product_attention,
        torch.matmul,
        torch.mm,
        torch.bmm,
        torch.Tensor.matmul,
        torch.Tensor.__matmul__,
        torch.Tensor.mm,
        torch.Tensor.bmm,
    }

    _active = threading.local()  # how many are entered in this thread (checkpoint's recomputation asks)

    def __enter__(self):
        self._active.depth = getattr(self._active, "depth", 0) + 1
        return super().__enter__()

    def __exit__(self, *exc):
        self._active.depth -= 1
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.OPS and self._bf16(args):
            with torch.autocast("cpu", enabled=False):
                out = func(*[self._up(a) for a in args], **{k: self._up(v) for k, v in kwargs.items()})
            return out.to(torch.bfloat16)
        return func(*args, **kwargs)

    @staticmethod
    def _bf16(args):
        x = [a for a in args[:2] if isinstance(a, torch.Tensor)]
        autocast = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        return (
            bool(x)
            and all(t.device.type == "cpu" and t.is_floating_point() for t in x)
            and (autocast or any(t.dtype == torch.bfloat16 for t in x))
        )

    @staticmethod
    def _up(a):  # what autocast or a bf16 kernel reads: the value in bf16, held in fp32
        return a.to(torch.bfloat16).float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a


def _emulates_bf16_matmuls():
    """Whether this process runs its CPU's bf16 matmuls through _Bf16MatmulsInFp32: CUDA's layout on a CPU without
    bf16 matrix kernels (no AVX512 / AMX)."""
    return cuda_dtypes("cpu") and not torch.ops.mkldnn._is_mkldnn_bf16_supported()


def bf16_matmuls(device):
    """A context for code that multiplies in bf16 on `device`: on a CPU in CUDA's layout without bf16 matrix kernels,
    those matmuls run in fp32 on bf16-rounded inputs (_Bf16MatmulsInFp32); elsewhere nothing."""
    if getattr(device, "type", device) == "cpu" and _emulates_bf16_matmuls():
        return _Bf16MatmulsInFp32()
    return nullcontext()


def recompute_like_forward():
    """A `context_fn` for torch's activation checkpointing: backward recomputes a block outside the contexts its
    forward ran in (autocast it restores itself), so it recomputes under bf16_matmuls exactly when the forward did;
    otherwise the recomputed tensors' dtypes would differ from the saved ones."""
    active = getattr(_Bf16MatmulsInFp32._active, "depth", 0) > 0
    return nullcontext(), (_Bf16MatmulsInFp32() if active else nullcontext())


def checkpoint_context_fn():
    """The `context_fn` for a model's activation checkpoints, picked once where they are set up: recompute_like_forward
    in a process whose bf16_matmuls can enter _Bf16MatmulsInFp32, else torch's default, which enters nothing (no
    such mode can be active then)."""
    return recompute_like_forward if _emulates_bf16_matmuls() else noop_context_fn


class _Contexts:
    """Several contexts entered as one, reusable (a stage enters its autocast context once per micro-step)."""

    def __init__(self, *contexts):
        self.contexts = contexts

    def __enter__(self):
        for c in self.contexts:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self.contexts):
            c.__exit__(*exc)


def autocast_ctx(device_type, dtype="bfloat16"):
    """bf16 autocast where cuda_dtypes (CUDA, or the CPU in CUDA's layout), with bf16_matmuls; elsewhere fp32, no
    autocast (bf16 is slow or flaky on CPU/MPS, and the tests want exact math)."""
    if dtype == "bfloat16" and cuda_dtypes(device_type):
        autocast = torch.amp.autocast(device_type=device_type, dtype=torch.bfloat16)
        return _Contexts(autocast, bf16_matmuls(device_type))
    return nullcontext()
