"""
The engine's sampling math: pure functions of logits and per-row settings, no engine state.

- counter-based randomness: token t of a sample gets uniform_from_counter(row seed, t), a splitmix64 hash
  (computed on the host, a few numpy ops a step), so a sample never depends on what else shares its batch and no
  generator object is stepped per request
- tempered(): (logits - max) / T, the distribution the engine samples from and records log-probs of (the
  logits as they are at T = 1: softmax and log_softmax shift them themselves)
- sample_tokens(): one token per row by inverse-CDF sampling, with per-row temperature, top-k and top-p
- sample_with_logprobs(): the engine's step: sampled tokens and their log_softmax(tempered) log-probs
"""

import numpy as np
import torch

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


def tempered(logits, temperature, unit=False):
    """(logits - row max) / T per row (T = 1 where T = 0, greedy): the log-probs the engine records are
    log_softmax of this. Subtracting the max first keeps it total for any T > 0: at T = 1e-40 the top
    token gets 0 and the rest -inf, where logits / T would overflow to inf - inf = NaN. unit=True promises
    every row's T is 1 (or 0): then the logits come back as they are, since softmax and log_softmax subtract the
    row max themselves, first and alone (on CPU and CUDA), so they give the same bits on raw logits as on shifted
    ones, without the two extra passes over the vocab."""
    if unit:
        return logits
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    return (logits - logits.amax(dim=-1, keepdim=True)) / t[:, None]


def sample_tokens(logits, temperature, top_k, top_p, uniform, filtered=True):
    """
    One token per row of fp32 logits (B, V) by inverse-CDF sampling with one uniform per row.
    temperature (B,) (0 = greedy), top_k (B,) long (V = off), top_p (B,) (1 = off); filtered=False skips
    the sort when no row uses top-k/top-p. Total: whatever the values, the most likely token stays a candidate.
    """
    x = tempered(logits, temperature)
    return _sample(logits, x, temperature, top_k, top_p, uniform, filtered, greedy=True)


def sample_with_logprobs(
    logits, temperature, top_k, top_p, uniform, filtered=True, greedy=True, forced=None, unit=False
):
    """sample_tokens(), then each row's token replaced by forced[row] where that is >= 0 (tool output), and the
    log-prob of every token under the distribution sampled from: log_softmax(tempered), before top-k/top-p (the
    trainer cannot apply those filters). greedy=False promises no row has temperature 0 (skips an argmax),
    unit=True that every row's is 1 or 0 (skips a division), uniform=None that every row is greedy (the argmax
    alone: no softmax, cumsum or search, as an all-greedy eval needs). -> (tokens (B,) long, log-probs (B,) fp32)."""
    x = tempered(logits, temperature, unit)
    if uniform is None:
        tok = logits.argmax(-1)
    else:
        tok = _sample(logits, x, temperature, top_k, top_p, uniform, filtered, greedy)
    if forced is not None:
        tok = torch.where(forced >= 0, forced, tok)
    return tok, torch.log_softmax(x, dim=-1).gather(1, tok[:, None])[:, 0]


def _sample(logits, x, temperature, top_k, top_p, uniform, filtered, greedy):
    V = logits.size(-1)
    order = None
    if filtered:
        # only the rows that filter are sorted: a row's token must not depend on whether a filtering request
        # shares its batch (inverse-CDF sampling in sorted order picks another token for the same uniform)
        rank = torch.arange(V, device=logits.device).expand_as(x)
        sorts = ((top_k < V) | (top_p < 1))[:, None]
        x_sorted, order_sorted = x.sort(dim=-1, descending=True)
        x, order = torch.where(sorts, x_sorted, x), torch.where(sorts, order_sorted, rank)
    probs = torch.softmax(x, dim=-1)
    if filtered:
        # top-k and top-p both keep a prefix of the sorted tokens; rank 0 is kept whatever top_p is (a top_p of
        # 1e-50 is 0 in float32, and "mass before it < 0" would keep nothing)
        keep = (rank < top_k[:, None]) & (probs.cumsum(-1) - probs < top_p[:, None])
        probs = probs * (keep | (rank == 0) | ~sorts)
    cdf = probs.cumsum(-1)
    # u < total strictly (a float32 u below 1 times total rounds below it; a float64 u near 1 rounds to 1.0 in
    # float32), so the search lands before the end, on a token whose own probability is > 0
    u = uniform.float().clamp(max=_BELOW_ONE)[:, None] * cdf[:, -1:]
    idx = torch.searchsorted(cdf, u, right=True)
    # a parallel cumsum (CUDA) is not exactly monotone; in the rare case that lands on a removed token, take the
    # top one (the check reads one bool per step on the host: cheaper than an argmax over the vocab every step).
    # CPU's cumsum adds each row in order in float64, so its cdf is monotone: cdf[i] > u >= cdf[i - 1] means p[i] > 0
    if probs.is_cuda:
        landed = probs.gather(1, idx) > 0
        if not bool(landed.all()):
            idx = torch.where(landed, idx, probs.argmax(-1, keepdim=True))
    if order is not None:
        idx = order.gather(1, idx)
    if not greedy:
        return idx[:, 0]
    return torch.where(temperature > 0, idx[:, 0], logits.argmax(-1))
