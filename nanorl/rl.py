"""
The RL math, as small pure functions on tensors.

Conventions: per-token tensors are (B, T) with a 0/1 `mask` (1 = a response token the model wrote and is
trained on). Rewards are (B,). The B samples come in consecutive groups of `group_size` (n samples of one
prompt). Advantages come back per token, (B, T), zero where mask is 0.
"""
import math

import torch
import torch.distributed as dist


def _dist_on(distributed):
    return distributed and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def masked_sum(x, mask, dim=None):
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def masked_mean(x, mask, dim=None):
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_whiten(x, mask, shift_mean=True, eps=1e-8, distributed=False):
    """(x - mean) / std over the masked entries; with distributed=True the statistics span all ranks."""
    stats = torch.stack([(x * mask).sum(), (x * x * mask).sum(), mask.sum()]).double()
    if _dist_on(distributed):
        dist.all_reduce(stats)
    s, s2, n = stats.tolist()
    n = max(n, 1.0)
    mean = s / n
    var = max(s2 / n - mean * mean, 0.0)
    # unbiased variance, as most RL codebases use for advantage whitening
    var = var * n / (n - 1) if n > 1 else var
    out = (x - mean) * (1.0 / math.sqrt(var + eps))
    if not shift_mean:
        out = out + mean
    return out * mask


def _grouped(rewards, group_size):
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    return rewards.view(-1, group_size)


# -----------------------------------------------------------------------------------------------
# advantages

def grpo_advantages(rewards, mask, group_size, std_normalize=True, eps=1e-6):
    """GRPO: (r - group mean) / (group std + eps), the std unbiased (torch's default). Without the std
    division it is Dr. GRPO, which avoids up-weighting groups whose rewards barely differ."""
    g = _grouped(rewards.float(), group_size)
    adv = g - g.mean(dim=1, keepdim=True)
    if std_normalize:
        adv = adv / (g.std(dim=1, keepdim=True) + eps)
    return adv.reshape(-1, 1) * mask


def rloo_advantages(rewards, mask, group_size):
    """RLOO: each sample's baseline is the mean reward of the other n-1 samples of its group."""
    g = _grouped(rewards.float(), group_size)
    n = group_size
    baseline = (g.sum(dim=1, keepdim=True) - g) / max(n - 1, 1)
    return (g - baseline).reshape(-1, 1) * mask


def _last_token_index(mask):
    T = mask.size(1)
    idx = torch.arange(T, device=mask.device).expand_as(mask)
    return torch.where(mask > 0, idx, torch.full_like(idx, -1)).max(dim=1).values


def reinforce_pp_returns(rewards, mask, kl=None, kl_coef=0.0, gamma=1.0, distributed=False):
    """REINFORCE++: token rewards (the scalar reward on each row's last response token, minus kl_coef * kl
    on every token), discounted returns-to-go, then whitened across the whole batch (all ranks)."""
    token_rewards = torch.zeros_like(mask, dtype=torch.float32)
    last = _last_token_index(mask)
    rows = torch.arange(mask.size(0), device=mask.device)
    has = last >= 0
    token_rewards[rows[has], last[has]] = rewards.float()[has]
    if kl is not None and kl_coef:
        token_rewards = token_rewards - kl_coef * kl * mask
    returns = discounted_returns(token_rewards, mask, gamma)
    return masked_whiten(returns, mask, distributed=distributed)


def discounted_returns(token_rewards, mask, gamma):
    """G_t = r_t + gamma * G_{t+1}, stepping over masked-out positions (tool outputs) without discounting."""
    B, T = token_rewards.shape
    out = torch.zeros_like(token_rewards)
    running = torch.zeros(B, dtype=token_rewards.dtype, device=token_rewards.device)
    for t in reversed(range(T)):
        m = mask[:, t]
        running = torch.where(m > 0, token_rewards[:, t] + gamma * running, running)
        out[:, t] = running * m
    return out


def reinforce_pp_baseline_advantages(rewards, mask, group_size, kl=None, kl_coef=0.0, distributed=False):
    """REINFORCE++-baseline: subtract the group mean reward, fold the per-token KL penalty in as token
    rewards (returns-to-go, gamma 1), then whiten across the whole batch."""
    g = _grouped(rewards.float(), group_size)
    centred = (g - g.mean(dim=1, keepdim=True)).reshape(-1)
    adv = centred[:, None] * mask
    if kl is not None and kl_coef:
        adv = adv + discounted_returns(-kl_coef * kl * mask, mask, 1.0)
    return masked_whiten(adv, mask, distributed=distributed)


def gae_advantages(token_rewards, values, mask, gamma, lam):
    """
    Generalised advantage estimation over the masked positions:
      delta_t = r_t + gamma * V_{t'} - V_t  (t' = the next masked position; V = 0 after the last one)
      A_t = delta_t + gamma * lam * A_{t'}
    Returns (advantages, returns = advantages + values), both zero off the mask.
    """
    B, T = token_rewards.shape
    adv = torch.zeros_like(token_rewards)
    next_value = torch.zeros(B, dtype=values.dtype, device=values.device)
    next_adv = torch.zeros(B, dtype=values.dtype, device=values.device)
    for t in reversed(range(T)):
        m = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * next_adv
        next_adv = torch.where(m > 0, a, next_adv)
        next_value = torch.where(m > 0, values[:, t], next_value)
        adv[:, t] = a * m
    return adv, (adv + values) * mask


# -----------------------------------------------------------------------------------------------
# KL, entropy

def kl_estimate(logp, ref_logp, kind):
    """Per-token estimators of KL(policy || ref) from samples of the policy (Schulman's k1/k2/k3)."""
    log_ratio = logp - ref_logp
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio ** 2
    if kind in ("k3", "low_var_kl"):
        # exp(ref - logp) - (ref - logp) - 1: unbiased and always >= 0
        k3 = torch.exp(-log_ratio) - 1 + log_ratio
        return k3.clamp(-10, 10) if kind == "low_var_kl" else k3
    raise ValueError(f"unknown KL estimator {kind!r}; valid: k1, k2, k3, low_var_kl")


def entropy_from_logits(logits):
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


# -----------------------------------------------------------------------------------------------
# losses

LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


def aggregate_loss(per_token, mask, loss_agg, max_len=None):
    """token_mean (DAPO): every token weighs the same. seq_mean_token_mean (GRPO): every sequence weighs the
    same. seq_mean_token_sum_norm (Dr. GRPO): token sums over a constant max_len, so no length bias."""
    if loss_agg == "token_mean":
        return masked_mean(per_token, mask)
    if loss_agg == "seq_mean_token_mean":
        return masked_mean(per_token, mask, dim=1).mean()
    if loss_agg == "seq_mean_token_sum_norm":
        if not max_len:
            raise ValueError("loss aggregation seq_mean_token_sum_norm needs max_len (the max response length)")
        return (masked_sum(per_token, mask, dim=1) / max_len).mean()
    raise ValueError(f"unknown loss aggregation {loss_agg!r}; valid: {', '.join(LOSS_AGGREGATIONS)}")


def policy_loss(logp, old_logp, advantages, mask, eps_clip=0.2, eps_clip_high=None, eps_clip_c=None,
                loss_agg="token_mean", max_len=None, tis_weights=None):
    """
    PPO clipped surrogate per token: max(-A r, -A clip(r, 1-eps, 1+eps_high)), r = exp(logp - old_logp).
    Dual clip (eps_clip_c > 1): for A < 0 the loss is also capped at -A * eps_clip_c, so one huge ratio on a
    bad token cannot blow up the step. tis_weights (detached) multiply the per-token loss.
    """
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1 - eps_clip, 1 + eps_high)
    pg = torch.maximum(pg1, pg2)
    clipped = (pg2 > pg1).float()
    dual = torch.zeros_like(pg)
    if eps_clip_c is not None:
        pg3 = -advantages * eps_clip_c
        dual = ((advantages < 0) & (pg > pg3)).float()
        pg = torch.where(advantages < 0, torch.minimum(pg, pg3), pg)
    if tis_weights is not None:
        pg = pg * tis_weights.detach()
    loss = aggregate_loss(pg, mask, loss_agg, max_len)
    with torch.no_grad():
        metrics = {
            "clipfrac": masked_mean(clipped, mask),
            "clipfrac_low": masked_mean(clipped * (ratio < 1 - eps_clip).float(), mask),
            "clipfrac_high": masked_mean(clipped * (ratio > 1 + eps_high).float(), mask),
            "ppo_kl": masked_mean(-log_ratio, mask),
            "dual_clip_frac": masked_mean(dual, mask),
        }
    return loss, metrics


def value_loss(values, old_values, returns, mask, value_clip=None, loss_agg="token_mean"):
    """0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2): the critic cannot move far per step."""
    l1 = (values - returns) ** 2
    if value_clip is None:
        per_tok, clipfrac = 0.5 * l1, torch.zeros(())
    else:
        v_clip = old_values + (values - old_values).clamp(-value_clip, value_clip)
        l2 = (v_clip - returns) ** 2
        per_tok = 0.5 * torch.maximum(l1, l2)
        clipfrac = masked_mean((l2 > l1).float(), mask).detach()
    return aggregate_loss(per_tok, mask, loss_agg), {"vf_clipfrac": clipfrac}


def pass_at_k(n, c, k):
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k), as a stable product."""
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def overlong_penalty(response_lengths, max_response_len, buffer_len, penalty_factor):
    """DAPO's soft overlong punishment: 0 until max - buffer, then a linear ramp down to -penalty_factor."""
    start = max_response_len - buffer_len
    over = (response_lengths.float() - start).clamp(min=0)
    return -(over / buffer_len).clamp(max=1.0) * penalty_factor
