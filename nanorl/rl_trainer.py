"""
The training side of RL: given a rollout's scored samples, shape the rewards, compute advantages and take the
optimizer steps. One loss path serves every estimator: the per-token policy loss (PPO clip, GSPO or CISPO),
then importance weights, aggregation, entropy and KL, all in nanorl.rl.policy_loss. Used by nanorl/rl_run.py
(synchronous and --async) and by `bench rl`, so the benchmark times exactly the step that trains. At the end, the
reward shaping, and the samples' tensor layout: packing them end to end into micro-batches of rows, and unpacking
per-token values back into one (B, T) row per sample.

The Trainer takes a TrainerConfig (nanorl/rl_config.py, with its flags).
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.utils.rnn import pad_sequence

from nanorl import rl
from nanorl.common import is_sharded
from nanorl.precision import autocast_ctx
from nanorl.rollout import TRUNCATED


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
        # the policy sharded over the ranks with FSDP2 (--fsdp, which chat_rl refuses with the options that add models)
        self.sharded = is_sharded(model) and self.distributed
        self.autocast = autocast_ctx(device.type)
        self.estimator = cfg.estimator  # its row of rl.ESTIMATORS: the advantage function, its inputs, the loss kind
        # the estimator's inputs that are the run's (kl and the critic's values come with each rollout); distributed:
        # whiten over every training rank (False: this rank alone), in their own process group where they have one
        self.advantage_inputs = dict(
            group_size=cfg.group.n_samples_per_prompt,
            kl_coef=cfg.kl_coef,
            std_normalize=not cfg.disable_grpo_std_normalization,
            gamma=cfg.gamma,
            lambd=cfg.lambd,
            distributed=(dp.process_group if dp.process_group is not None else True) if dp.distributed else False,
        )
        self.loss_cfg = rl.LossConfig(
            kind=self.estimator.loss,
            eps_clip=cfg.eps_clip,
            eps_clip_high=cfg.eps_clip_high,
            eps_clip_c=cfg.eps_clip_c,
            use_tis=cfg.use_tis,
            tis_clip=cfg.tis_clip,
            tis_clip_low=cfg.tis_clip_low,
            tis_mode=cfg.tis_mode,
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
        packed = pack_micro_batches(samples, max_tokens, min(max_tokens, model.config.sequence_len))
        batches = [collate_packed(samples, rows, self.device) for rows in packed]
        if self.sharded:
            # every forward/backward of the sharded policy gathers weights with the other ranks: all must run as many
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
        """fn(batch) -> (B, T) for every micro-batch of `model` -> one zero-padded row per sample, in sample order, on
        the compute device: (samples, their longest - 1), the rollout's layout (compute_advantages)."""
        out = [None] * len(samples)
        for batch in self.micro_batches(samples, model):
            res = fn(batch)
            for j, i in enumerate(batch["order"] if not batch.get("dummy") else []):
                out[i] = res[j]
        return pad_sequence(out, batch_first=True)  # every micro-batch is as long as its longest sample

    def logp_of(self, model, samples):
        return self.per_token(samples, lambda batch: self.forward_logp(model, batch)[0], model)

    def values_of(self, samples):
        return self.per_token(samples, self.forward_values, self.model)  # the critic is a copy of the policy

    # --- advantages -------------------------------------------------------------------------------

    def compute_advantages(self, samples, old_lp, ref_lp, old_values):
        """
        Per-token advantages (samples, their longest - 1), position t predicting token t+1 as in collate_packed, by
        the estimator's row of rl.ESTIMATORS, and for ppo the critic's targets (returns); None otherwise. old_lp,
        ref_lp, old_values: per_token's rows or None. Built on the compute device: the whitening all-reduces them,
        and NCCL takes only CUDA tensors.
        """
        mask = sample_rows(samples, [s.loss_mask for s in samples]).to(self.device)
        rewards = torch.tensor([s.scalar_reward() for s in samples], dtype=torch.float32, device=self.device)
        inputs = dict(self.advantage_inputs, kl=None, values=old_values)
        # the KL penalty in the reward: k1 per token against the reference, when there is one and the penalty is on
        if ref_lp is not None and self.cfg.kl_coef > 0:
            inputs["kl"] = rl.kl_estimate(old_lp, ref_lp, "k1") * mask
        # exactly the inputs the estimator takes (its row names them): a name it lacks would raise, not be dropped
        adv, returns = self.estimator.advantages(rewards, mask, **{k: inputs[k] for k in self.estimator.inputs})
        if self.cfg.normalize_advantages:
            adv = rl.masked_whiten(adv, mask, distributed=inputs["distributed"]) * mask
        if self.teacher is not None:  # on-policy distillation: tokens the teacher likes more get pushed up
            t_lp = self.logp_of(self.teacher, samples)
            adv = rl.opd_adjust(adv, old_lp, t_lp, mask, self.cfg.opd_kl_coef)
            self.opd_kl = rl.masked_mean(old_lp - t_lp, mask).item()
        return adv, returns

    # --- the step ---------------------------------------------------------------------------------

    def train_step(self, done, samples, timer):
        """Shape rewards, compute advantages, take --num-steps-per-rollout optimizer steps -> metrics (this rank's).
        done: the rollouts trained on before this one (the LR schedule's position)."""
        cfg = self.cfg
        if cfg.use_tis:  # TIS compares against the sampler's log-probs: without them it is garbage
            bad = next((s for s in samples if len(s.rollout_log_probs) != s.response_length), None)
            if bad is not None:
                raise SystemExit(
                    f"--use-tis needs the rollout's log-probs, but a sample ({bad.metadata}) has "
                    f"{len(bad.rollout_log_probs)} for {bad.response_length} response tokens: "
                    "--custom-generate-function-path must fill Sample.rollout_log_probs"
                )
        shape_rewards(samples, cfg)
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
        with timer.section("advantages", self.device.type):
            adv, returns = self.compute_advantages(samples, old_lp, ref_lp, old_values)
        lr_mult = min(1.0, (done + 1) / cfg.warmup_rollouts) if cfg.warmup_rollouts > 0 else 1.0
        if cfg.lr_decay_style == "linear":
            lr_mult *= 1.0 - done / cfg.num_rollouts
        # the rollout cut into mini-batches of whole groups of n, all of it (an agent's group may be several: agents.py)
        steps, n = cfg.num_steps_per_rollout, cfg.group.n_samples_per_prompt
        edges = [k * (len(samples) // n) // steps * n for k in range(steps)] + [len(samples)]
        # per sample: what the loss compares with; on-policy (one step) the ratio's denominator is the step's own forward
        # (those that are off, None, left out)
        targets = dict(adv=adv, old_lp=old_lp if steps > 1 else None, ref_lp=ref_lp, returns=returns, values=old_values)
        results = []
        with timer.section("train", self.device.type):
            for a, b in zip(edges, edges[1:]):
                picked = {name: rows[a:b] for name, rows in targets.items() if rows is not None}
                results.append(self.train_minibatch(samples[a:b], picked, lr_mult))
        metrics = {f"train/{k}": sum(r[k] for r in results) / len(results) for k in results[0]}
        metrics["train/first_step_ppo_kl"] = results[0].get("ppo_kl", 0.0)
        if self.teacher is not None:
            metrics["train/opd_student_teacher_kl"] = self.opd_kl
        first = (adv != 0).to(torch.int64).argmax(-1)  # each sample's advantage at its first trained token
        seq_adv = adv.gather(1, first[:, None]).squeeze(1).cpu()
        metrics["rollout/adv_mean"] = seq_adv.mean().item()
        metrics["rollout/adv_std"] = seq_adv.std().item() if len(seq_adv) > 1 else 0.0
        metrics["rollout/adv_abs_max"] = seq_adv.abs().max().item()
        return metrics

    def train_minibatch(self, samples, targets, lr_mult):
        """One optimizer step over `samples` (this rank's share of the global batch); with ppo, one critic step too.
        targets: per sample (rows of the rollout's layout), its advantages "adv" and, absent when off, the log-probs
        before the update "old_lp" (absent = on-policy: the ratio's denominator is this very forward, detached), the
        reference's "ref_lp", and ppo's "returns" and old "values"."""
        cfg, model = self.cfg, self.model
        model.train()
        local_tok = sum(sum(s.loss_mask) for s in samples)
        counts = torch.tensor([local_tok, len(samples)], dtype=torch.float64, device=self.device)
        if self.distributed:
            dist.all_reduce(counts, group=self.process_group)
        global_tok, global_seq = max(counts[0].item(), 1.0), counts[1].item()
        sums, positions = {}, 0
        for batch in self.micro_batches(samples, model):
            if batch.get("dummy"):  # (FSDP) a zero loss through the whole model: its gathers and gradient reductions
                (self.forward_logp(model, batch)[0].sum() * 0).backward()
                continue
            mb, mask = batch["order"], batch["loss_mask"]
            positions += batch["packed_inputs"].numel()
            rows = {name: t[mb, : mask.size(1)] for name, t in targets.items()}  # its samples, cut to its length
            logp, ent = self.forward_logp(model, batch)
            old = rows.get("old_lp", logp.detach())
            ref = rows.get("ref_lp")
            loss, metrics = rl.policy_loss(logp, old, rows["adv"], mask, self.loss_cfg, batch["rollout_logp"], ent, ref)
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
                    rows["values"],
                    rows["returns"],
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
        # the share of the positions the model ran that hold no sample
        out["padding_frac"] = 1 - sum(len(s.tokens) - 1 for s in samples) / max(positions, 1)
        out["grad_norm"] = self.optimizer_step(model, self.optimizer, lr_mult)
        if self.critic is not None:
            out["critic_grad_norm"] = self.optimizer_step(self.critic, self.critic_optimizer, 1.0)
        return out

    def optimizer_step(self, module, optimizer, lr_mult):
        """Average gradients over the training ranks, clip the global norm, step -> the norm before clipping."""
        optimizer.average_gradients(self.process_group)
        if self.cfg.grad_clip > 0:  # (clip_grad_norm_ skips the parameters without a gradient)
            norm = torch.nn.utils.clip_grad_norm_(module.parameters(), self.cfg.grad_clip)
        else:
            params = [p for p in module.parameters() if p.grad is not None]
            norm = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in params))
        for g in optimizer.param_groups:
            g["lr"] = g["initial_lr"] * lr_mult
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(norm)


# -----------------------------------------------------------------------------------------------
# rewards


def shape_rewards(samples, cfg):
    """DAPO overlong penalty and truncated-sample masking (TrainerConfig cfg), on the samples in place."""
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
    load = lambda row: sum(size[i] for i in row)
    batches = []
    for row in sorted(rows, key=load, reverse=True):  # the first row of a micro-batch is its longest
        if batches and load(batches[-1][0]) * (len(batches[-1]) + 1) <= max_tokens:
            batches[-1].append(row)
        else:
            batches.append([row])
    return batches


# -----------------------------------------------------------------------------------------------
# tensors


def collate_packed(samples, rows, device="cpu", pad_id=0):
    """
    One micro-batch of rows (lists of sample indices, from pack_micro_batches) -> the tensors the model runs on and
    those the loss reads. A sample of n tokens takes n - 1 positions, position t predicting token t+1. The model runs
    on packed (R, L) tensors: packed_inputs and packed_targets (-1 where not trained), the samples of each row end to
    end and padding after them, and doc_ids numbering the samples of a row (the padding is one more document), so
    that positions restart and attention stays within each sample. The loss reads per-sample rows (B, T), the
    samples in row order ("order") (sample_rows): loss_mask, 1 exactly on the response tokens the model wrote (tool
    outputs and prompt excluded), and rollout_logp, the sampler's log-prob there. "unpack" (B, T) gives each
    per-sample position's index into the flattened (R, L) tensors, -1 past the sample's end: unpack() turns packed
    per-token values (the model's outputs) into per-sample rows. One sample per row is a plain padded batch.
    """
    order = [i for row in rows for i in row]
    R, L = len(rows), max(sum(len(samples[i].tokens) - 1 for i in row) for row in rows)  # L: the longest row
    inputs = torch.full((R, L), pad_id, dtype=torch.long)
    targets = torch.full((R, L), -1, dtype=torch.long)
    doc_ids = torch.zeros((R, L), dtype=torch.long)
    spans = []  # each sample's positions in the flattened (R, L) tensors, in row order
    for r, row in enumerate(rows):
        pos = 0
        for doc, s in enumerate([samples[i] for i in row]):
            n = len(s.tokens) - 1
            inputs[r, pos : pos + n] = torch.tensor(s.tokens[:-1])
            resp = slice(pos + n - s.response_length, pos + n)  # the response is the sample's tail
            targets[r, resp] = torch.tensor(s.tokens[s.prompt_length :])
            spans.append(torch.arange(r * L + pos, r * L + pos + n))
            pos += n
            doc_ids[r, pos:] = doc + 1  # the rest of the row: the next sample, or after the last one the padding
    index = pad_sequence(spans, batch_first=True, padding_value=-1)
    picked = [samples[i] for i in order]
    logps = [s.rollout_log_probs or [0.0] * s.response_length for s in picked]  # none from the sampler: zeros
    batch = dict(packed_inputs=inputs, packed_targets=targets, doc_ids=doc_ids, unpack=index)
    batch.update(loss_mask=sample_rows(picked, [s.loss_mask for s in picked]), rollout_logp=sample_rows(picked, logps))
    return {k: v.to(device) for k, v in batch.items()} | {"order": order}


def sample_rows(samples, values):
    """Per response token values, a list per sample -> one zero-padded float32 row per sample (B, T) at its input
    positions: position t predicts token t+1, so the response's first token is predicted at prompt_length - 1 and a
    sample of n tokens fills n - 1 positions (the rollout's layout, and the loss's rows of a micro-batch)."""
    rows = [torch.tensor([0.0] * (s.prompt_length - 1) + v, dtype=torch.float32) for s, v in zip(samples, values)]
    return pad_sequence(rows, batch_first=True)


def unpack(packed, index):
    """Packed per-token values (R, L) -> per-sample rows (B, T) by collate_packed's index; 0 past a sample's end."""
    return packed.reshape(-1)[index.clamp(min=0)].masked_fill(index < 0, 0.0)
