"""The engine's sampling math (nanorl/decode.py): hand-computed draws, the inverse CDF, the counter hash."""

import math

import numpy as np
import torch

from nanorl.decode import SamplerSettings, row_seed, sample_tokens, sample_with_logprobs, uniform_from_counter


def test_top_k_top_p_and_temperature_by_hand():
    # vocab of 4 with probabilities 0.1, 0.4, 0.3, 0.2 at T = 1: sorted order is tokens 1, 2, 3, 0
    logits = torch.tensor([[math.log(p) for p in (0.1, 0.4, 0.3, 0.2)]]).expand(10, 4)
    V = 4
    # (temperature, top_k, top_p, uniform) -> the token inverse-CDF sampling must pick, worked out by hand
    rows = [
        (1.0, V, 1.0, 0.05, 0),  # no filter: vocab order, cdf 0.1 0.5 0.8 1.0
        (1.0, V, 1.0, 0.55, 2),
        (1.0, 2, 1.0, 0.50, 1),  # top-2 keeps 1, 2 renormalised to 4/7, 3/7: cdf 0.571 1.0
        (1.0, 2, 1.0, 0.60, 2),
        (1.0, V, 0.75, 0.70, 2),  # top-p 0.75 keeps 1, 2, 3 (mass before each: 0, 0.4, 0.7): cdf 0.444 0.778 1.0
        (1.0, V, 0.75, 0.80, 3),
        (1.0, V, 0.65, 0.60, 2),  # top-p 0.65 drops token 3 (0.7 before it): 1, 2 as top-2
        (0.5, V, 1.0, 0.30, 1),  # T = 0.5 squares then renormalises: 1/30, 16/30, 9/30, 4/30: cdf 0.033 0.567 0.867
        (0.5, V, 1.0, 0.57, 2),
        (0.0, V, 1.0, 0.99, 1),  # greedy: the argmax whatever the uniform
    ]
    T, k, p, u, want = (torch.tensor(c) for c in zip(*rows))
    got = sample_tokens(logits, SamplerSettings(T.float(), k.long(), p.float()), u.double())
    assert got.tolist() == want.tolist()
    # the recorded log-prob is log_softmax(logits / T) of the token, before top-k/top-p (T = 1 when greedy)
    tok, lp = sample_with_logprobs(logits, SamplerSettings(T.float(), k.long(), p.float()), u.double())
    assert tok.tolist() == want.tolist()
    probs = {1.0: [0.1, 0.4, 0.3, 0.2], 0.5: [1 / 30, 16 / 30, 9 / 30, 4 / 30], 0.0: [0.1, 0.4, 0.3, 0.2]}
    expect = [math.log(probs[t][w]) for t, w in zip(T.tolist(), want.tolist())]
    torch.testing.assert_close(lp, torch.tensor(expect), atol=1e-6, rtol=0)
    # forced tokens replace the draw and get their own log-prob
    forced = torch.tensor([3] + [-1] * 9)
    tok, lp = sample_with_logprobs(logits, SamplerSettings(T.float(), k.long(), p.float()), u.double(), forced=forced)
    assert tok.tolist() == [3] + want.tolist()[1:] and abs(lp[0].item() - math.log(0.2)) < 1e-6


def test_sampling_is_exact_inverse_cdf():
    torch.manual_seed(0)
    logits = torch.randn(1, 50) * 2
    N = 20000
    u = (torch.arange(N, dtype=torch.float64) + 0.5) / N  # a uniform grid: counts follow the probabilities exactly
    L = logits.expand(N, 50)

    def freq(temperature=1.0, top_k=50, top_p=1.0, filtered=True):
        settings = SamplerSettings(torch.full((N,), temperature), torch.full((N,), top_k), torch.full((N,), top_p))
        t = sample_tokens(L, settings, u, filtered)
        return torch.bincount(t, minlength=50).double() / N

    p = torch.softmax(logits[0] / 0.7, -1).double()
    assert (freq(0.7, filtered=False) - p).abs().max() < 2 / N
    assert (freq(0.7) - p).abs().max() < 2 / N
    top = p.argsort(descending=True)
    pk = torch.zeros(50, dtype=torch.float64)
    pk[top[:5]] = p[top[:5]] / p[top[:5]].sum()
    assert (freq(0.7, top_k=5) - pk).abs().max() < 2 / N
    n_keep = int((p[top].cumsum(0) < 0.6).sum()) + 1  # the smallest top set holding 60% of the mass
    pp = torch.zeros(50, dtype=torch.float64)
    pp[top[:n_keep]] = p[top[:n_keep]] / p[top[:n_keep]].sum()
    assert (freq(0.7, top_p=0.6) - pp).abs().max() < 2 / N
    assert freq(0.0)[logits[0].argmax()] == 1.0 and freq(1.0, top_k=1)[logits[0].argmax()] == 1.0


def test_counter_hash_matches_splitmix64():
    M = (1 << 64) - 1

    def splitmix(seed, c):  # output c + 1 of splitmix64 seeded `seed`: the state advances, then mixes
        x = (seed + (c + 1) * 0x9E3779B97F4A7C15) & M
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M
        return ((x ^ (x >> 31)) >> 11) / 2**53

    seeds, counters = [0] + [(i * 0x9E3779B97F4A7C15) & M for i in range(1, 7)], [0, 0, 1, 2, 1000, 2**40, 7]
    u = uniform_from_counter(np.array(seeds, dtype=np.uint64).view(np.int64), np.array(counters))
    assert u.tolist() == [splitmix(s, c) for s, c in zip(seeds, counters)]
    assert u[0] > 0.01  # seed 0's first uniform is not 0 (it was: its first token was token id 0, a NUL byte)


def test_row_seed_is_splitmix64s_finalizer_twice():
    # sample i of a request seeded s draws from mix(mix(s) + i) (mod 2^64), held as a signed int64; any int seeds it
    M = (1 << 64) - 1

    def mix(x):
        x &= M
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M
        return x ^ (x >> 31)

    for seed, i in [(0, 0), (0, 1), (7, 3), (-1, 0), (2**63, 5), (2**70 + 9, 2), (123456789, 1000)]:
        x = mix(mix(seed) + i)
        assert row_seed(seed, i) == (x - (1 << 64) if x >> 63 else x)


def test_a_request_seeded_0_does_not_start_with_token_0():
    """chat_eval seeds problem i with i: the first sample of problem 0 (the engine's row_seed(0, 0), counter 0) drew
    u = 0, so token id 0 (the NUL byte) whatever its probability, and its "example response" began with '\\x00'.
    Now that token is drawn as any other: with token 0 at e^-20 of the others, it is not drawn."""
    assert row_seed(0, 0) == 0  # why seed 0 was the one: splitmix64's finalizer maps 0 to 0
    logits = torch.zeros(1, 300)
    logits[0, 0] = -20.0
    u = torch.from_numpy(uniform_from_counter(np.array([row_seed(0, 0)]), np.array([0])))
    assert sample_tokens(logits, SamplerSettings(torch.ones(1), torch.tensor([300]), torch.ones(1)), u).item() != 0


def test_the_engine_shortcuts_change_nothing():
    # greedy=False (no row at T = 0) skips an argmax, unit=True (every row at T = 1 or 0) skips a division:
    # both promise what holds, and then the tokens and log-probs are exactly those of the general path
    torch.manual_seed(0)
    # rows far from 0 (+-60): unit=True hands the raw logits to softmax and log_softmax, which shift them themselves
    logits, u = torch.randn(6, 300) * 3 + 60 * torch.randn(6, 1), torch.rand(6, dtype=torch.float64)
    k, p = torch.tensor([300, 5, 300, 300, 40, 300]), torch.tensor([1.0, 1.0, 0.9, 1.0, 0.5, 1.0])
    for T, greedy, unit in [
        (torch.ones(6), False, True),
        (torch.tensor([1.0, 0, 1, 0, 1, 1]), True, True),
        (torch.tensor([0.7, 1.3, 0.7, 1, 1, 0.2]), False, False),
    ]:
        for filtered in (True, False):
            want = sample_with_logprobs(logits, SamplerSettings(T, k, p), u, filtered)
            got = sample_with_logprobs(logits, SamplerSettings(T, k, p), u, filtered, greedy=greedy, unit=unit)
            assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    # uniform=None (every row greedy) is the argmax, with the log-prob the general path gives it
    zero = torch.zeros(6)
    for filtered in (True, False):
        want = sample_with_logprobs(logits, SamplerSettings(zero, k, p), u, filtered)
        got = sample_with_logprobs(logits, SamplerSettings(zero, k, p), None, filtered, unit=True)
        assert torch.equal(want[0], got[0]) and torch.equal(got[0], logits.argmax(-1))
        assert torch.equal(want[1], got[1])


def test_a_cpu_sampling_step_at_t1_runs_only_the_ops_it_needs():
    # the engine's common step (T = 1, no top-k/top-p, on CPU): softmax and log_softmax subtract the row max
    # themselves (no amax and subtraction first), CPU's in-order cumsum needs no "landed on a zero" check (no
    # gather, compare and host read), and a float32 uniform clamped below 1 needs no nextafter/minimum
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    logits, one = torch.randn(2, 300) * 3 + 40, torch.ones(2)
    u = torch.tensor([0.3, 1 - 2.0**-60], dtype=torch.float64)  # the second rounds to 1.0 in float32
    with Ops() as ops:
        tok, lp = sample_with_logprobs(
            logits, SamplerSettings(one, torch.full((2,), 300), one), u, False, greedy=False, unit=True
        )
    assert not {"amax", "sub", "nextafter", "minimum", "all", "gt"} & set(ops.names), ops.names
    assert ops.names.count("gather") == 1, ops.names  # the log-prob's only
    cdf = torch.softmax(logits, -1).cumsum(-1)
    assert tok[1] == 299 and tok[0] == int((cdf[0] <= float(np.float32(0.3)) * cdf[0, -1]).sum())
    assert torch.equal(lp, torch.log_softmax(logits - logits.amax(-1, keepdim=True), -1).gather(1, tok[:, None])[:, 0])
