"""
The training side of RL: given a rollout's scored samples, shape the rewards, compute advantages and take the
optimizer steps. One loss path serves every estimator: the per-token policy loss (PPO clip, GSPO or CISPO),
then importance weights, aggregation, entropy and KL, all in nanorl.rl.policy_loss. Used by nanorl/rl_run.py
(synchronous and --async) and by `bench rl`, so the benchmark times exactly the step that trains. At the end, the
samples' tensor layout: packing them end to end into micro-batches, and collating them into (B, T) rows.

The Trainer takes a TrainerConfig; its flags live here too (add_args, config_from_args), next to the code they
configure. Outside chat_rl build the config directly:
    TrainerConfig(group=GroupSpec(n_samples_per_prompt=4, max_response_len=64))
"""

from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from nanorl import rl
from nanorl.common import is_sharded
from nanorl.flags import fraction, nonneg_float, nonneg_int, number_in, positive_float, positive_int
from nanorl.precision import autocast_ctx
from nanorl.rollout import TRUNCATED, GroupSpec


@dataclass
class TrainerConfig:
    """What one training step reads. The defaults are chat_rl's flag defaults."""

    group: GroupSpec = GroupSpec()  # the rollout's: group size, temperature of the log-probs, max length
    advantage_estimator: str = "grpo"  # a row of rl.ESTIMATORS: the advantage function and the policy loss
    num_steps_per_rollout: int = 1
    max_tokens_per_gpu: int = 8192
    grad_clip: float = 1.0  # 0 = off
    warmup_rollouts: int = 0
    lr_decay_style: str = "constant"  # or linear: to 0 over num_rollouts (nanochat's RL schedule)
    num_rollouts: int = 60  # the run's length, for the decay
    gamma: float = 1.0
    lambd: float = 1.0
    value_clip: float = 0.2  # 0 = off
    disable_grpo_std_normalization: bool = False
    normalize_advantages: bool = False
    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    eps_clip_c: float | None = None
    entropy_coef: float = 0.0
    loss_aggregation: str = "token_mean"
    overlong_buffer_len: int = 0
    overlong_penalty_factor: float = 1.0
    mask_truncated_samples: bool = False
    kl_loss_coef: float = 0.0  # the KL loss (0 = off)
    kl_loss_type: str = "low_var_kl"
    kl_coef: float = 0.0  # the KL penalty in the reward (0 = off)
    opd_kl_coef: float = 1.0  # on-policy distillation, when the Trainer has a teacher
    use_tis: bool = False
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    tis_mode: str = "truncate"

    @property
    def estimator(self):
        return rl.ESTIMATORS[self.advantage_estimator]

    @property
    def needs_critic(self):
        return "values" in self.estimator.inputs  # the critic's

    @property
    def needs_reference(self):
        return self.kl_loss_coef > 0 or self.kl_coef > 0


def add_args(parser):
    c = TrainerConfig
    g = parser.add_argument_group("training step (nanorl/rl_trainer.py)")
    g.add_argument("--global-batch-size", type=positive_int, help="samples per optimizer step (default: the rollout)")
    g.add_argument(
        "--num-steps-per-rollout",
        type=positive_int,
        default=c.num_steps_per_rollout,
        help="optimizer steps per rollout (>1 is off-policy: uses the ratio)",
    )
    g.add_argument(
        "--max-tokens-per-gpu",
        type=positive_int,
        default=c.max_tokens_per_gpu,
        help="tokens per training micro-batch: samples are packed end to end into rows (at most the "
        "model's context each) and rows into micro-batches of this many positions, padding included",
    )
    g.add_argument("--weight-decay", type=nonneg_float, default=0.0, help="optimizer weight decay")
    g.add_argument("--grad-clip", type=nonneg_float, default=c.grad_clip, help="clip the grad norm (0 = off)")
    g.add_argument("--warmup-rollouts", type=nonneg_int, default=c.warmup_rollouts, help="linear LR warmup (rollouts)")
    decay = "LR after the warmup: constant, or linear to 0 at the last rollout (nanochat's RL)"
    g.add_argument("--lr-decay-style", default=c.lr_decay_style, choices=["constant", "linear"], help=decay)
    g = parser.add_argument_group("advantages and loss (nanorl/rl_trainer.py, nanorl/rl.py)")
    g.add_argument(
        "--advantage-estimator",
        default=c.advantage_estimator,
        choices=list(rl.ESTIMATORS),
        help="gspo / cispo: GRPO advantages with GSPO's sequence-level ratio or CISPO's clipped-weight loss",
    )
    g.add_argument("--gamma", type=fraction, default=c.gamma, help="discount of reinforce_plus_plus and ppo returns")
    g.add_argument("--lambd", type=fraction, default=c.lambd, help="ppo: GAE lambda (1: Monte Carlo returns)")
    g.add_argument("--critic-lr", type=positive_float, default=None, help="ppo: the critic's AdamW LR (required)")
    g.add_argument("--value-clip", type=nonneg_float, default=c.value_clip, help="ppo: critic value clip (0 = off)")
    g.add_argument("--disable-grpo-std-normalization", action="store_true", help="Dr. GRPO: no group-std division")
    g.add_argument("--normalize-advantages", action="store_true", help="whiten advantages across all training ranks")
    g.add_argument("--eps-clip", type=number_in(float, 0, 1, lo_open=True), default=c.eps_clip, help="PPO clip range")
    g.add_argument("--eps-clip-high", type=positive_float, default=None, help="clip-higher (DAPO); default --eps-clip")
    g.add_argument(
        "--eps-clip-c", type=number_in(float, 1, lo_open=True), default=None, help="dual clip (>1) for A < 0"
    )
    g.add_argument("--entropy-coef", type=nonneg_float, default=c.entropy_coef, help="entropy bonus coefficient")
    g.add_argument(
        "--loss-aggregation",
        default=c.loss_aggregation,
        choices=rl.LOSS_AGGS,
        help="how per-token losses become one number",
    )
    g.add_argument(
        "--overlong-buffer-len",
        type=nonneg_int,
        default=c.overlong_buffer_len,
        help="DAPO overlong shaping: penalise the last N tokens before the max length",
    )
    g.add_argument(
        "--overlong-penalty-factor",
        type=nonneg_float,
        default=c.overlong_penalty_factor,
        help="the overlong penalty at the max length",
    )
    g.add_argument("--mask-truncated-samples", action="store_true", help="truncated responses are not trained on")
    g.add_argument("--use-kl-loss", action="store_true", help="add a KL(policy || reference) loss")
    g.add_argument("--kl-loss-coef", type=nonneg_float, default=c.kl_loss_coef, help="KL loss weight (--use-kl-loss)")
    g.add_argument(
        "--kl-loss-type",
        default=c.kl_loss_type,
        choices=["k1", "k2", "k3", "low_var_kl"],
        help="KL estimator of the KL loss",
    )
    g.add_argument("--kl-coef", type=nonneg_float, default=c.kl_coef, help="KL penalty (k1) folded into the reward")
    g.add_argument("--use-opd", action="store_true", help="on-policy distillation: teacher log-probs shift advantages")
    g.add_argument("--opd-kl-coef", type=nonneg_float, default=c.opd_kl_coef, help="OPD: A -= coef * (lp - lp_teacher)")
    g.add_argument("--opd-teacher-load", default=None, help="OPD teacher: checkpoint dir or source[:tag]")
    g.add_argument("--use-tis", action="store_true", help="truncated importance weights, trainer vs rollout log-probs")
    g.add_argument("--tis-clip", type=positive_float, default=c.tis_clip, help="TIS: upper bound of the weights")
    g.add_argument("--tis-clip-low", type=nonneg_float, default=c.tis_clip_low, help="TIS: lower bound of the weights")
    g.add_argument("--tis-mode", default=c.tis_mode, choices=["truncate", "icepop"], help="icepop: 0 outside the band")


def config_from_args(args, parser, group):
    """The TrainerConfig of the flags and the run's GroupSpec, after checking that the flags agree: a combination
    without meaning fails here, before any work, naming both flags."""
    # every other field is a flag of the same name, but the KL loss is off unless --use-kl-loss
    kw = {f.name: getattr(args, f.name) for f in fields(TrainerConfig) if f.name != "group"}
    cfg = TrainerConfig(group=group, **{**kw, "kl_loss_coef": args.kl_loss_coef if args.use_kl_loss else 0.0})
    check_estimator_flags(cfg, args, parser)
    if args.use_kl_loss != (args.kl_loss_coef > 0):
        parser.error("--use-kl-loss and --kl-loss-coef go together: give both (a positive coefficient) or neither")
    if args.use_opd != (args.opd_teacher_load is not None):
        parser.error("--use-opd and --opd-teacher-load go together: give both or neither")
    if not args.use_opd:
        unused(parser, "--opd-kl-coef", cfg.opd_kl_coef, TrainerConfig.opd_kl_coef, "without --use-opd")
    if not cfg.use_tis:
        for flag, field in (("--tis-clip", "tis_clip"), ("--tis-clip-low", "tis_clip_low"), ("--tis-mode", "tis_mode")):
            unused(parser, flag, getattr(cfg, field), getattr(TrainerConfig, field), "without --use-tis")
    if cfg.overlong_buffer_len == 0:
        unused(
            parser,
            "--overlong-penalty-factor",
            cfg.overlong_penalty_factor,
            TrainerConfig.overlong_penalty_factor,
            "without --overlong-buffer-len",
        )
    return cfg


def unused(parser, flag, value, default, why):
    if value != default:
        parser.error(f"{flag} {value} has no effect {why}")


def check_estimator_flags(cfg, args, parser):
    """The flags one estimator reads and another ignores, by the table's `inputs` (rl.ESTIMATORS; "values": a
    critic)."""
    name, est = cfg.advantage_estimator, cfg.estimator
    users = {k: ", ".join(n for n, e in rl.ESTIMATORS.items() if k in e.inputs) for k in ("values", "gamma", "lambd")}
    if "values" in est.inputs and not (args.critic_lr or 0) > 0:
        parser.error(f"--advantage-estimator {name} needs a critic: give --critic-lr (e.g. 1e-4)")
    if args.critic_lr is not None and "values" not in est.inputs:
        parser.error(f"--critic-lr is only used by --advantage-estimator {users['values']}, not {name}")
    if "lambd" not in est.inputs:
        unused(
            parser,
            "--lambd",
            cfg.lambd,
            TrainerConfig.lambd,
            f"with --advantage-estimator {name} (only {users['lambd']} uses it)",
        )
    if "gamma" not in est.inputs:
        unused(
            parser,
            "--gamma",
            cfg.gamma,
            TrainerConfig.gamma,
            f"with --advantage-estimator {name} (it discounts the returns of {users['gamma']} only)",
        )
    if cfg.disable_grpo_std_normalization and "std_normalize" not in est.inputs:
        parser.error(
            f"--disable-grpo-std-normalization has no effect with --advantage-estimator {name} "
            f"({', '.join(n for n, e in rl.ESTIMATORS.items() if 'std_normalize' in e.inputs)})"
        )
    if cfg.normalize_advantages and est.whitened:
        parser.error(f"--normalize-advantages with --advantage-estimator {name}: its advantages are already whitened")
    if cfg.eps_clip_c is not None and est.loss == "cispo":
        parser.error(
            f"--eps-clip-c (dual clip) has no meaning with --advantage-estimator {name}: "
            f"its weights are already clipped"
        )


@dataclass(frozen=True)
class ExtraModels:
    """The models RL options add beside the policy, None when off: the frozen reference (KL), the critic and its
    optimizer (ppo), the teacher (OPD)."""

    ref_model: object = None
    critic: object = None
    critic_optimizer: object = None
    teacher: object = None


@dataclass(frozen=True)
class DataParallel:
    """The training ranks: the process group they average over (None: all ranks; only --async gives the trainers a
    group of their own), how many they are, and whether there are several (torch.distributed is on)."""

    process_group: object = None
    world: int = 1
    distributed: bool = False


class Trainer:
    """
    One RL training step on this rank's share of a rollout. Holds the policy and its optimizer, the extra models of
    the options that are on (ExtraModels) and the training ranks it averages over (DataParallel).
    """

    def __init__(self, cfg, model, optimizer, device, extras=ExtraModels(), data_parallel=DataParallel()):
        self.cfg, self.model, self.optimizer, self.device = cfg, model, optimizer, device
        self.ref_model, self.critic, self.teacher = extras.ref_model, extras.critic, extras.teacher
        self.critic_optimizer = extras.critic_optimizer
        dp = data_parallel
        self.process_group, self.world, self.distributed = dp.process_group, dp.world, dp.distributed
        self.autocast = autocast_ctx(device.type)
        self.loss_cfg = rl.LossConfig(
            kind=cfg.estimator.loss,
            eps_clip=cfg.eps_clip,
            eps_clip_high=cfg.eps_clip_high,
            eps_clip_c=cfg.eps_clip_c,
            loss_agg=cfg.loss_aggregation,
            max_len=cfg.group.max_response_len,
            entropy_coef=cfg.entropy_coef,
            kl_type=cfg.kl_loss_type,
            kl_coef=cfg.kl_loss_coef,
        )

    # --- forward passes over samples, micro-batched like the training step -----------------------

    def micro_batches(self, samples, model):
        """The samples packed into micro-batches (collate_packed), rows no longer than `model`'s context. The model
        runs on the packed rows; the loss reads per-sample (B, T) rows, unpacked from its outputs."""
        max_tokens = self.cfg.max_tokens_per_gpu
        batches = [
            collate_packed(samples, rows, self.device)
            for rows in pack_micro_batches(samples, max_tokens, min(max_tokens, model.config.sequence_len))
        ]
        if is_sharded(model) and self.distributed:
            # every forward/backward of a sharded model gathers weights with the other ranks: all must run as many
            # micro-batches; a rank with fewer repeats its last one as a "dummy" (run, never counted)
            n = torch.tensor(len(batches), device=self.device)
            dist.all_reduce(n, op=dist.ReduceOp.MAX, group=self.process_group)
            batches += [{**batches[-1], "dummy": True}] * (int(n) - len(batches))
        return batches

    def forward_logp(self, model, batch):
        """Log-probs and entropies at the rollout temperature (the engine records its log-probs at that temperature),
        per sample (B, T)."""
        with self.autocast:
            logp, ent = model.token_logprobs(
                batch["packed_inputs"],
                batch["packed_targets"].clamp(min=0),
                doc_ids=batch["doc_ids"],
                temperature=self.cfg.group.temperature,
                return_entropy=True,
            )
        return unpack(logp.float(), batch["unpack"]), unpack(ent.float(), batch["unpack"])

    def forward_values(self, batch):
        with self.autocast:
            return unpack(self.critic(batch["packed_inputs"], doc_ids=batch["doc_ids"]).float(), batch["unpack"])

    @torch.no_grad()
    def per_token(self, samples, fn, model):
        """fn(batch) -> (B, T) for every micro-batch of `model`; the rows, in sample order, on the compute device."""
        out = [None] * len(samples)
        for batch in self.micro_batches(samples, model):
            res = fn(batch)
            for j, i in enumerate(batch["order"] if not batch.get("dummy") else []):
                out[i] = res[j]
        return out

    def logp_of(self, model, samples):
        return self.per_token(samples, lambda batch: self.forward_logp(model, batch)[0], model)

    def values_of(self, samples):
        return self.per_token(samples, self.forward_values, self.model)  # the critic is a copy of the policy

    # --- rewards and advantages -------------------------------------------------------------------

    def shape_rewards(self, samples):
        """DAPO overlong penalty and truncated-sample masking, on the samples in place."""
        cfg = self.cfg
        if cfg.overlong_buffer_len > 0:
            lens = torch.tensor([s.response_length for s in samples], dtype=torch.float32)
            pen = rl.overlong_penalty(
                lens, cfg.group.max_response_len, cfg.overlong_buffer_len, cfg.overlong_penalty_factor
            )
            for s, p in zip(samples, pen.tolist()):
                s.reward = (
                    {**s.reward, "overlong": p, "total": s.reward["total"] + p}
                    if isinstance(s.reward, dict)
                    else s.reward + p
                )
        if cfg.mask_truncated_samples:
            for s in samples:
                if s.status == TRUNCATED:
                    s.loss_mask = [0] * s.response_length

    def compute_advantages(self, samples, old_lp, ref_lp, old_values):
        """
        Per-sample per-token advantages (list of 1-D tensors on the compute device, aligned like collate()) by
        the estimator's row of rl.ESTIMATORS, and for ppo the critic's targets (returns); None otherwise. Built on
        the compute device: the whitening all-reduces them, and NCCL takes only CUDA tensors.
        """
        cfg = self.cfg
        mask = collate(samples, self.device)["loss_mask"]
        T = mask.size(1)
        rewards = torch.tensor([s.scalar_reward() for s in samples], dtype=torch.float32, device=self.device)
        dist_group = (self.process_group if self.process_group is not None else True) if self.distributed else False
        kl = None
        if ref_lp is not None and cfg.kl_coef > 0:
            kl = rl.kl_estimate(pad_like(old_lp, T), pad_like(ref_lp, T), "k1") * mask
        inputs = dict(
            group_size=cfg.group.n_samples_per_prompt,
            kl=kl,
            kl_coef=cfg.kl_coef,
            std_normalize=not cfg.disable_grpo_std_normalization,
            gamma=cfg.gamma,
            lambd=cfg.lambd,
            values=pad_like(old_values, T) if old_values is not None else None,
            distributed=dist_group,
        )
        # exactly the inputs the estimator takes (its row names them): a name it lacks would raise, not be dropped
        adv, returns = cfg.estimator.advantages(rewards, mask, **{k: inputs[k] for k in cfg.estimator.inputs})
        if cfg.normalize_advantages:
            adv = rl.masked_whiten(adv, mask, distributed=dist_group) * mask
        if self.teacher is not None:  # on-policy distillation: tokens the teacher likes more get pushed up
            s_lp, t_lp = pad_like(old_lp, T), pad_like(self.logp_of(self.teacher, samples), T)
            adv = rl.opd_adjust(adv, s_lp, t_lp, mask, cfg.opd_kl_coef)
            self.opd_kl = rl.masked_mean(s_lp - t_lp, mask).item()
        return list(adv), (list(returns) if returns is not None else None)

    # --- the step ---------------------------------------------------------------------------------

    def train_step(self, done, samples, timer):
        """Shape rewards, compute advantages, take --num-steps-per-rollout optimizer steps -> metrics (this rank's).
        done: the rollouts trained on before this one (the LR schedule's position)."""
        cfg = self.cfg
        bad = next((s for s in samples if len(s.rollout_log_probs) != s.response_length), None)
        if cfg.use_tis and bad is not None:  # TIS compares against the sampler's log-probs: without them it is garbage
            raise SystemExit(
                f"--use-tis needs the rollout's log-probs, but a sample ({bad.metadata}) has {len(bad.rollout_log_probs)} for "
                f"{bad.response_length} response tokens: --custom-generate-function-path must fill Sample.rollout_log_probs"
            )
        self.shape_rewards(samples)
        ref_lp = old_lp = old_values = None
        if self.ref_model is not None:
            with timer.section("ref", self.device.type):
                ref_lp = self.logp_of(self.ref_model, samples)
        # the policy before this rollout's first update: the ratio's denominator off-policy, the KL penalty's and OPD's
        # student; on-policy (one step) the first micro-batch pass gives it for free, so it is only computed when needed
        if cfg.num_steps_per_rollout > 1 or cfg.kl_coef > 0 or self.teacher is not None:
            with timer.section("old_logp", self.device.type):
                old_lp = self.logp_of(self.model, samples)
        if self.critic is not None:
            with timer.section("values", self.device.type):
                old_values = self.values_of(samples)
        self.opd_kl = None
        with timer.section("advantages", self.device.type):
            adv, returns = self.compute_advantages(samples, old_lp, ref_lp, old_values)
        lr_mult = min(1.0, (done + 1) / cfg.warmup_rollouts) if cfg.warmup_rollouts > 0 else 1.0
        if cfg.lr_decay_style == "linear":
            lr_mult *= 1.0 - done / cfg.num_rollouts
        # the rollout cut into mini-batches of whole groups of n, all of it (an agent's group may be several: agents.py)
        steps, n = cfg.num_steps_per_rollout, cfg.group.n_samples_per_prompt
        edges = [k * (len(samples) // n) // steps * n for k in range(steps)] + [len(samples)]
        off_policy = steps > 1
        results = []
        with timer.section("train", self.device.type):
            for k in range(steps):
                sl = slice(edges[k], edges[k + 1])
                pick = lambda rows: rows[sl] if rows is not None else None
                results.append(
                    self.train_minibatch(
                        samples[sl],
                        adv[sl],
                        pick(old_lp) if off_policy else None,
                        pick(ref_lp),
                        lr_mult,
                        pick(returns),
                        pick(old_values),
                    )
                )
        metrics = {f"train/{k}": sum(r[k] for r in results) / len(results) for k in results[0]}
        metrics["train/first_step_ppo_kl"] = results[0].get("ppo_kl", 0.0)
        if self.opd_kl is not None:
            metrics["train/opd_student_teacher_kl"] = self.opd_kl
        A = torch.stack(adv)
        first = (A != 0).to(torch.int64).argmax(-1)  # each sample's advantage at its first trained token
        seq_adv = A.gather(1, first[:, None]).squeeze(1).cpu()
        metrics.update(
            {
                "rollout/adv_mean": seq_adv.mean().item(),
                "rollout/adv_std": seq_adv.std().item() if len(seq_adv) > 1 else 0.0,
                "rollout/adv_abs_max": seq_adv.abs().max().item(),
            }
        )
        return metrics

    def train_minibatch(self, samples, adv, old_lp, ref_lp, lr_mult, returns=None, old_values=None):
        """One optimizer step over `samples` (this rank's share of the global batch); with ppo, one critic step too.
        old_lp None = on-policy: the ratio's denominator is this very forward, detached."""
        cfg, model, device = self.cfg, self.model, self.device
        model.train()
        local_tok = sum(sum(s.loss_mask) for s in samples)
        counts = torch.tensor([local_tok, len(samples)], dtype=torch.float64, device=device)
        if self.distributed:
            dist.all_reduce(counts, group=self.process_group)
        global_tok, global_seq = max(counts[0].item(), 1.0), counts[1].item()
        sums, positions = {}, 0
        for batch in self.micro_batches(samples, model):
            if batch.get("dummy"):  # (FSDP) a zero loss through the whole model: its gathers and gradient reductions
                (self.forward_logp(model, batch)[0].sum() * 0).backward()
                continue
            mb, T, mask = batch["order"], batch["inputs"].size(1), batch["loss_mask"]
            positions += batch["packed_inputs"].numel()
            rows = lambda xs: pad_like([xs[i] for i in mb], T)
            logp, ent = self.forward_logp(model, batch)
            old = rows(old_lp) if old_lp is not None else logp.detach()
            tis = None
            if cfg.use_tis:
                tis, tis_metrics = rl.tis_weights(
                    old, batch["rollout_logp"], mask, cfg.tis_clip, cfg.tis_clip_low, cfg.tis_mode
                )
            ref = rows(ref_lp) if ref_lp else None
            loss, metrics = rl.policy_loss(logp, old, rows(adv), mask, self.loss_cfg, tis, ent, ref)
            if tis is not None:
                metrics.update(tis_metrics)
            # each micro-batch's loss is re-weighted to its share of the global batch, by the aggregation's own unit
            # (tokens for token_mean, rows for the sequence means), and x world because the optimizer averages
            # gradients over the training ranks: the step equals one pass over the whole batch, however it is cut
            mb_tok = mask.sum().item()
            share = (mb_tok / global_tok) if cfg.loss_aggregation == "token_mean" else (len(mb) / global_seq)
            (loss * share * self.world).backward()
            if self.critic is not None:
                values = self.forward_values(batch)
                vf_loss, vm = rl.value_loss(
                    values,
                    rows(old_values),
                    rows(returns),
                    mask,
                    cfg.value_clip or None,
                    loss_agg=cfg.loss_aggregation,
                    max_len=cfg.group.max_response_len,
                )
                (vf_loss * share * self.world).backward()
                metrics.update(vm, vf_loss=vf_loss.detach())
            metrics["entropy"] = rl.masked_mean(ent.detach(), mask)
            metrics["train_rollout_logprob_abs_diff"] = rl.masked_mean(
                (logp.detach() - batch["rollout_logp"]).abs(), mask
            )
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v) * mb_tok
        out = {k: v / max(local_tok, 1) for k, v in sums.items()}
        out["padding_frac"] = 1 - sum(len(s.tokens) - 1 for s in samples) / max(
            positions, 1
        )  # of the positions the model ran
        out["grad_norm"] = self.optimizer_step(model, self.optimizer, lr_mult)
        if self.critic is not None:
            out["critic_grad_norm"] = self.optimizer_step(self.critic, self.critic_optimizer, 1.0)
        return out

    def optimizer_step(self, module, optimizer, lr_mult):
        """Average gradients over the training ranks, clip the global norm, step -> the norm before clipping."""
        optimizer.average_gradients(self.process_group)
        params = [p for p in module.parameters() if p.grad is not None]
        if self.cfg.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)
        else:
            norm = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in params))
        for g in optimizer.param_groups:
            g["lr"] = g["initial_lr"] * lr_mult
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(norm)


# -----------------------------------------------------------------------------------------------
# packing samples into micro-batches


def pack_rows(sizes, capacity):
    """First-fit, largest first: lists of indices whose sizes add up to at most capacity (a larger one alone)."""
    rows, load = [], []
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        r = next((r for r in range(len(rows)) if load[r] + sizes[i] <= capacity), len(rows))
        if r == len(rows):
            rows.append([])
            load.append(0)
        rows[r].append(i)
        load[r] += sizes[i]
    return rows


def pack_micro_batches(samples, max_tokens, row_len):
    """
    Pack samples into rows and rows into micro-batches. A sample takes len(tokens) - 1 positions (its inputs);
    rows hold whole samples end to end, at most row_len positions each, and a micro-batch is rows of at most
    max_tokens positions in all (rows x its longest row). Rows are as few as first-fit makes them, then evened
    out (the capacity lowered to near the mean, as long as no row is added): a micro-batch runs as long as its
    longest row, so a short last row would be padded. A sample longer than row_len gets a row of its own, a row
    longer than max_tokens a micro-batch of its own. Returns micro-batches as lists of rows, rows as lists of
    sample indices.
    """
    size = [len(s.tokens) - 1 for s in samples]
    rows = pack_rows(size, row_len)
    cap = -(-sum(size) // max(len(rows), 1))
    while cap < row_len:
        even = pack_rows(size, cap)
        if len(even) <= len(rows):
            rows = even
            break
        cap += max(1, cap // 32)
    load = [sum(size[i] for i in row) for row in rows]
    batches, cur = [], []
    for r in sorted(range(len(rows)), key=lambda r: -load[r]):  # the first row of a micro-batch is its longest
        if cur and load[cur[0]] * (len(cur) + 1) > max_tokens:
            batches.append(cur)
            cur = []
        cur.append(r)
    if cur:
        batches.append(cur)
    return [[rows[r] for r in mb] for mb in batches]


# -----------------------------------------------------------------------------------------------
# tensors


def collate(samples, device="cpu", pad_id=0):
    """
    Samples -> padded (B, T) tensors aligned for next-token prediction: position t predicts token t+1.
    loss_mask is 1 exactly on the response tokens the model wrote (tool outputs and prompt excluded),
    rollout_logp holds the sampler's log-prob at those positions. targets are -1 where not trained.
    """
    T = max(len(s.tokens) for s in samples) - 1
    B = len(samples)
    inputs = torch.full((B, T), pad_id, dtype=torch.long)
    targets = torch.full((B, T), -1, dtype=torch.long)
    loss_mask = torch.zeros(B, T)
    rollout_logp = torch.zeros(B, T)
    for b, s in enumerate(samples):
        n, P, R = len(s.tokens), s.prompt_length, s.response_length
        inputs[b, : n - 1] = torch.tensor(s.tokens[:-1])
        resp = slice(P - 1, P - 1 + R)
        targets[b, resp] = torch.tensor(s.tokens[P:])
        loss_mask[b, resp] = torch.tensor(s.loss_mask, dtype=torch.float32)
        if s.rollout_log_probs:
            rollout_logp[b, resp] = torch.tensor(s.rollout_log_probs, dtype=torch.float32)
    return {
        "inputs": inputs.to(device),
        "targets": targets.to(device),
        "loss_mask": loss_mask.to(device),
        "rollout_logp": rollout_logp.to(device),
    }


def collate_packed(samples, rows, device="cpu", pad_id=0):
    """
    One micro-batch of rows (lists of sample indices, from pack_micro_batches) -> collate() of its samples, in
    row order, plus the packed tensors the model runs on: packed_inputs/packed_targets (R, L), the samples of
    each row end to end and padding after them, and doc_ids numbering the samples of a row (the padding is one
    more document), so that positions restart and attention stays within each sample. "unpack" (B, T) gives
    each per-sample position's index into the flattened (R, L) tensors, -1 past the sample's end: unpack()
    turns the model's packed per-token outputs back into collate()'s per-sample layout.
    """
    order = [i for row in rows for i in row]
    batch = collate([samples[i] for i in order], pad_id=pad_id)
    sizes = [len(samples[i].tokens) - 1 for i in order]
    R, L = len(rows), max(sum(len(samples[i].tokens) - 1 for i in row) for row in rows)  # L: the longest row
    inputs = torch.full((R, L), pad_id, dtype=torch.long)
    targets = torch.full((R, L), -1, dtype=torch.long)
    doc_ids = torch.zeros((R, L), dtype=torch.long)
    index = torch.full(batch["inputs"].shape, -1, dtype=torch.long)
    b = 0
    for r, row in enumerate(rows):
        pos = 0
        for doc in range(len(row)):
            n = sizes[b]
            inputs[r, pos : pos + n] = batch["inputs"][b, :n]
            targets[r, pos : pos + n] = batch["targets"][b, :n]
            doc_ids[r, pos : pos + n] = doc
            index[b, :n] = torch.arange(r * L + pos, r * L + pos + n)
            pos, b = pos + n, b + 1
        doc_ids[r, pos:] = len(row)
    batch.update(packed_inputs=inputs, packed_targets=targets, doc_ids=doc_ids, unpack=index, order=order)
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


def unpack(packed, index):
    """Packed per-token values (R, L) -> per-sample rows (B, T) by collate_packed's index; 0 past a sample's end."""
    return packed.reshape(-1)[index.clamp(min=0)].masked_fill(index < 0, 0.0)


def pad_like(rows, T):
    """Per-sample 1-D tensors -> (B, T), cut or zero-padded on the right."""
    return torch.stack([torch.nn.functional.pad(r[:T], (0, T - min(len(r), T))) for r in rows])
