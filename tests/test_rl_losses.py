import itertools
import math

import pytest
import torch

from nanorl import rl

M = torch.ones(8, 3)


def test_grpo_and_dr_grpo_hand_values():
    r = torch.tensor([1., 0, 0, 1, 1, 1, 1, 0])
    # group 1: mean .5, unbiased std sqrt(1/3); group 2: mean .75, std .5
    s1, s2 = math.sqrt(1 / 3), 0.5
    want = [.5 / s1, -.5 / s1, -.5 / s1, .5 / s1, .25 / s2, .25 / s2, .25 / s2, -.75 / s2]
    adv = rl.grpo_advantages(r, M, 4, eps=0)
    assert torch.allclose(adv[:, 0], torch.tensor(want), atol=1e-5) and torch.equal(adv[:, 0], adv[:, 2])
    dr = rl.grpo_advantages(r, M, 4, std_normalize=False)
    assert torch.allclose(dr[:, 0], torch.tensor([.5, -.5, -.5, .5, .25, .25, .25, -.75]))
    mask = M.clone()
    mask[0, 2] = 0
    assert rl.grpo_advantages(r, mask, 4)[0, 2] == 0


def test_rloo_hand_values():
    r = torch.tensor([1., 0, 0, 1])
    # sample 0: baseline (0+0+1)/3
    assert torch.allclose(rl.rloo_advantages(r, torch.ones(4, 1), 4)[:, 0], torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))


def test_reinforce_pp_baseline_whitens_batch():
    r = torch.tensor([1., 0, 3, 1])
    mask = torch.tensor([[1., 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
    adv = rl.reinforce_pp_baseline_advantages(r, mask, 2)
    # centred: [.5, -.5, 1, -1] on every token; whitened over the 9 masked tokens
    vals = [.5, .5, -.5, -.5, -.5, 1, -1, -1, -1]
    mean = sum(vals) / 9
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / 8)
    assert torch.allclose(adv[0, 0], torch.tensor((.5 - mean) / std), atol=1e-5)
    assert adv[0, 2] == 0 and adv[2, 1] == 0


def test_discounted_returns_and_reinforce_pp():
    tr = torch.tensor([[0., 0, 1, 0]])
    mask = torch.tensor([[0., 1, 1, 1]])
    g = rl.discounted_returns(tr, mask, 0.9)
    assert torch.allclose(g, torch.tensor([[0, 0.9, 1.0, 0.0]]))
    # reward on the last masked token, kl penalty on every token, then whitening
    r = torch.tensor([1.0, 0.0])
    mask2 = torch.tensor([[1., 1, 0], [1, 1, 1]])
    kl = torch.full((2, 3), 0.1)
    adv = rl.reinforce_pp_returns(r, mask2, kl=kl, kl_coef=1.0, gamma=1.0)
    raw = [1 - .2, 1 - .1, -.3, -.2, -.1]  # returns-to-go per masked token
    mean = sum(raw) / 5
    std = math.sqrt(sum((x - mean) ** 2 for x in raw) / 4)
    assert torch.allclose(adv[mask2 > 0], torch.tensor([(x - mean) / std for x in raw]), atol=1e-5)


def test_gae_hand_values_with_left_padding():
    gamma, lam = 0.9, 0.8
    rewards = torch.tensor([[0., 0, 0, 1], [0, 0, 2, 0]])
    values = torch.tensor([[9., 0.5, 0.2, 0.4], [0.1, 0.3, 0.6, 9.0]])
    mask = torch.tensor([[0., 1, 1, 1], [1, 1, 1, 0]])
    adv, ret = rl.gae_advantages(rewards, values, mask, gamma, lam)

    def ref(rs, vs):  # plain loop over the valid positions only
        out, nxt_v, nxt_a = [], 0.0, 0.0
        for r, v in reversed(list(zip(rs, vs))):
            d = r + gamma * nxt_v - v
            nxt_a = d + gamma * lam * nxt_a
            nxt_v = v
            out.append(nxt_a)
        return out[::-1]
    assert torch.allclose(adv[0, 1:], torch.tensor(ref([0, 0, 1], [0.5, 0.2, 0.4])), atol=1e-6)
    assert torch.allclose(adv[1, :3], torch.tensor(ref([0, 0, 2], [0.1, 0.3, 0.6])), atol=1e-6)
    assert adv[0, 0] == 0 and adv[1, 3] == 0
    assert torch.allclose(ret, (adv + values) * mask)


@pytest.mark.parametrize("lp,ref", [(-1.0, -1.5), (-2.0, -0.5), (-0.3, -0.3)])
def test_kl_estimators(lp, ref):
    a, b = torch.tensor([lp]), torch.tensor([ref])
    d = lp - ref
    assert torch.allclose(rl.kl_estimate(a, b, "k1"), torch.tensor([d]))
    assert torch.allclose(rl.kl_estimate(a, b, "k2"), torch.tensor([0.5 * d * d]))
    k3 = math.exp(-d) + d - 1
    assert torch.allclose(rl.kl_estimate(a, b, "k3"), torch.tensor([k3]))
    assert rl.kl_estimate(a, b, "k3").item() >= 0
    assert torch.allclose(rl.kl_estimate(a, b, "low_var_kl"), torch.tensor([min(k3, 10)]))
    with pytest.raises(ValueError, match="k1"):
        rl.kl_estimate(a, b, "k9")


def test_policy_loss_on_policy_step():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    adv = torch.tensor([[1.0, -2.0, 0.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, m = rl.policy_loss(logp, logp.detach(), adv, mask)
    assert torch.allclose(loss, torch.tensor(-(1.0 - 2.0) / 2))
    assert m["ppo_kl"] == 0 and m["clipfrac"] == 0
    loss.backward()
    # d/dlogp of -A*exp(logp-old) at ratio 1 is -A / n_tokens
    assert torch.allclose(logp.grad, torch.tensor([[-0.5, 1.0, 0.0]]))


def test_clip_higher_and_dual_clip():
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.5, 1.5, 0.5, 5.0]]))
    adv = torch.tensor([[1.0, -1.0, -1.0, -1.0]])
    mask = torch.ones(1, 4)
    # eps 0.2 low, 0.28 high: token0 A>0 r=1.5 clipped to 1.28; token1 A<0 r=1.5 unclipped (max picks -A*r)
    loss, m = rl.policy_loss(logp, old, adv, mask, eps_clip=0.2, eps_clip_high=0.28, loss_agg="token_mean")
    want = [-1.28, 1.5, 0.8, 5.0]  # token2: A<0, r=.5 -> max(.5, .8)=.8 (clipped low)
    assert torch.allclose(loss, torch.tensor(sum(want) / 4))
    assert m["clipfrac"] == 0.5 and m["clipfrac_high"] == 0.25 and m["clipfrac_low"] == 0.25
    # dual clip caps A<0 tokens at -A*c = 3: token3 (5.0) -> 3
    loss_d, md = rl.policy_loss(logp, old, adv, mask, eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=3.0)
    assert torch.allclose(loss_d, torch.tensor((-1.28 + 1.5 + 0.8 + 3.0) / 4))
    assert md["dual_clip_frac"] == 0.25


def test_loss_aggregations_differ_on_uneven_masks():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert rl.aggregate_loss(x, mask, "token_mean") == (1 + 2 + 3 + 4) / 4
    assert rl.aggregate_loss(x, mask, "seq_mean_token_mean") == (2.0 + 4.0) / 2
    assert rl.aggregate_loss(x, mask, "seq_mean_token_sum_norm", max_len=10) == (0.6 + 0.4) / 2
    with pytest.raises(ValueError, match="max_len"):
        rl.aggregate_loss(x, mask, "seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="token_mean"):
        rl.aggregate_loss(x, mask, "nope")


def test_value_loss_clipping():
    v, old, ret = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 0.0]]), torch.tensor([[2.0, 1.0]])
    loss, m = rl.value_loss(v, old, ret, torch.ones(1, 2), value_clip=0.5)
    # token0: unclipped (1-2)^2=1, clipped (0.5-2)^2=2.25 -> 2.25; token1: 1 and 1 -> 1
    assert torch.allclose(loss, torch.tensor(0.5 * (2.25 + 1) / 2))
    assert m["vf_clipfrac"] == 0.5


def test_overlong_penalty():
    lens = torch.tensor([10, 80, 90, 100, 120])
    pen = rl.overlong_penalty(lens, 100, 20, 1.0)
    assert torch.allclose(pen, torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0]))


@pytest.mark.parametrize("n,c,k", [(5, 2, 1), (5, 2, 3), (6, 0, 2), (4, 4, 2), (7, 3, 7)])
def test_pass_at_k_matches_enumeration(n, c, k):
    outcomes = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    brute = sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)
    assert abs(rl.pass_at_k(n, c, k) - brute) < 1e-12


def test_masked_whiten():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    w = rl.masked_whiten(x, mask)
    vals = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    assert torch.allclose(w[mask > 0], (vals - 3) / vals.std(), atol=1e-5)
    assert w[0, 2] == 0
