"""
nanorl.rl against hand-computed numbers on tiny tensors. Expected values are written out
literally (derivation in the comment) or come from plain-python loops in this file,
never from the function under test.
"""

import dataclasses
import itertools
import math
import statistics

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanorl import rl


def close(actual, expected, tol=1e-5):
    actual = torch.as_tensor(actual, dtype=torch.float64)
    expected = torch.as_tensor(expected, dtype=torch.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.allclose(actual, expected, atol=tol, rtol=0), f"\n{actual}\n!=\n{expected}"


def whiten_py(values):
    """plain-python whitening with the unbiased (n-1) std"""
    mean, std = statistics.fmean(values), statistics.stdev(values)
    return [(v - mean) / math.sqrt(std**2 + 1e-8) for v in values]


def t(x):
    return torch.tensor(x, dtype=torch.float32)


# -----------------------------------------------------------------------------
# masked reductions


def test_masked_sum_mean():
    x = t([[1.0, 2.0, float("nan")], [4.0, float("inf"), 6.0]])
    m = t([[1, 1, 0], [1, 0, 1]])
    close(rl.masked_sum(x, m), 13.0)  # 1 + 2 + 4 + 6, nan/inf ignored
    close(rl.masked_mean(x, m), 13.0 / 4)
    close(rl.masked_sum(x, m, dim=-1), [3.0, 10.0])
    close(rl.masked_mean(x, m, dim=-1), [1.5, 5.0])
    close(rl.masked_mean(x, torch.zeros(2, 3)), 0.0)  # empty mask: 0, not nan


def test_masked_whiten():
    x = t([[1.0, 2.0, 99.0], [3.0, 99.0, 6.0]])
    m = t([[1, 1, 0], [1, 0, 1]])
    # values 1, 2, 3, 6: mean 3, unbiased var (4 + 1 + 0 + 9) / 3 = 14/3
    s = math.sqrt(14 / 3 + 1e-8)
    close(rl.masked_whiten(x, m), [[-2 / s, -1 / s, 0.0], [0.0, 0.0, 3 / s]])
    close(rl.masked_whiten(x, m, shift_mean=False), [[-2 / s + 3, -1 / s + 3, 0.0], [3.0, 0.0, 3 / s + 3]])
    # distributed=True without an initialized process group is the local whitening
    close(rl.masked_whiten(x, m, distributed=True), rl.masked_whiten(x, m))


def _whiten_worker(rank, world_size, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        x, m = _whiten_data()
        rows = slice(0, 3) if rank == 0 else slice(3, 5)  # uneven split: 3 rows and 2 rows
        out = rl.masked_whiten(x[rows], m[rows], distributed=True)
        torch.save(out, f"{out_dir}/whiten{rank}.pt")
    finally:
        dist.destroy_process_group()


def _whiten_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 6, generator=g) * 3 + 1
    m = (torch.rand(5, 6, generator=g) > 0.3).float()
    m[4] = 0.0
    m[4, 2] = 1.0  # rank 1 holds very few tokens: its local statistics would be far off
    return x, m


def test_masked_whiten_distributed_equals_concatenated(tmp_path):
    # torch.multiprocessing's spawn API; fork (where available) skips re-importing torch in the
    # children: ~0.1 s instead of ~7 s on a 2-core box. The children only touch CPU tensors.
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    mp.start_processes(
        _whiten_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True, start_method=method
    )
    got = torch.cat([torch.load(tmp_path / "whiten0.pt"), torch.load(tmp_path / "whiten1.pt")])
    x, m = _whiten_data()
    # independent reference: plain-python whitening of the masked values of the whole batch
    idx = [(i, j) for i in range(5) for j in range(6) if m[i, j] == 1]
    w = whiten_py([x[i, j].item() for i, j in idx])
    expected = torch.zeros(5, 6)
    for (i, j), v in zip(idx, w):
        expected[i, j] = v
    close(got, expected)
    close(got, rl.masked_whiten(x, m))
    assert not torch.allclose(got[3:], rl.masked_whiten(x[3:], m[3:]))  # the all-reduce mattered


# -----------------------------------------------------------------------------
# advantages

MASK8 = t([[1, 1, 0]] * 4 + [[0, 1, 1]] * 4)  # left padding in the second group


def test_grpo_advantages():
    rewards = t([1, 0, 0, 1, 1, 1, 1, 0])
    adv = rl.grpo_advantages(rewards, MASK8, group_size=4)
    # group 1: mean .5, unbiased std sqrt((4 * .25) / 3) = sqrt(1/3)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    # group 2: mean .75, unbiased std sqrt((3 * .0625 + .5625) / 3) = .5
    b, c = 0.25 / (0.5 + 1e-6), -0.75 / (0.5 + 1e-6)
    seq = [a, -a, -a, a, b, b, b, c]
    close(adv, [[v * mk for mk in row] for v, row in zip(seq, MASK8.tolist())])
    close(adv[:4, 0], [0.866025, -0.866025, -0.866025, 0.866025])
    close(adv[4:, 1], [0.5, 0.5, 0.5, -1.5])
    assert not adv.requires_grad


def test_dr_grpo_advantages():
    rewards = t([1, 0, 0, 1, 1, 1, 1, 0])
    adv = rl.grpo_advantages(rewards, MASK8, group_size=4, std_normalize=False)
    seq = [0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75]
    close(adv, [[v * mk for mk in row] for v, row in zip(seq, MASK8.tolist())])


def test_rloo_advantages():
    rewards = t([1, 0, 0, 1, 1, 1, 1, 0])
    adv = rl.rloo_advantages(rewards, MASK8, group_size=4)
    # 1 - mean(0, 0, 1) = 2/3; 0 - mean(1, 0, 1) = -2/3; 1 - mean(1, 1, 0) = 1/3; 0 - 1 = -1
    seq = [2 / 3, -2 / 3, -2 / 3, 2 / 3, 1 / 3, 1 / 3, 1 / 3, -1.0]
    close(adv, [[v * mk for mk in row] for v, row in zip(seq, MASK8.tolist())])


def test_group_size_errors():
    with pytest.raises(ValueError):
        rl.grpo_advantages(t([1, 0, 1]), torch.ones(3, 2), group_size=2)
    with pytest.raises(ValueError):
        rl.rloo_advantages(t([1, 0]), torch.ones(2, 2), group_size=1)


def test_reinforce_pp_baseline_no_kl():
    rewards = t([1, 0, 1, 1])  # groups of 2 -> centered .5, -.5, 0, 0
    mask = t([[1, 1], [1, 1], [1, 0], [0, 1]])
    adv = rl.reinforce_pp_baseline_advantages(rewards, mask, group_size=2)
    # token values .5 .5 -.5 -.5 0 0: mean 0, unbiased var 1/5
    a = 0.5 / math.sqrt(0.2 + 1e-8)
    close(adv, [[a, a], [-a, -a], [0, 0], [0, 0]])
    close(a, 1.118034)


def test_reinforce_pp_baseline_with_kl():
    rewards = t([1, 0])
    mask = t([[1, 1, 1], [0, 1, 1]])
    kl = t([[0.1, 0.2, 0.3], [9.0, 0.4, 0.5]])  # the 9 sits on the prompt and must be ignored
    adv = rl.reinforce_pp_baseline_advantages(rewards, mask, 2, kl=kl, kl_coef=0.5)
    # centered .5 / -.5; token rewards -.5*kl: row0 -.05 -.1 -.15 -> to-go -.3 -.25 -.15
    # row1 (prompt) -.2 -.25 -> to-go -.45 -.25
    pre = [0.5 - 0.3, 0.5 - 0.25, 0.5 - 0.15, -0.5 - 0.45, -0.5 - 0.25]
    w = whiten_py(pre)
    close(adv, [[w[0], w[1], w[2]], [0.0, w[3], w[4]]])


def test_discounted_returns_and_reinforce_pp_returns():
    rewards = t([1.0, 2.0])
    mask = t([[1, 1, 1, 0], [0, 1, 0, 1]])  # row 1: prompt, response, tool-output hole, response
    # row 0: reward on token 2 -> .81 .9 1 ; row 1: reward on token 3, the hole is skipped -> 1.8 . 2
    token_r = t([[0, 0, 1, 0], [0, 0, 0, 2]])
    close(rl.discounted_returns(token_r, mask, gamma=0.9), [[0.81, 0.9, 1.0, 0.0], [0.0, 1.8, 0.0, 2.0]])
    adv = rl.reinforce_pp_returns(rewards, mask, gamma=0.9)
    w = whiten_py([0.81, 0.9, 1.0, 1.8, 2.0])
    close(adv, [[w[0], w[1], w[2], 0.0], [0.0, w[3], 0.0, w[4]]])
    # with a per-token KL penalty (gamma .9, coef .5): row 0 rewards -.05 -.1 (1 - .15) ; row 1 -.1 . (2 - .2)
    kl = t([[0.1, 0.2, 0.3, 7.0], [7.0, 0.2, 7.0, 0.4]])
    r0 = [None, None, 0.85]
    r0[1] = -0.1 + 0.9 * 0.85
    r0[0] = -0.05 + 0.9 * r0[1]
    r1 = [1.8]
    r1.insert(0, -0.1 + 0.9 * 1.8)
    adv = rl.reinforce_pp_returns(rewards, mask, kl=kl, kl_coef=0.5, gamma=0.9)
    w = whiten_py(r0 + r1)
    close(adv, [[w[0], w[1], w[2], 0.0], [0.0, w[3], 0.0, w[4]]])


def test_gae_left_padding():
    gamma, lam = 0.9, 0.8
    mask = t([[0, 1, 1, 1], [0, 1, 1, 0]])
    values = t([[5.0, 1.0, 2.0, 3.0], [7.0, 0.5, 1.5, 9.0]])
    rewards = t([[4.0, 0.0, 0.0, 1.0], [3.0, 0.0, 2.0, 5.0]])  # rewards off the mask are ignored
    adv, ret = rl.gae_advantages(rewards, values, mask, gamma, lam)
    # row 0: t3: 1 - 3 = -2 ; t2: delta .7, A = .7 + .72 * -2 = -.74 ; t1: delta .8, A = .8 + .72 * -.74 = .2672
    # row 1: t2: 2 - 1.5 = .5 ; t1: delta .9*1.5 - .5 = .85, A = .85 + .72 * .5 = 1.21
    close(adv, [[0.0, 0.2672, -0.74, -2.0], [0.0, 1.21, 0.5, 0.0]])
    close(ret, [[0.0, 1.2672, 1.26, 1.0], [0.0, 1.71, 2.0, 0.0]])
    # lam = 1 gives the Monte-Carlo return minus V; lam = 0 gives the one-step TD error
    adv1, ret1 = rl.gae_advantages(rewards, values, mask, 0.9, 1.0)
    close(ret1[0], [0.0, 0.81, 0.9, 1.0])
    adv0, _ = rl.gae_advantages(rewards, values, mask, 0.9, 0.0)
    close(adv0[1], [0.0, 0.85, 0.5, 0.0])


# -----------------------------------------------------------------------------
# KL estimators


def test_kl_estimators():
    logp, ref = t([0.0, -1.0, -2.0]), t([-1.0, 0.0, -2.0])
    close(rl.kl_estimate(logp, ref, "k1"), [1.0, -1.0, 0.0])
    close(rl.kl_estimate(logp, ref, "k2"), [0.5, 0.5, 0.0])
    # d = ref - logp = -1, 1, 0: e^-1 + 1 - 1, e - 1 - 1, 0
    close(rl.kl_estimate(logp, ref, "k3"), [math.exp(-1), math.e - 2, 0.0])
    close(rl.kl_estimate(logp, ref, "low_var_kl"), [0.367879, 0.718282, 0.0])
    # far apart: d = 30 -> k3 = e^30 - 31, low_var_kl clamps at 10
    close(rl.kl_estimate(t([-30.0]), t([0.0]), "low_var_kl"), [10.0])
    assert rl.kl_estimate(t([-30.0]), t([0.0]), "k3").item() > 1e12
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(1000, generator=g) * 3, torch.randn(1000, generator=g) * 3
    assert (rl.kl_estimate(a, b, "k3") >= 0).all() and (rl.kl_estimate(a, b, "k2") >= 0).all()
    with pytest.raises(ValueError):
        rl.kl_estimate(a, b, "k4")


def test_k3_is_unbiased_kl():
    # KL(p || q) for two categoricals, estimated by k1 and k3 on exact expectations over p
    p, q = t([0.7, 0.2, 0.1]), t([0.3, 0.3, 0.4])
    kl = sum(pi * math.log(pi / qi) for pi, qi in zip(p.tolist(), q.tolist()))
    for kind in ("k1", "k3"):
        close((p * rl.kl_estimate(p.log(), q.log(), kind)).sum(), kl)


# -----------------------------------------------------------------------------
# losses


def test_aggregate_loss_modes():
    x = t([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 30.0, 40.0]])
    m = t([[1, 1, 1, 0], [1, 0, 0, 0]])
    close(rl.aggregate_loss(x, m, "token_mean"), (1 + 2 + 3 + 10) / 4)  # 4
    close(rl.aggregate_loss(x, m, "seq_mean_token_mean"), (6 / 3 + 10 / 1) / 2)  # 6
    close(rl.aggregate_loss(x, m, "seq_mean_token_sum_norm", max_len=4), (6 / 4 + 10 / 4) / 2)  # 2
    with pytest.raises(ValueError, match="max_len"):
        rl.aggregate_loss(x, m, "seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="token_mean"):
        rl.aggregate_loss(x, m, "seq_sum")


def test_policy_loss_on_policy():
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(2, 4, generator=g) * 3).requires_grad_()
    A = torch.randn(2, 4, generator=g)
    m = t([[1, 1, 1, 0], [0, 1, 1, 1]])
    loss, met = rl.policy_loss(logp, logp.detach(), A, m)
    expected = -sum(A[i, j].item() for i in range(2) for j in range(4) if m[i, j]) / 6
    close(loss, expected)
    assert float(met["ppo_kl"]) == 0.0 and float(met["clipfrac"]) == 0.0 and float(met["dual_clip_frac"]) == 0.0
    loss.backward()  # ratio 1: the gradient is the policy gradient -A / N
    close(logp.grad, -A * m / 6)


def test_policy_loss_clip_higher():
    # tokens: (ratio, A) = (1.25, +1) (1.5, +1) (.7, -1) (.7, +1) (1.5, -1), eps .2 low / .28 high
    ratio = t([[1.25, 1.5, 0.7, 0.7, 1.5]])
    A = t([[1.0, 1.0, -1.0, 1.0, -1.0]])
    logp = ratio.log().requires_grad_()
    m = torch.ones(1, 5)
    loss, met = rl.policy_loss(logp, torch.zeros(1, 5), A, m, rl.LossConfig(eps_clip=0.2, eps_clip_high=0.28))
    # per token: -1.25 (inside), -1.28 (clipped high), .8 (clipped low), -.7, 1.5 (A<0, ratio up: not clipped)
    close(loss, (-1.25 - 1.28 + 0.8 - 0.7 + 1.5) / 5)
    close([float(met["clipfrac"]), float(met["clipfrac_low"]), float(met["clipfrac_high"])], [0.4, 0.2, 0.2])
    close(met["ppo_kl"], -sum(math.log(r) for r in [1.25, 1.5, 0.7, 0.7, 1.5]) / 5)
    loss.backward()  # d(-A r)/dlogp = -A r on unclipped tokens, 0 on clipped ones
    close(logp.grad, [[-1.25 / 5, 0.0, 0.0, -0.7 / 5, 1.5 / 5]])
    # symmetric .2 clips the first token too: -1.2 instead of -1.25
    loss, met = rl.policy_loss(ratio.log(), torch.zeros(1, 5), A, m, rl.LossConfig(eps_clip=0.2))
    close(loss, (-1.2 - 1.2 + 0.8 - 0.7 + 1.5) / 5)
    close(met["clipfrac_high"], 0.4)


def test_policy_loss_dual_clip_and_tis():
    ratio, A = t([[5.0, 2.0, 5.0]]), t([[-1.0, -1.0, 1.0]])
    m = torch.ones(1, 3)
    loss, met = rl.policy_loss(ratio.log(), torch.zeros(1, 3), A, m, rl.LossConfig(eps_clip=0.2, eps_clip_c=3.0))
    # A<0, r=5: max(5, 1.2) = 5 -> min(5, 3) = 3 ; A<0, r=2: 2 < 3 stays ; A>0, r=5: max(-5, -1.2) = -1.2
    close(loss, (3.0 + 2.0 - 1.2) / 3)
    close(met["dual_clip_frac"], 1 / 3)
    loss, _ = rl.policy_loss(ratio.log(), torch.zeros(1, 3), A, m, rl.LossConfig(eps_clip=0.2))
    close(loss, (5.0 + 2.0 - 1.2) / 3)
    with pytest.raises(ValueError):
        rl.policy_loss(ratio.log(), torch.zeros(1, 3), A, m, rl.LossConfig(eps_clip_c=0.5))
    # tis weights scale the per-token loss: on-policy, A = 1, 2, weights exp(old - rollout) = .5, 2 -> (-.5 - 4) / 2,
    # and they carry no gradient
    lp = torch.zeros(1, 2, requires_grad=True)
    rollout = t([[math.log(2.0), -math.log(2.0)]])
    cfg = rl.LossConfig(use_tis=True, tis_clip=3.0)
    loss, met = rl.policy_loss(lp, torch.zeros(1, 2), t([[1.0, 2.0]]), torch.ones(1, 2), cfg, rollout)
    close(loss, -2.25)
    close(met["tis_mean"], 1.25)
    with pytest.raises(ValueError, match="rollout_logp"):  # TIS on, but no sampler log-probs to weigh by
        rl.policy_loss(lp, torch.zeros(1, 2), t([[1.0, 2.0]]), torch.ones(1, 2), cfg)
    loss.backward()
    close(lp.grad, [[-0.25, -2.0]])


def test_loss_config_refuses_an_unknown_policy_loss():
    with pytest.raises(ValueError, match="unknown policy loss 'ppo'.*ppo_clip, gspo, cispo"):
        rl.LossConfig(kind="ppo")


def test_policy_loss_aggregations_differ():
    lp = torch.zeros(2, 3)
    A = t([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]])
    m = t([[1, 1, 1], [1, 0, 0]])
    losses = [rl.policy_loss(lp, lp, A, m, rl.LossConfig(loss_agg=agg, max_len=3))[0].item() for agg in rl.LOSS_AGGS]
    # token mean: -(1+1+1+4)/4 ; seq mean: -(1 + 4)/2 ; sum norm: -(3/3 + 4/3)/2
    close(losses, [-7 / 4, -5 / 2, -7 / 6])


def test_gspo_loss():
    old = t([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    lr = t([[0.1, -0.05, 0.1], [-0.5, -0.3, 0.9]])  # 0.9 is padding
    m = t([[1, 1, 1], [1, 1, 0]])
    A = t([1.0, -1.0])
    logp = lr.clone().requires_grad_()
    loss, met = rl.policy_loss(
        logp, old, A, m, rl.LossConfig(kind="gspo", eps_clip=0.2, loss_agg="seq_mean_token_mean")
    )
    # s0 = e^.05 (inside, A>0: -s0) ; s1 = e^-.4 = .67 < .8 with A<0: clipped -> .8
    close(loss, (-math.exp(0.05) + 0.8) / 2)
    close(met["clipfrac"], 0.5)
    close(met["clipfrac_low"], 0.5)
    loss.backward()
    # d/dlogp_t of -s0 / 2 = -s0 / 3 / 2 on row 0; clipped row 1 has no gradient
    e = math.exp(0.05) / 6
    close(logp.grad, [[-e, -e, -e], [0.0, 0.0, 0.0]])
    # the same gradient from autograd of the sequence-ratio objective
    logp2 = lr.clone().requires_grad_()
    s = torch.exp((logp2 * m).sum(-1) / m.sum(-1))
    seq_loss = torch.maximum(-A * s, -A * s.clamp(0.8, 1.2)).mean()
    seq_loss.backward()
    close(logp.grad, logp2.grad)
    close(loss, seq_loss)
    # (B, T) advantages: taken at each row's first masked token (left padding), here 1 and -1
    m2 = t([[0, 1, 1], [1, 1, 0]])
    A2 = t([[99.0, 1.0, 1.0], [-1.0, -1.0, 5.0]])
    loss2, _ = rl.policy_loss(lr, old, A2, m2, rl.LossConfig(kind="gspo", eps_clip=0.2, loss_agg="seq_mean_token_mean"))
    close(loss2, (-math.exp(0.025) + 0.8) / 2)


def test_gspo_gradient_matches_sequence_form_random():
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(3, 5, generator=g)
    lr = old + 0.1 * torch.randn(3, 5, generator=g)
    m = t([[1, 1, 1, 1, 1], [0, 1, 1, 1, 0], [0, 0, 1, 1, 1]])
    A = t([0.7, -1.3, 0.4])
    logp = lr.clone().requires_grad_()
    loss, _ = rl.policy_loss(
        logp, old, A, m, rl.LossConfig(kind="gspo", eps_clip=0.1, eps_clip_high=0.15, loss_agg="seq_mean_token_mean")
    )
    loss.backward()
    logp2 = lr.clone().requires_grad_()
    s = torch.exp(((logp2 - old) * m).sum(-1) / m.sum(-1))
    seq_loss = torch.maximum(-A * s, -A * s.clamp(0.9, 1.15)).mean()
    seq_loss.backward()
    close(loss, seq_loss)
    close(logp.grad, logp2.grad)


def test_cispo_loss():
    lp = t([[math.log(1.5), math.log(0.5), 0.0]])
    A, m, old = t([[1.0, 1.0, -2.0]]), torch.ones(1, 3), torch.zeros(1, 3)
    logp = lp.clone().requires_grad_()
    loss, met = rl.policy_loss(logp, old, A, m, rl.LossConfig(kind="cispo", eps_clip=1.0, eps_clip_high=0.2))
    # eps_clip 1 = no lower clip: weights clip(1.5, 1.2) = 1.2, .5, 1 ; loss -(1.2 lp0 + .5 lp1 - 2 lp2) / 3
    close(loss, -(1.2 * math.log(1.5) + 0.5 * math.log(0.5)) / 3)
    loss.backward()
    close(logp.grad, [[-1.2 / 3, -0.5 / 3, 2.0 / 3]])  # -clip(r) A / T: every token keeps a gradient
    close(met["clipfrac"], 1 / 3)
    logp = lp.clone().requires_grad_()
    loss, met = rl.policy_loss(logp, old, A, m, rl.LossConfig(kind="cispo", eps_clip=0.2, eps_clip_high=0.2))
    loss.backward()
    close(logp.grad, [[-1.2 / 3, -0.8 / 3, 2.0 / 3]])
    close(met["clipfrac"], 2 / 3)


def _reference_loss(
    kind, lp, old, A, m, ent, ref, eps, eps_high, eps_c, tis, agg, max_len, ent_coef, kl_coef, lp0=None
):
    """The one loss path written out token by token in plain python floats (an independent reference). lp0: where the
    stop-gradient parts are frozen (CISPO's weight) when differentiating numerically; GSPO's sequence ratio is not
    frozen: it carries its gradient to every token of the row (slime's form)."""
    lp0 = lp if lp0 is None else lp0
    B, T = len(lp), len(lp[0])
    rows = [[t for t in range(T) if m[i][t]] for i in range(B)]
    per = [[0.0] * T for _ in range(B)]
    for i in range(B):
        a_seq = A[i][rows[i][0]] if rows[i] else 0.0
        log_s = sum(lp[i][t] - old[i][t] for t in rows[i]) / max(len(rows[i]), 1)
        for t in rows[i]:
            r = math.exp(lp[i][t] - old[i][t])
            if kind == "cispo":
                w = math.exp(lp0[i][t] - old[i][t])
                per[i][t] = -min(max(w, 1 - eps), 1 + eps_high) * A[i][t] * lp[i][t]
                continue
            # GSPO: the sequence ratio s_i on every token of the row
            a, r = (a_seq, math.exp(log_s)) if kind == "gspo" else (A[i][t], r)
            v = max(-a * r, -a * min(max(r, 1 - eps), 1 + eps_high))
            if eps_c is not None and a < 0:
                v = min(v, -a * eps_c)
            per[i][t] = v
    if tis is not None:
        per = [[per[i][t] * tis[i][t] for t in range(T)] for i in range(B)]

    def agg_py(x):
        if agg == "token_mean":
            return sum(x[i][t] for i in range(B) for t in rows[i]) / sum(len(r) for r in rows)
        if agg == "seq_mean_token_mean":
            return sum(sum(x[i][t] for t in rows[i]) / max(len(rows[i]), 1) for i in range(B)) / B
        return sum(sum(x[i][t] for t in rows[i]) / max_len for i in range(B)) / B

    kl = [[math.exp(ref[i][t] - lp[i][t]) - (ref[i][t] - lp[i][t]) - 1 for t in range(T)] for i in range(B)]  # k3
    return agg_py(per) - ent_coef * agg_py(ent) + kl_coef * agg_py(kl)


@pytest.mark.parametrize("kind", ["ppo_clip", "gspo", "cispo"])
@pytest.mark.parametrize("agg", rl.LOSS_AGGS)
@pytest.mark.parametrize("tis_mode", [None, "truncate", "icepop"])
@pytest.mark.parametrize("extras", ["none", "entropy_kl", "dual_clip"])
def test_every_policy_loss_through_every_option(kind, agg, tis_mode, extras):
    """Every estimator's loss with every option of the one loss path (importance weights, aggregation, entropy,
    KL to the reference, dual clip) equals the token-by-token reference above; the gradient is checked too."""
    if extras == "dual_clip" and kind == "cispo":
        with pytest.raises(ValueError, match="CISPO"):
            rl.policy_loss(
                torch.zeros(1, 2),
                torch.zeros(1, 2),
                torch.ones(1, 2),
                torch.ones(1, 2),
                rl.LossConfig(kind=kind, eps_clip_c=3.0),
            )
        return
    g = torch.Generator().manual_seed(7)
    B, T = 4, 6
    m = t(
        [[0, 1, 1, 1, 1, 0], [0, 0, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [0, 1, 0, 1, 1, 0]]
    )  # left prompt, hole, padding
    old = -torch.rand(B, T, generator=g) * 2
    lp = old + 0.4 * torch.randn(B, T, generator=g)
    A = (torch.randn(B, 1, generator=g) * 2).expand(B, T).clone() * m
    ent, ref = torch.rand(B, T, generator=g), old + 0.3 * torch.randn(B, T, generator=g)
    rollout = old + 0.8 * torch.randn(B, T, generator=g)
    tis = None
    if tis_mode:  # the weights the loss should apply, for the reference
        tis, _ = rl.tis_weights(old, rollout, m, clip=1.5, clip_low=0.5, mode=tis_mode)
    eps, eps_high = (0.1, 0.15) if kind == "gspo" else (0.2, 0.28)
    eps_c = 2.0 if extras == "dual_clip" else None
    ent_coef, kl_coef = (0.03, 0.2) if extras == "entropy_kl" else (0.0, 0.0)
    cfg = rl.LossConfig(
        kind=kind,
        eps_clip=eps,
        eps_clip_high=eps_high,
        eps_clip_c=eps_c,
        use_tis=tis_mode is not None,
        tis_clip=1.5,
        tis_clip_low=0.5,
        tis_mode=tis_mode or "truncate",
        loss_agg=agg,
        max_len=T,
        entropy_coef=ent_coef,
        kl_type="k3",
        kl_coef=kl_coef,
    )
    logp = lp.clone().requires_grad_()
    loss, met = rl.policy_loss(logp, old, A, m, cfg, rollout_logp=rollout, entropy=ent, ref_logp=ref)
    L = lambda x: x.tolist()
    expected = _reference_loss(
        kind,
        L(lp),
        L(old),
        L(A),
        L(m),
        L(ent),
        L(ref),
        eps,
        eps_high,
        eps_c,
        L(tis) if tis is not None else None,
        agg,
        T,
        ent_coef,
        kl_coef,
    )
    close(loss, expected)
    if tis_mode:  # the weights really were applied: without them the loss differs
        plain, _ = rl.policy_loss(lp, old, A, m, dataclasses.replace(cfg, use_tis=False), entropy=ent, ref_logp=ref)
        assert abs(float(plain) - expected) > 1e-4
        assert set(met) >= {"tis_mean", "tis_min", "tis_max", "tis_clipfrac"}
    if extras == "entropy_kl":
        assert "kl_loss" in met and "entropy_loss" in met
    # gradient: finite differences of the reference on one trained token of each row
    loss.backward()
    for i in range(B):
        tt = int(m[i].nonzero()[0])
        h = 1e-3
        up, dn = lp.clone(), lp.clone()
        up[i, tt] += h
        dn[i, tt] -= h
        ref_args = (
            L(old),
            L(A),
            L(m),
            L(ent),
            L(ref),
            eps,
            eps_high,
            eps_c,
            L(tis) if tis is not None else None,
            agg,
            T,
            ent_coef,
            kl_coef,
        )
        fd = (
            _reference_loss(kind, L(up), *ref_args, lp0=L(lp)) - _reference_loss(kind, L(dn), *ref_args, lp0=L(lp))
        ) / (2 * h)
        close(logp.grad[i, tt], fd, tol=2e-3)


def test_value_loss():
    v = t([[1.0, 2.0, 3.0, 50.0]])
    old = t([[1.5, 1.5, 3.0, 0.0]])
    R = t([[0.0, 2.5, 3.5, 0.0]])
    m = t([[1, 1, 1, 0]])
    loss, met = rl.value_loss(v, old, R, m, value_clip=0.2)
    # t0: v_clip 1.3, max(1, 1.69) ; t1: v_clip 1.7, max(.25, .64) ; t2: .25 ; -> .5 * mean
    close(loss, 0.5 * (1.69 + 0.64 + 0.25) / 3)
    close(met["vf_clipfrac"], 2 / 3)
    loss, met = rl.value_loss(v, old, R, m)
    close(loss, 0.5 * (1.0 + 0.25 + 0.25) / 3)
    assert float(met["vf_clipfrac"]) == 0.0
    vv = v.clone().requires_grad_()
    rl.value_loss(vv, old, R, m, value_clip=0.2)[0].backward()
    close(vv.grad, [[0.0, 0.0, 0.5 / 3 * 2 * (3.0 - 3.5), 0.0]])  # clipped tokens carry no gradient


# -----------------------------------------------------------------------------
# rollout / train mismatch, distillation


def test_tis_truncate_and_icepop():
    old = t([[math.log(3), math.log(0.5), math.log(1.5), math.log(0.05), 4.0]])
    rollout = torch.zeros(1, 5)
    m = t([[1, 1, 1, 1, 0]])
    w, met = rl.tis_weights(old, rollout, m, clip=2.0, clip_low=0.1, mode="truncate")
    close(w, [[2.0, 0.5, 1.5, 0.1, 0.0]])
    assert not w.requires_grad
    close(
        [float(met[k]) for k in ("tis_mean", "tis_min", "tis_max", "tis_clipfrac")],
        [(3 + 0.5 + 1.5 + 0.05) / 4, 0.05, 3.0, 0.5],
    )
    w, met = rl.tis_weights(old, rollout, m, clip=2.0, clip_low=0.1, mode="icepop")
    close(w, [[0.0, 0.5, 1.5, 0.0, 0.0]])
    close(met["tis_clipfrac"], 0.5)
    w, _ = rl.tis_weights(old, rollout, m)  # defaults: truncate to [0, 2]
    close(w, [[2.0, 0.5, 1.5, 0.05, 0.0]])
    with pytest.raises(ValueError):
        rl.tis_weights(old, rollout, m, mode="nope")


def test_opd_adjust():
    A = t([[1.0, 1.0], [2.0, 2.0]])
    ls, lt = t([[-1.0, -2.0], [-1.0, -1.0]]), t([[-1.5, -1.0], [-3.0, 0.0]])
    m = t([[1, 1], [0, 1]])
    # 1 - .5 * .5 ; 1 - .5 * -1 ; masked ; 2 - .5 * -1
    close(rl.opd_adjust(A, ls, lt, m, coef=0.5), [[0.75, 1.5], [0.0, 2.5]])


# -----------------------------------------------------------------------------
# reward shaping, filters, metrics


def test_overlong_penalty():
    pen = rl.overlong_penalty([10, 15, 16, 18, 20, 25], max_response_len=20, buffer_len=5, penalty_factor=1.0)
    close(pen, [0.0, 0.0, -0.2, -0.6, -1.0, -1.0])
    pen = rl.overlong_penalty(torch.tensor([16, 30]), 20, 5, 0.5)
    close(pen, [-0.1, -0.5])


def test_pass_at_k_brute_force():
    for n in range(1, 7):
        for c in range(n + 1):
            outcomes = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(outcomes, k))
                expected = sum(any(s) for s in subsets) / len(subsets)
                assert abs(rl.pass_at_k(n, c, k) - expected) < 1e-12, (n, c, k)
    assert rl.pass_at_k(200, 0, 10) == 0.0 and rl.pass_at_k(5, 3, 3) == 1.0
    assert 0.0 < rl.pass_at_k(1000, 1, 1) < 1.0  # large n: no binomial overflow
    with pytest.raises(ValueError):
        rl.pass_at_k(3, 1, 4)


def test_estimator_table_rows():
    """Each row of rl.ESTIMATORS: the advantage function behind --advantage-estimator, by hand for GRPO with a KL
    penalty; every row gives zeros off the mask and critic returns exactly when it uses a critic."""
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5])
    mask = torch.tensor([[0, 1, 1], [0, 1, 0], [1, 1, 1], [0, 0, 1]], dtype=torch.float32)
    kl = 0.5 * mask  # summed per row: 1.0, 0.5, 1.5, 0.5
    inputs = dict(
        group_size=2,
        kl=kl,
        kl_coef=0.2,
        std_normalize=False,
        gamma=1.0,
        lambd=1.0,
        values=torch.zeros(4, 3),
        distributed=False,
    )
    # Dr. GRPO on the penalised rewards [0.8, -0.1, 0.2, 0.4]: group means 0.35 and 0.3
    given = lambda est: {k: inputs[k] for k in est.inputs}  # exactly what the row names: the trainer's call
    grpo, rloo = rl.ESTIMATORS["grpo"], rl.ESTIMATORS["rloo"]
    adv, returns = grpo.advantages(rewards, mask, **given(grpo))
    assert torch.allclose(adv, torch.tensor([0.45, -0.45, -0.1, 0.1])[:, None] * mask) and returns is None
    # RLOO: n/(n-1) = 2 times the same
    adv, _ = rloo.advantages(rewards, mask, **given(rloo))
    assert torch.allclose(adv, torch.tensor([0.9, -0.9, -0.2, 0.2])[:, None] * mask)
    for name, est in rl.ESTIMATORS.items():
        adv, returns = est.advantages(rewards, mask, **given(est))
        assert adv.shape == mask.shape and (adv[mask == 0] == 0).all(), name
        assert (returns is not None) == ("values" in est.inputs), name
        with pytest.raises(TypeError):  # an input the row does not name is refused, never silently dropped
            est.advantages(rewards, mask, **inputs)
    assert {n: e.loss for n, e in rl.ESTIMATORS.items() if e.loss != "ppo_clip"} == {"gspo": "gspo", "cispo": "cispo"}
