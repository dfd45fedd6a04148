"""
GSPO under rollout importance weights (TIS truncate, IcePop): the sequence ratio s_i carries its gradient to every
token of its row and is weighted per token afterwards (slime's order), so each token of a row is pushed by the row's
mean weight. Checked against hand values and against an independent reference written from slime's formula.
"""

import math

import pytest
import torch

from nanorl import rl


def close(a, b, tol=1e-5):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    assert torch.allclose(a, b, atol=tol, rtol=tol), f"{a.tolist()} != {b.tolist()}"


def gspo_grad(lp, old, A, m, rollout, tis, agg="seq_mean_token_mean", eps=0.2):
    """GSPO's loss and gradient under the importance weights of old over rollout; tis: LossConfig's TIS settings."""
    logp = lp.clone().requires_grad_()
    cfg = rl.LossConfig(kind="gspo", eps_clip=eps, use_tis=True, **tis, loss_agg=agg, max_len=lp.size(1))
    loss, _ = rl.policy_loss(logp, old, A, m, cfg, rollout)
    loss.backward()
    return loss.detach(), logp.grad


def test_truncate_hand_values():
    # one row, two tokens, A = +1; trainer vs rollout weights exp(old - rollout) = .5 and 2 (under the clip 3)
    old = torch.zeros(1, 2)
    rollout = torch.tensor([[math.log(2.0), -math.log(2.0)]])
    m = torch.ones(1, 2)
    tis, _ = rl.tis_weights(old, rollout, m, clip=3.0, mode="truncate")
    close(tis, [[0.5, 2.0]])
    # on-policy, s = 1: loss = -mean(w) * s = -1.25; d/dlogp_t = -mean(w) * s / |y| = -.625 on both tokens
    # (the token-level form would give each token its own weight: -.25 and -1)
    loss, g = gspo_grad(old.clone(), old, torch.tensor([1.0]), m, rollout, dict(tis_clip=3.0))
    close(loss, -1.25)
    close(g, [[-0.625, -0.625]])
    # off-policy: logp - old = (.2, 0): s = e^.1 (inside 1 +- .2): loss -1.25 e^.1, gradient -1.25 e^.1 / 2 each
    loss, g = gspo_grad(torch.tensor([[0.2, 0.0]]), old, torch.tensor([1.0]), m, rollout, dict(tis_clip=3.0))
    s = math.exp(0.1)
    close(loss, -1.25 * s)
    close(g, [[-0.625 * s, -0.625 * s]])


def test_icepop_hand_values():
    # three tokens, weights 3 (outside the band [.5, 1.5]: zeroed), 1.2 and .9; A = -1, on-policy (s = 1)
    old = torch.zeros(1, 3)
    rollout = -torch.log(torch.tensor([[3.0, 1.2, 0.9]]))
    m = torch.ones(1, 3)
    icepop = dict(tis_clip=1.5, tis_clip_low=0.5, tis_mode="icepop")
    tis, _ = rl.tis_weights(old, rollout, m, clip=1.5, clip_low=0.5, mode="icepop")
    close(tis, [[0.0, 1.2, 0.9]])
    # loss = mean(w) * s * 1 = .7; every token, the zeroed one too, gets mean(w) / |y| = .7 / 3
    loss, g = gspo_grad(old.clone(), old, torch.tensor([-1.0]), m, rollout, icepop)
    close(loss, 0.7)
    close(g, [[0.7 / 3] * 3])


def slime_reference(lp, old, A, m, w, eps, agg):
    """slime's GSPO loss under importance weights, written independently: per row the sequence KL
    mean_t(old - lp) is broadcast to the row's tokens with its gradient, ratio = exp(-kl), the PPO clip is taken
    on that ratio, the per-token loss is multiplied by the weight, then reduced per sample (sum / the row's
    token count, averaged over rows) or per token (sum over all tokens / all tokens)."""
    per_row, count = [], 0
    for i in range(lp.size(0)):
        idx = m[i].nonzero().squeeze(1)
        kl = (old[i, idx] - lp[i, idx]).mean()
        ratio = torch.exp(-kl).expand(len(idx))
        loss_t = torch.maximum(-A[i] * ratio, -A[i] * ratio.clamp(1 - eps, 1 + eps)) * w[i, idx]
        per_row.append(loss_t)
        count += len(idx)
    if agg == "seq_mean_token_mean":
        return sum(x.sum() / len(x) for x in per_row) / len(per_row)
    return sum(x.sum() for x in per_row) / count


@pytest.mark.parametrize("mode", ["truncate", "icepop"])
@pytest.mark.parametrize("agg", ["seq_mean_token_mean", "token_mean"])
def test_gradient_matches_slime_reference(mode, agg):
    g = torch.Generator().manual_seed(3)
    B, T, eps = 4, 6, 0.2
    m = torch.tensor([[0, 1, 1, 1, 1, 0], [0, 0, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [0, 1, 0, 1, 1, 0]]).float()
    old = -torch.rand(B, T, generator=g) * 2
    lp = old + 0.1 * torch.randn(B, T, generator=g)
    lp[1] = old[1] - 0.6  # row 1: s = e^-.6 < .8 with A < 0: clipped, no gradient in either form
    A = torch.tensor([1.3, -0.7, -1.1, 0.9])
    rollout = old + 0.6 * torch.randn(B, T, generator=g)
    raw = torch.exp(old - rollout)
    w = raw.clamp(0.0, 1.5) if mode == "truncate" else torch.where((raw >= 0.5) & (raw <= 1.5), raw, 0 * raw)
    w = w * m
    settings = dict(tis_clip=1.5, tis_clip_low=0.0 if mode == "truncate" else 0.5, tis_mode=mode)
    tis, _ = rl.tis_weights(old, rollout, m, settings["tis_clip"], settings["tis_clip_low"], mode)
    close(tis, w)
    if mode == "icepop":
        assert ((w == 0) & (m == 1)).any(), "the example should hold IcePop-dropped tokens"
    loss, grad = gspo_grad(lp, old, A, m, rollout, settings, agg, eps)
    ref_lp = lp.clone().requires_grad_()
    ref = slime_reference(ref_lp, old, A, m, w, eps, agg)
    ref.backward()
    close(loss, ref)
    close(grad, ref_lp.grad)
    close(grad[1], torch.zeros(T))
    # every trained token of a row gets the same push: the row's mean weight times the sequence-ratio gradient
    for i in (0, 2, 3):
        row = grad[i][m[i] == 1]
        close(row, row[0].expand_as(row))
    # and it is not the token-level form's gradient (each token by its own weight): the fix is visible here
    tok_lp = lp.clone().requires_grad_()
    log_s = ((tok_lp - old) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True)
    s_tok = torch.exp(log_s.detach() + tok_lp - tok_lp.detach())
    per = torch.maximum(-A[:, None] * s_tok, -A[:, None] * s_tok.clamp(1 - eps, 1 + eps)) * w
    tok_loss = (per.sum(-1) / m.sum(-1)).mean() if agg == "seq_mean_token_mean" else per.sum() / m.sum()
    tok_loss.backward()
    assert (tok_lp.grad - grad).abs().max() > 0.1 * grad.abs().max()
