"""
Tolerances for comparing floats computed two ways, in units of the dtype's rounding step at the magnitude compared.

Two code paths that compute the same value with different kernels (SDPA against a GEMM and a softmax, a fused
projection against three, a batch of 8 against a batch of 1) sum in different orders, and which way the last bit of a
sum falls depends on the CPU's kernels (AVX-512 against AVX2, MKL's code path, the thread count). Each rounding is
at most half a step (`eps`) relative to the value, so the difference grows with the magnitude compared: a fixed
`atol=1e-5` is ~1 step at a logit of 64 and ~100 at a logit of 0.6. `ulps(want, n)` is n steps at the largest value
compared: the tolerance says how many roundings apart the two paths may drift, whatever the CPU.
"""

import torch


def ulps(want, n, dtype=None):
    """n rounding steps of `dtype` (want's by default) at want's largest magnitude: an absolute tolerance."""
    want = torch.as_tensor(want)
    return n * torch.finfo(dtype or want.dtype).eps * max(want.abs().max().item(), 1.0)


def assert_close_ulps(got, want, n, dtype=None):
    """got equals want to within n rounding steps at want's largest magnitude (and not below one step at 1.0)."""
    got, want = torch.as_tensor(got), torch.as_tensor(want)
    torch.testing.assert_close(got, want, atol=ulps(want, n, dtype), rtol=0)
