"""
All the RL math of nanorl: advantages, KL estimators, policy / value losses,
importance weights and a few eval metrics. Pure functions on tensors, no state.

Conventions
- Per-token tensors are (B, T) floats. `mask` is (B, T) of 0/1: 1 on the response
  tokens the policy generated and is trained on, 0 on prompt, padding and tool output.
  A mask may start late (left part zeros = the prompt) and may have holes (tool output).
- Rewards are (B,). The B rows come in consecutive groups of `group_size` samples of
  the same prompt: rows [0, n), [n, 2n), ...
- logp tensors hold log-probabilities of the sampled tokens, (B, T).
- Advantage functions return (B, T) tensors with zeros where mask == 0 and no grad.
- Metrics are detached 0-dim tensors (no GPU sync here; call float() when logging).
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

# exp() of a log-ratio beyond this is an overflow, not information: clamp before exp
MAX_LOG_RATIO = 20.0

# -----------------------------------------------------------------------------
# masked reductions


def masked_sum(x, mask, dim=None):
    """sum of x over positions where mask is 1 (masked entries may hold nan/inf, they are ignored)."""
    return torch.where(mask.bool(), x, torch.zeros_like(x)).sum(dim)  # dim None: over everything


def masked_mean(x, mask, dim=None):
    """sum(x * mask) / sum(mask). An empty mask gives 0 (the count is clamped at 1), never nan."""
    count = mask.to(x.dtype).sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_whiten(x, mask, shift_mean=True, eps=1e-8, distributed=False):
    """
    (x - mean) / sqrt(var + eps) over the masked entries; zeros where mask is 0.
    var is the unbiased (Bessel, n-1) masked variance, like verl's masked_whiten.
    shift_mean=False adds the mean back (only rescales).
    distributed=True (and torch.distributed initialized): the sums and counts are
    all-reduced so that mean and var are those of the batch concatenated over all
    ranks; in that case the statistics are constants for autograd. A process group in
    place of True reduces over that group's ranks only (async RL's training ranks).
    """
    reduce = distributed is not False and distributed is not None and dist.is_available() and dist.is_initialized()
    group = None if distributed is True else distributed
    stats = torch.stack([masked_sum(x, mask), mask.to(x.dtype).sum()])
    if reduce:
        stats = stats.detach().clone()
        dist.all_reduce(stats, group=group)
    total, count = stats[0], stats[1]
    mean = total / count.clamp(min=1)
    sq = masked_sum((x - mean) ** 2, mask)
    if reduce:
        sq = sq.detach().clone()
        dist.all_reduce(sq, group=group)
    var = sq / (count - 1).clamp(min=1)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask.bool(), out, torch.zeros_like(out))


# -----------------------------------------------------------------------------
# advantages (all of them are targets: computed without grad)


def _grouped(rewards, group_size, min_size=1):
    """(B,) -> (B // n, n) view of consecutive groups, with a clear error on bad shapes."""
    B = rewards.numel()
    if group_size < min_size or B % group_size != 0:
        raise ValueError(f"need group_size >= {min_size} dividing the batch, got B={B}, group_size={group_size}")
    return rewards.float().reshape(B // group_size, group_size)


def _broadcast(seq_values, mask):
    """(B,) sequence values -> (B, T): the value on every masked token, 0 elsewhere."""
    return seq_values[:, None] * mask.to(seq_values.dtype)


@torch.no_grad()
def grpo_advantages(rewards, mask, group_size, std_normalize=True, eps=1e-6):
    """
    GRPO: A_i = (r_i - mean_g(r)) / (std_g(r) + eps), same value on every token of row i.
    std is the unbiased (n-1) std of the group, torch's default and verl's choice.
    std_normalize=False is Dr. GRPO: A_i = r_i - mean_g(r) (no per-prompt difficulty bias).
    """
    r = _grouped(rewards, group_size, 2 if std_normalize else 1)
    adv = r - r.mean(dim=1, keepdim=True)
    if std_normalize:
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    return _broadcast(adv.reshape(-1), mask)


@torch.no_grad()
def rloo_advantages(rewards, mask, group_size):
    """
    RLOO: A_i = r_i - mean_{j != i} r_j = n/(n-1) * (r_i - mean_g(r)).
    The leave-one-out baseline does not depend on r_i, so the estimator stays unbiased.
    """
    n = group_size
    r = _grouped(rewards, n, 2)
    adv = (r - r.mean(dim=1, keepdim=True)) * (n / (n - 1))
    return _broadcast(adv.reshape(-1), mask)


@torch.no_grad()
def discounted_returns(token_rewards, mask, gamma=1.0):
    """
    G_t = r_t + gamma * G_next over the masked positions, right to left; G_next is the
    return at the next masked position (holes in the mask are skipped, not reset),
    0 after the last one. Rewards at unmasked positions are ignored; output 0 there.
    """
    B, T = token_rewards.shape
    valid = mask.bool()
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(T)):
        running = torch.where(valid[:, t], token_rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(valid[:, t], running, torch.zeros_like(running))
    return returns


def _last_token_rewards(rewards, mask):
    """Place the scalar reward of each row on its last masked token: (B,) -> (B, T)."""
    B, T = mask.shape
    last = T - 1 - mask.flip(-1).to(torch.int64).argmax(-1)  # argmax returns the first max
    out = torch.zeros(B, T, dtype=torch.float32, device=mask.device)
    out[torch.arange(B, device=mask.device), last] = rewards.float()
    return torch.where(mask.bool(), out, torch.zeros_like(out))


@torch.no_grad()
def reinforce_pp_baseline_advantages(rewards, mask, group_size, kl=None, kl_coef=0.0, distributed=False):
    """
    REINFORCE++-baseline: a_t = (r - mean_g(r)) + sum_{s >= t, masked} (-kl_coef * kl_s),
    i.e. the group-centered scalar plus the undiscounted returns-to-go of a per-token KL
    penalty, then whitened over every masked token of the (global, if distributed) batch.
    The group mean removes the prompt's difficulty; the batch whitening sets the scale.
    """
    r = _grouped(rewards, group_size, 1)
    adv = _broadcast((r - r.mean(dim=1, keepdim=True)).reshape(-1), mask)
    if kl is not None and kl_coef != 0.0:
        adv = adv + discounted_returns(-kl_coef * kl.float(), mask, gamma=1.0)
    return masked_whiten(adv, mask, distributed=distributed)


@torch.no_grad()
def reinforce_pp_returns(rewards, mask, kl=None, kl_coef=0.0, gamma=1.0, distributed=False):
    """
    REINFORCE++ (no critic, no group): token rewards r_t = -kl_coef * kl_t, plus the scalar
    reward on the last masked token; G_t = discounted returns-to-go (gamma); the advantage
    is G whitened over all masked tokens of the (global, if distributed) batch.
    """
    token_rewards = _last_token_rewards(rewards, mask)
    if kl is not None and kl_coef != 0.0:
        token_rewards = token_rewards - kl_coef * kl.float()
    returns = discounted_returns(token_rewards, mask, gamma)
    return masked_whiten(returns, mask, distributed=distributed)


@torch.no_grad()
def gae_advantages(token_rewards, values, mask, gamma, lam):
    """
    GAE over the masked positions, right to left:
      delta_t = r_t + gamma * V_next - V_t,   A_t = delta_t + gamma * lam * A_next
    where V_next / A_next are those of the next masked position (0 after the last one),
    so a prompt on the left, padding on the right or tool-output holes are all skipped.
    returns_t = A_t + V_t is the critic's target. Both are 0 where mask is 0.
    Not whitened: PPO usually calls masked_whiten(advantages, mask) next.
    """
    B, T = values.shape
    valid = mask.bool()
    zeros = torch.zeros_like(values[:, 0])
    adv = torch.zeros_like(values)
    next_value, next_adv = zeros, zeros
    for t in reversed(range(T)):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * next_adv
        next_adv = torch.where(valid[:, t], a, next_adv)
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        adv[:, t] = torch.where(valid[:, t], a, zeros)
    returns = torch.where(valid, adv + values, torch.zeros_like(values))
    return adv, returns


# -----------------------------------------------------------------------------
# KL estimators (Schulman, "Approximating KL divergence"), per token, for KL(pi || ref)


def kl_estimate(logp, ref_logp, kind):
    """
    With samples from pi and d = ref_logp - logp:
      k1 = -d = logp - ref_logp          unbiased, high variance, can be negative
      k2 = 0.5 * d^2                      biased, low variance, >= 0
      k3 = exp(d) - d - 1                 unbiased, low variance, >= 0 (since e^x >= 1 + x)
      low_var_kl = k3 with d clamped to [-20, 20] and the result clamped to [-10, 10] (verl)
    """
    d = ref_logp - logp
    if kind == "k1":
        return -d
    if kind == "k2":
        return 0.5 * d**2
    if kind == "k3":
        return torch.exp(d) - d - 1
    if kind == "low_var_kl":
        d = d.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        return (torch.exp(d) - d - 1).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL estimator {kind!r}, expected one of k1, k2, k3, low_var_kl")


# -----------------------------------------------------------------------------
# policy losses

LOSS_AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


def aggregate_loss(per_token, mask, loss_agg, max_len=None):
    """
    Reduce a (B, T) per-token loss to a scalar:
      token_mean:              sum_{i,t} l / sum_{i,t} m               (DAPO: every token weighs the same)
      seq_mean_token_mean:     1/B sum_i (sum_t l_i / sum_t m_i)       (GRPO: every sequence weighs the same)
      seq_mean_token_sum_norm: 1/B sum_i (sum_t l_i / max_len)         (Dr. GRPO: no length bias)
    The sequence means divide by B, all rows (an empty row adds 0), so a trainer can weight
    a micro-batch by its share of rows and get exactly the mean over the whole batch.
    """
    if loss_agg == "token_mean":
        return masked_mean(per_token, mask)
    if loss_agg == "seq_mean_token_mean":
        return masked_mean(per_token, mask, dim=-1).mean()
    if loss_agg == "seq_mean_token_sum_norm":
        if max_len is None:
            raise ValueError("loss_agg='seq_mean_token_sum_norm' needs max_len (the max response length)")
        return (masked_sum(per_token, mask, dim=-1) / max_len).mean()
    raise ValueError(f"unknown loss_agg {loss_agg!r}, expected one of {', '.join(LOSS_AGGS)}")


def _ratio(logp, old_logp):
    """pi / pi_old per token, with the log-ratio clamped against exp overflow."""
    return torch.exp((logp - old_logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))


def _clipped_surrogate(ratio, A, eps_clip, eps_clip_high, eps_clip_c):
    """
    PPO's pessimistic surrogate, per token, as a loss: max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps_high)).
    Dual clip (eps_clip_c > 1): where A < 0 the loss is also capped at -A * eps_clip_c, so a huge ratio on a
    bad token cannot produce an unbounded loss. Returns (loss, clipped, dual) with clipped/dual boolean masks.
    """
    pg1 = -A * ratio
    pg2 = -A * ratio.clamp(1 - eps_clip, 1 + eps_clip_high)
    pg = torch.maximum(pg1, pg2)
    if eps_clip_c is None:  # no dual clip: no token capped
        return pg, pg2 > pg1, torch.zeros_like(pg, dtype=torch.bool)
    if eps_clip_c <= 1.0:
        raise ValueError(f"dual clip needs eps_clip_c > 1, got {eps_clip_c}")
    pg3 = -A * eps_clip_c
    dual = (A < 0) & (pg3 < pg)
    pg = torch.where(dual, pg3, pg)
    return pg, pg2 > pg1, dual


# The three policy losses share one signature and return a per-token loss (B, T) and metrics; the caller
# (policy_loss) applies importance weights, aggregation, entropy and KL once for all of them.


def ppo_clip_loss(logp, old_logp, advantages, mask, eps_clip=0.2, eps_clip_high=None, eps_clip_c=None):
    """
    PPO clipped surrogate with token ratios exp(logp - old_logp): GRPO, RLOO, REINFORCE++ and PPO use it.
    eps_clip_high (DAPO clip-higher) defaults to eps_clip; eps_clip_c turns on dual clip.
    """
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    A = advantages.detach()
    ratio = _ratio(logp, old_logp)
    pg, clipped, dual = _clipped_surrogate(ratio, A, eps_clip, eps_high, eps_clip_c)
    metrics = {
        "clipfrac": masked_mean(clipped.float(), mask),
        "clipfrac_low": masked_mean(((ratio < 1 - eps_clip) & (A < 0)).float(), mask),
        "clipfrac_high": masked_mean(((ratio > 1 + eps_high) & (A > 0)).float(), mask),
        "ppo_kl": masked_mean(old_logp - logp, mask).detach(),
        "dual_clip_frac": masked_mean(dual.float(), mask),
    }
    return pg, metrics


def gspo_loss(logp, old_logp, advantages, mask, eps_clip=3e-4, eps_clip_high=None, eps_clip_c=None):
    """
    GSPO (Qwen): one importance ratio per sequence, the geometric mean of its token ratios,
      s_i = exp(1/|y_i| sum_t (logp_t - old_logp_t))
    broadcast to every token of row i with its whole gradient (as slime does), then the same clipped surrogate as PPO
    (with GSPO's small clip range), dual clip included. Any per-token weight c_t applied afterwards (aggregation,
    TIS / IcePop) therefore acts through the row's sum: grad sum_t c_t f(s_i) = (sum_t c_t) f'(s_i) grad s_i, so
    every token of a row is pushed by the row's mean weight, and a token IcePop zeroed still gets the row's push.
    (The token-level form sg[s_i] * exp(logp_t - sg[logp_t]) has the same value and, with row-constant weights,
    the same gradient, but would push each token by its own TIS weight.)
    A_i: (B,) or (B, T) (then taken at the row's first masked token).
    """
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    if advantages.dim() == 2:
        first = mask.to(torch.int64).argmax(-1)  # argmax returns the first max
        advantages = advantages.gather(1, first[:, None]).squeeze(1)
    A = advantages.detach()[:, None].expand_as(logp)
    log_s = masked_mean(logp - old_logp, mask, dim=-1)  # (B,)
    # the value clamped against overflow, the gradient s_i * grad log_s_i kept (a clamp would zero it)
    s_seq = torch.exp(log_s.detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO) + log_s - log_s.detach())
    pg, _, dual = _clipped_surrogate(s_seq[:, None].expand_as(logp), A, eps_clip, eps_high, eps_clip_c)
    s, A = log_s.detach().exp(), A[:, 0]
    rows = (mask.sum(-1) > 0).float()
    low, high = (s < 1 - eps_clip) & (A < 0), (s > 1 + eps_high) & (A > 0)
    metrics = {
        "clipfrac": masked_mean((low | high).float(), rows),  # fraction of sequences
        "clipfrac_low": masked_mean(low.float(), rows),
        "clipfrac_high": masked_mean(high.float(), rows),
        "ppo_kl": masked_mean(old_logp - logp, mask).detach(),
        "dual_clip_frac": masked_mean(dual.float(), mask),
        "seq_ratio_mean": masked_mean(s, rows),
    }
    return pg, metrics


def cispo_loss(logp, old_logp, advantages, mask, eps_clip=0.2, eps_clip_high=None, eps_clip_c=None):
    """
    CISPO (MiniMax-M1): clip the importance weight, not the update, so every token keeps a gradient:
      l_t = -sg[clip(ratio_t, 1 - eps_clip, 1 + eps_clip_high)] * A_t * logp_t
    grad_logp l_t = -clip(ratio_t) * A_t (REINFORCE with a truncated IS weight). The loss value itself is not
    meaningful, only its gradient. Dual clip has no meaning here (nothing is clipped to cap): eps_clip_c must be None.
    """
    if eps_clip_c is not None:
        raise ValueError("dual clip (eps_clip_c) has no meaning for CISPO: its weight is already clipped")
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    A = advantages.detach()
    ratio = _ratio(logp, old_logp).detach()
    w = ratio.clamp(1 - eps_clip, 1 + eps_high)
    metrics = {
        "clipfrac": masked_mean((w != ratio).float(), mask),
        "ppo_kl": masked_mean(old_logp - logp, mask).detach(),
    }
    return -w * A * logp, metrics


POLICY_LOSSES = {"ppo_clip": ppo_clip_loss, "gspo": gspo_loss, "cispo": cispo_loss}


@dataclass(frozen=True)
class LossConfig:
    """The policy loss's settings, fixed for a run: the per-token loss (kind: ppo_clip | gspo | cispo) and its clip
    range (eps_clip_high: DAPO's clip-higher, default eps_clip; eps_clip_c: dual clip), the importance weights against
    the sampler (use_tis, with tis_weights' clip, clip_low and mode), the aggregation (loss_agg, max_len for
    seq_mean_token_sum_norm), the entropy bonus and the KL loss to the reference (0 = off)."""

    kind: str = "ppo_clip"
    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    eps_clip_c: float | None = None
    use_tis: bool = False
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    tis_mode: str = "truncate"
    loss_agg: str = "token_mean"
    max_len: int | None = None
    entropy_coef: float = 0.0
    kl_type: str = "low_var_kl"
    kl_coef: float = 0.0

    def __post_init__(self):
        if self.kind not in POLICY_LOSSES:
            raise ValueError(f"unknown policy loss {self.kind!r}, expected one of {', '.join(POLICY_LOSSES)}")


def policy_loss(logp, old_logp, advantages, mask, cfg=LossConfig(), rollout_logp=None, entropy=None, ref_logp=None):
    """
    The one loss path of every estimator (cfg: a LossConfig):
      per-token policy loss (cfg.kind)  x  importance weights (TIS / IcePop of old_logp over rollout_logp, if on)
      -> aggregate_loss(cfg.loss_agg)  - entropy_coef * aggregated entropy  + kl_coef * aggregated KL(pi || ref)
    Returns (loss, metrics): pg_loss, entropy_loss, kl_loss and tis_weights' metrics when used, the policy loss's own.
    """
    loss_fn = POLICY_LOSSES[cfg.kind]
    pg, metrics = loss_fn(logp, old_logp, advantages, mask, cfg.eps_clip, cfg.eps_clip_high, cfg.eps_clip_c)
    if cfg.use_tis:  # the tokens came from the sampler, not from the policy the loss assumes
        if rollout_logp is None:
            raise ValueError("LossConfig.use_tis weighs by the sampler's log-probs: pass rollout_logp")
        tis, tis_metrics = tis_weights(old_logp, rollout_logp, mask, cfg.tis_clip, cfg.tis_clip_low, cfg.tis_mode)
        pg = pg * tis
        metrics.update(tis_metrics)
    loss = aggregate_loss(pg, mask, cfg.loss_agg, cfg.max_len)
    metrics["pg_loss"] = loss.detach()
    if cfg.entropy_coef:
        ent_loss = aggregate_loss(entropy, mask, cfg.loss_agg, cfg.max_len)
        loss = loss - cfg.entropy_coef * ent_loss
        metrics["entropy_loss"] = ent_loss.detach()
    if cfg.kl_coef:
        kl_loss = aggregate_loss(kl_estimate(logp, ref_logp, cfg.kl_type), mask, cfg.loss_agg, cfg.max_len)
        loss = loss + cfg.kl_coef * kl_loss
        metrics["kl_loss"] = kl_loss.detach()
    return loss, metrics


def value_loss(values, old_values, returns, mask, value_clip=None, loss_agg="token_mean", max_len=None):
    """
    PPO critic loss: 0.5 * max((v - R)^2, (v_clip - R)^2), v_clip = old + clip(v - old, -c, c).
    The max is pessimistic: the critic cannot move further than c from its rollout values
    to reduce the loss. value_clip=None: plain 0.5 * (v - R)^2. Metric vf_clipfrac.
    """
    R = returns.detach()
    l1 = (values - R) ** 2
    if value_clip is None:
        per_token, clipped = l1, torch.zeros_like(l1, dtype=torch.bool)
    else:
        v_clip = old_values + (values - old_values).clamp(-value_clip, value_clip)
        l2 = (v_clip - R) ** 2
        per_token, clipped = torch.maximum(l1, l2), l2 > l1
    loss = 0.5 * aggregate_loss(per_token, mask, loss_agg, max_len)
    return loss, {"vf_clipfrac": masked_mean(clipped.float(), mask).detach()}


# -----------------------------------------------------------------------------
# rollout / train mismatch and on-policy distillation


@torch.no_grad()
def tis_weights(old_logp, rollout_logp, mask, clip=2.0, clip_low=0.0, mode="truncate"):
    """
    Truncated importance sampling against the inference engine's sampler: the tokens were sampled
    by the rollout engine (rollout_logp) but the loss assumes the trainer's policy (old_logp).
      w_t = exp(old_logp_t - rollout_logp_t)
      truncate: clamp(w, clip_low, clip)               (TIS: bounded variance, small bias)
      icepop:   w if clip_low <= w <= clip else 0      (drop the tokens where the two disagree)
    Returns (weights (B, T), detached, 0 where mask is 0; metrics on the raw w).
    """
    w = _ratio(old_logp, rollout_logp)
    if mode == "truncate":
        out = w.clamp(clip_low, clip)
    elif mode == "icepop":
        out = torch.where((w >= clip_low) & (w <= clip), w, torch.zeros_like(w))
    else:
        raise ValueError(f"unknown tis mode {mode!r}, expected truncate or icepop")
    valid = mask.bool()
    out = torch.where(valid, out, torch.zeros_like(out))
    any_valid = valid.any()
    one = torch.ones_like(w[0, 0])
    metrics = {
        "tis_mean": masked_mean(w, mask),
        "tis_min": torch.where(any_valid, torch.where(valid, w, torch.full_like(w, float("inf"))).min(), one),
        "tis_max": torch.where(any_valid, torch.where(valid, w, torch.full_like(w, float("-inf"))).max(), one),
        "tis_clipfrac": masked_mean(((w < clip_low) | (w > clip)).float(), mask),
    }
    return out, metrics


@torch.no_grad()
def opd_adjust(advantages, logp_student, logp_teacher, mask, coef):
    """
    On-policy distillation: A_t - coef * (logp_student_t - logp_teacher_t). The difference is the
    per-token k1 estimate of the reverse KL(student || teacher) on the student's own samples, so
    tokens the teacher finds likelier than the student get pushed up. 0 where mask is 0.
    """
    adv = advantages - coef * (logp_student - logp_teacher)
    return torch.where(mask.bool(), adv, torch.zeros_like(adv))


# -----------------------------------------------------------------------------
# reward shaping, sampling filters and eval metrics


def overlong_penalty(response_lengths, max_response_len, buffer_len, penalty_factor):
    """
    DAPO soft overlong punishment, (B,) penalties to add to the rewards:
      0                                             if L <= max - buffer
      -(L - (max - buffer)) / buffer * factor       inside the buffer, down to -factor at L = max
      -factor                                       beyond
    """
    if buffer_len <= 0:
        raise ValueError(f"buffer_len must be > 0, got {buffer_len}")
    L = torch.as_tensor(response_lengths, dtype=torch.float32)
    over = (L - (max_response_len - buffer_len)).clamp(min=0)
    return -(over / buffer_len * penalty_factor).clamp(max=penalty_factor)


def pass_at_k(n, c, k):
    """
    Unbiased pass@k from n samples with c correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k),
    as the product 1 - prod_{i=n-c+1}^{n} (1 - k / i) to avoid huge binomials. 1.0 if n - c < k.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    all_fail = 1.0
    for i in range(n - c + 1, n + 1):
        all_fail *= 1.0 - k / i
    return 1.0 - all_fail


# -----------------------------------------------------------------------------
# the estimators: --advantage-estimator name -> advantage function and policy-loss kind
# Each function takes the rollout's rewards (B,) and mask (B, T) plus the keyword inputs its row names (and no others)
# and returns (advantages (B, T), the critic's returns (B, T) or None). The inputs:
#   group_size, kl (B, T) k1 per token or None (off), kl_coef, std_normalize, gamma, lambd, values (B, T) (the
#   critic's, ppo), distributed (whiten over every training rank: False, True or a process group)


def group_estimate(rewards, mask, *, group_size, kl, kl_coef, std_normalize):
    """GRPO's advantages (also GSPO's and CISPO's): a KL penalty comes off each reward, summed over the sequence."""
    if kl is not None:
        rewards = rewards - kl_coef * kl.sum(-1)
    return grpo_advantages(rewards, mask, group_size, std_normalize=std_normalize), None


def rloo_estimate(rewards, mask, *, group_size, kl, kl_coef):
    """RLOO's advantages, the KL penalty off each reward as in group_estimate."""
    if kl is not None:
        rewards = rewards - kl_coef * kl.sum(-1)
    return rloo_advantages(rewards, mask, group_size), None


def reinforce_pp_estimate(rewards, mask, *, kl, kl_coef, gamma, distributed):
    return reinforce_pp_returns(rewards, mask, kl=kl, kl_coef=kl_coef, gamma=gamma, distributed=distributed), None


def reinforce_pp_baseline_estimate(rewards, mask, *, group_size, kl, kl_coef, distributed):
    adv = reinforce_pp_baseline_advantages(rewards, mask, group_size, kl=kl, kl_coef=kl_coef, distributed=distributed)
    return adv, None


def gae_estimate(rewards, mask, *, kl, kl_coef, values, gamma, lambd):
    """PPO: the reward on the last response token, the KL penalty on every token, then GAE against the critic."""
    token_rewards = _last_token_rewards(rewards, mask)
    if kl is not None:
        token_rewards = token_rewards - kl_coef * kl
    return gae_advantages(token_rewards, values, mask, gamma, lambd)


@dataclass(frozen=True)
class Estimator:
    """One row of the table: the advantage function, the keyword inputs it takes (exactly its keyword-only
    parameters: the flags it reads follow from them, "values" meaning a critic), the policy loss kind
    (policy_loss), and whether its advantages come out whitened already."""

    advantages: object
    inputs: tuple
    loss: str = "ppo_clip"
    whitened: bool = False


GROUP_INPUTS = ("group_size", "kl", "kl_coef", "std_normalize")  # GRPO's, GSPO's and CISPO's
ESTIMATORS = {
    "grpo": Estimator(group_estimate, GROUP_INPUTS),
    "rloo": Estimator(rloo_estimate, ("group_size", "kl", "kl_coef")),
    "reinforce_plus_plus": Estimator(reinforce_pp_estimate, ("kl", "kl_coef", "gamma", "distributed"), whitened=True),
    "reinforce_plus_plus_baseline": Estimator(
        reinforce_pp_baseline_estimate, ("group_size", "kl", "kl_coef", "distributed"), whitened=True
    ),
    "gspo": Estimator(group_estimate, GROUP_INPUTS, loss="gspo"),
    "cispo": Estimator(group_estimate, GROUP_INPUTS, loss="cispo"),
    "ppo": Estimator(gae_estimate, ("kl", "kl_coef", "values", "gamma", "lambd")),
}
