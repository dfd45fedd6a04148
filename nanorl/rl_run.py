"""
One RL run of scripts/chat_rl.py as an object: RLRun holds its state (the policy and its optimizer, the engine, the
rollout worker, the trainer with its critic, the prompt source, the surplus buffer, the history) and does what the
script's loop names: sample a rollout, train on it, update the engine's weights, evaluate, save, resume.

    run = RLRun(...)                     # built by scripts/chat_rl.py from its flags
    start = run.resume()                 # or 0: the rollouts done
    for done in range(start, run.cfg.num_rollouts):
        run.step(done)                   # rollout done+1: sample -> train -> update weights -> the step line
        ...evaluate and save at their intervals

Beside it, in reading order: the run's config, the extra models RL options build (the ppo critic, the distillation
teacher), the deadline of a rollout or an eval (SIGALRM), what the run is built from (its models, what it samples
with, its ranks), the held-out pass@k and what the run prints (the step line, its legend, the summary). The --async
roles and what travels between them are in nanorl/rl_async.py; the script holds the loops.
"""

import os
import signal
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nanorl import checkpoint, fsdp, lora, rl, rl_async
from nanorl.checkpoint import rng_state, set_rng_state
from nanorl.common import mean_over_ranks
from nanorl.gpt import Critic
from nanorl.logger import ETA, Timer, print0, write_json
from nanorl.model_loading import load_model, load_model_dir
from nanorl.optim import MuonAdamW
from nanorl.report import load_json, write_dir
from nanorl.rl_config import GroupSpec
from nanorl.rollout import RolloutFill


@dataclass
class RunConfig:
    """What the run's own loop reads (the rollout worker and the trainer have their configs). The defaults are
    chat_rl's flag defaults."""

    num_rollouts: int = 60
    rollout_batch_size: int = 16  # prompts per rollout, over all sampling ranks
    over_sampling_batch_size: int = 16  # prompts sampled per round (dynamic sampling: more than the batch)
    max_sampling_rounds: int = 8
    rollout_timeout: float = 1800  # seconds a rank's rollout or eval may take (0 = no limit)
    eval_every: int = 10
    save_every: int = 20
    keep_last: int = 2  # checkpoints kept (the newest): one is ~3x the weights, and a run saves many times
    eval_group: GroupSpec = GroupSpec(n_samples_per_prompt=4)  # samples per eval prompt, their temperature
    pass_ks: tuple = (1, 4)
    fsdp: bool = False


# -----------------------------------------------------------------------------------------------
# the models RL options add beside the policy


def build_critic(model, lr, device):
    """The critic of ppo (the policy's architecture with a value head) and its AdamW at `lr` (--critic-lr)."""
    critic = Critic(model).to(device)
    adamw = dict(kind="adamw", lr=lr, initial_lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    return critic, MuonAdamW([dict(params=list(critic.parameters()), **adamw)])


def load_teacher(spec, device):
    """--opd-teacher-load: a checkpoint directory, or source[:tag] (e.g. sft:d8); frozen."""
    if os.path.isdir(spec):
        teacher, _, _ = load_model_dir(spec, device=device)
    else:
        src, _, tag = spec.partition(":")
        teacher, _, _ = load_model(src, device, model_tag=tag or None)
    return teacher.requires_grad_(False)


# -----------------------------------------------------------------------------------------------
# the deadline of a rollout or an eval


class RolloutTimeout(BaseException):
    """Not an Exception: a reward wrapper that catches Exception must not swallow it."""


@contextmanager
def deadline(seconds, what="the rollout"):
    """Raise RolloutTimeout in this (main) thread once `seconds` have passed (0 = no limit). SIGALRM interrupts
    Python code that hangs: a reward call, a custom rollout, a tool."""

    if seconds <= 0:  # no limit: no alarm to set
        yield
        return

    def on_timeout(signum, frame):
        raise RolloutTimeout(f"{what} ran past --rollout-timeout {seconds:g}s")

    signal.signal(signal.SIGALRM, on_timeout)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


# -----------------------------------------------------------------------------------------------
# the run: what it is built from, and its state and steps


@dataclass
class Models:
    """The models of this rank, as chat_rl's build_models makes them: the policy (its tokenizer, its checkpoint's meta,
    LoRA's base or None), the engine on a sampling rank and the optimizer and trainer on a training rank (else None)."""

    model: object
    tokenizer: object
    meta: dict
    lora_base: object
    engine: object
    optimizer: object
    trainer: object


@dataclass
class Sampling:
    """What a sampling rank samples with: the rollout worker, the prompt source, the surplus buffer, the
    dynamic-sampling filter, and the held-out prompts of the eval."""

    worker: object
    source: object
    buffer: object
    group_filter: object
    eval_items: list


@dataclass
class Ranks:
    """Where this rank runs: whether torch.distributed is on, its global rank, its device and its roles."""

    ddp: bool
    rank: int
    device: object
    roles: object


@dataclass
class Share:
    """This rank's share of one rollout: its groups, their metrics (none if it failed), what failed (None: nothing)
    and the seconds it took."""

    groups: list
    metrics: dict
    failure: str | None
    seconds: float


class RLRun:
    """
    The state of one RL run on this rank and its steps. Every rank holds one; `roles` (nanorl/rl_async.py) says
    whether it samples, trains or both. engine and worker are None on a rank that only trains, trainer on one that
    only samples.
      ckpt: where and what it saves: {"dir", "tag", "meta" (the source model's), "flags" (this run's, saved as
        rl_args), "lora_base" (LoRA: where the adapters' base is, else None)}
    Numbering: `done` is the number of rollouts done before the one a method samples or trains on (synchronous RL: the
    version of the policy that samples it): step(done) runs rollout done + 1 and logs it as step done + 1. A step
    passed to evaluate, save or due counts rollouts done, as a checkpoint's step does (0: before training).
    """

    def __init__(self, cfg, models, sampling, ranks, logger, ckpt):
        self.cfg, self.logger, self.ckpt = cfg, logger, ckpt
        self.model, self.optimizer, self.engine, self.trainer = (
            models.model,
            models.optimizer,
            models.engine,
            models.trainer,
        )
        self.worker, self.source, self.buffer = sampling.worker, sampling.source, sampling.buffer
        self.group_filter, self.eval_items = sampling.group_filter, sampling.eval_items
        self.device, self.ddp, self.rank, self.roles = ranks.device, ranks.ddp, ranks.rank, ranks.roles
        self.history, self.eval_history = [], []  # one dict per step line and per eval: report/rl_history.json
        self.history_path = os.path.join(write_dir(), "rl_history.json")  # rewritten at every step line
        self.idle_s = 0.0  # seconds this rank spent waiting on other ranks instead of computing
        self.pending = None  # --async, resumed: the payload a sampler had sampled for the next step when it saved
        self.eta = ETA(0.0)

    # --- one rollout ------------------------------------------------------------------------------

    def sample_share(self, done, version):
        """This rank's share of rollout done+1, sampled by policy `version` -> Share. Dynamic sampling: rounds of
        over-sampled prompts until the filter has kept enough groups (RolloutFill). A failure or a hang past
        --rollout-timeout is caught and described (Share.failure), never left to block the other ranks."""
        cfg, worker, n_samplers = self.cfg, self.worker, self.roles.n_samplers
        self.model.eval()
        groups, fstats, failure, t0 = [], {}, None, time.time()
        try:
            with deadline(cfg.rollout_timeout):
                fill = RolloutFill(
                    cfg.rollout_batch_size // n_samplers, self.buffer, self.group_filter, cfg.max_sampling_rounds
                )
                while fill.next_round():
                    prompts, seeds = self.source.get(cfg.over_sampling_batch_size // n_samplers)
                    if worker.cfg.partial_rollout:  # each group as it finishes; once full, the rest is parked
                        worker.sample_partial(fill, prompts, seeds, version, self.buffer)
                    else:
                        for g in worker.score(worker.sample_groups(prompts, seeds, version)):
                            fill.add(g)
                groups, fstats = fill.finish()
        except (Exception, RolloutTimeout) as e:
            traceback.print_exc()
            what = worker.inflight.get("scoring") or {"prompts": worker.inflight.get("generating")}
            failure = f"rank {self.rank}: rollout {done + 1} failed: {type(e).__name__}: {e}\n  in flight: {what}"
            print(failure, file=sys.stderr, flush=True)
        worker.inflight.clear()
        seconds = time.time() - t0
        samples = [s for g in groups for s in g]
        metrics = worker.metrics(fstats, samples, seconds, self.buffer) if samples else {}
        return Share(groups, metrics, failure, seconds)

    def prompt_position(self):
        """Where the next rollout starts: the prompt source's place and the buffer (what a failed rollout is redone
        from)."""
        return self.source.state_dict(), self.buffer.state_dict()

    def rewind(self, position):
        self.source.load_state_dict(position[0])
        self.buffer.load_state_dict(position[1])

    def sample_payload(self, done, version):
        """--async: this sampler's share of rollout done+1, as it travels to the trainers (nanorl/rl_async.py)."""
        share = self.sample_share(done, version)
        return {"groups": share.groups, "failure": share.failure, "rollout_s": share.seconds, "metrics": share.metrics}

    # --- the step: training on the rollout, the engine's new weights, the step line ---------------

    def train(self, done, groups, metrics):
        """The training step on this rank's groups of rollout done+1; metrics (the rollout's) gain the trainer's, then
        everything is averaged over the training ranks."""
        samples = [s for g in groups for s in g]
        timer = Timer()
        metrics.update(self.trainer.train_step(done, samples, timer))
        metrics["rollout/max_staleness"] = max(done - s.weight_version for s in samples)  # policy versions behind
        metrics.update({f"time/{k}": v for k, v in timer.items()})
        train_s = max(timer.get("train", 1e-9), 1e-9)
        metrics["perf/train_tok_per_s"] = sum(len(s.tokens) for s in samples) / train_s
        # the ranks' names may differ (a filter that dropped groups on one rank only): the union is averaged
        if self.ddp:
            metrics = mean_over_ranks(metrics, self.device, group=self.roles.trainer_group)
        return metrics

    def update_weights(self):
        """The engine samples from its own copy of the weights (bf16 on GPUs): give it the trained ones -> timing."""
        t0 = time.time()
        if self.cfg.fsdp:  # every rank gathers the full weights, one block at a time, into its engine's copy
            return {"time/weight_gather": fsdp.gather_full_state(self.model, self.engine.model)}
        if self.engine is not None:  # (an --async trainer has none)
            self.engine.load_weights(self.model)
        return {"time/weight_sync": time.time() - t0}

    def step(self, done):
        """One synchronous RL step: sample rollout done+1 (every rank its share), train on it, update the engine's
        weights -> metrics. A rollout that failed on any rank stops the run."""
        t0 = time.time()
        before = self.prompt_position()
        share = self.sample_share(done, done)
        # every rank learns whether any rank failed (so none waits in a collective for a rank that is gone); the wait
        # here is also this rank's idle time: the other ranks were still sampling
        t_wait = time.time()
        failed = torch.tensor([float(share.failure is not None)], device=self.device)
        if self.ddp:
            dist.all_reduce(failed)
        wait = time.time() - t_wait
        if failed.item():  # a --resume redoes this rollout: the prompts and the buffer as they were before it
            self.rewind(before)
            self.stop_after_failure(done, int(failed.item()))
        metrics = self.train(done, share.groups, share.metrics)
        metrics.update(self.update_weights())
        dt = time.time() - t0
        metrics["perf/idle_frac"] = wait / dt
        self.idle_s += wait
        self.log_step(done, metrics, dt)
        return metrics

    def log_step(self, done, metrics, dt):
        """The metrics of rollout done+1 into the history and the logger; rank 0 prints its step line and writes
        report/rl_history.json."""
        self.eta.tick((done + 1) / self.cfg.num_rollouts)  # wall clock between step lines: evals and saves count
        self.history.append({"step": done + 1, **metrics})
        self.logger.log(metrics, step=done + 1)
        if self.rank == 0:  # the step line, and the report's curves, whole after every step
            episodes = self.cfg.rollout_batch_size * self.worker.cfg.group.n_samples_per_prompt  # (--agent's tail)
            line = step_line(done, self.cfg.num_rollouts, {**metrics, "dt": dt, "eta": self.eta, "episodes": episodes})
            print(line, flush=True)
            write_json({"train": self.history, "eval": self.eval_history}, self.history_path)

    def weights_checksum(self):
        return sum(p.detach().double().sum().item() for p in self.model.parameters())

    # --- eval, save, resume -----------------------------------------------------------------------

    def due(self, step, every):
        """Whether an eval or save (every N rollouts) falls after rollout `step`: at its interval, and after the last."""
        return step % every == 0 or step == self.cfg.num_rollouts

    def evaluate(self, step):
        """pass@k over the held-out prompts, each sampling rank its share, recorded at `step` (0: before training).
        A failure or hang stops the run like a failed rollout (its reward failures are not counted as the
        rollout's)."""
        cfg, roles = self.cfg, self.roles
        self.model.eval()
        items = self.eval_items[roles.sampler_rank :: roles.n_samplers]
        seeds = [10_000_000 + roles.sampler_rank + roles.n_samplers * i for i in range(len(items))]  # the global index
        where = f"rank {self.rank}: the eval at step {step}"
        local = local_pass_at_k(
            self.worker, items, seeds, cfg.eval_group, cfg.pass_ks, step, cfg.rollout_timeout, where
        )
        out, n_prompts, n_failed = reduce_pass_at_k(local, cfg.pass_ks, self.device, roles.sampler_group, self.ddp)
        if n_failed:  # --async: the trainers are not in this eval, so nothing is saved
            self.stop_after_failure(step, n_failed, every_rank=not roles.async_mode)
        passes = " | ".join(f"{k} {v:.4f}" for k, v in out.items())
        n, t = cfg.eval_group.n_samples_per_prompt, cfg.eval_group.temperature
        print0(f"step {step:05d} | eval on {n_prompts} prompts x {n} samples (T={t:g}) | {passes}")
        # step 0 is logged too, so the curves start from a "before" point
        self.eval_history.append({"step": step, **out})
        self.logger.log(out, step=step)
        return out

    def save(self, step, pending=None):
        """Every rank: the trainers' model and optimizer (the adapters alone with LoRA, shards with --fsdp) and critic,
        each sampler's prompt position, buffer and RNGs (synchronous RL: every rank is both), so that a --resume
        continues exactly. --async: a sampler also keeps `pending`, the rollout it already sampled for step+1 with the
        weights before these, which a resumed run hands to the trainers first, as the uninterrupted run does."""
        ck, roles = self.ckpt, self.roles
        # rl_args: this run's flags (meta's args are the source model's)
        meta = {**ck["meta"], "model_tag": ck["tag"], "step": step, "rl_args": ck["flags"], "world_size": roles.world}
        if ck["lora_base"]:  # the adapters alone, and where their base is
            meta["lora"] = lora.checkpoint_meta(self.model, ck["lora_base"])
        extra = rng_state(self.device)
        if roles.is_sampler:
            extra.update(source=self.source.state_dict(), buffer=self.buffer.state_dict())
        if roles.async_mode and roles.is_sampler:  # its files beside the trainers', which write weights and meta
            extra["pending"] = rl_async.payload_state(pending)
            checkpoint.save_checkpoint(ck["dir"], step, None, None, meta, extra, rank=self.rank, lead=False)
            return
        critic, lead = self.trainer.critic, self.rank == roles.first_trainer
        if critic is not None and lead:  # the same on every training rank (averaged gradients): written once
            extra.update(critic=critic.state_dict(), critic_optim=self.trainer.critic_optimizer.state_dict())
        # --fsdp: every rank writes its shards (DCP; `python -m nanorl.fsdp consolidate` makes the single file)
        checkpoint.save(
            ck["dir"], step, self.model, self.optimizer, meta, extra, self.rank, self.cfg.keep_last, lead=lead
        )

    def resume(self):
        """--resume: the latest checkpoint's model, optimizer, critic, prompt position, buffer and RNGs (an --async
        sampler: the weights and its own state, and the rollout it had sampled), and the history of the steps it had
        done (the report's curves stay whole) -> the step to continue from."""
        ck, roles = self.ckpt, self.roles
        optimizer = self.optimizer if roles.is_trainer else None  # an --async sampler: the weights alone
        last, meta, extra = checkpoint.resume(ck["dir"], self.model, optimizer, self.rank, roles.world)
        if roles.is_sampler:
            self.rewind((extra["source"], extra["buffer"]))
            self.pending = rl_async.payload_from_state(extra.get("pending"))
        if self.trainer is not None and self.trainer.critic is not None:  # in the first trainer's extra state
            shared = extra if "critic" in extra else checkpoint.load_extra(ck["dir"], last, roles.first_trainer)
            self.trainer.critic.load_state_dict(shared["critic"])
            self.trainer.critic_optimizer.load_state_dict(shared["critic_optim"])
        set_rng_state(extra, self.device)
        self.update_weights()  # the engine's copy was made from the weights before the resume
        old = meta.get("rl_args", {})
        start_flags = ("resume", "overwrite")  # how the run starts, not what it does
        changed = [
            f"{k}: {old.get(k)!r} -> {v!r}" for k, v in ck["flags"].items() if k not in start_flags and old.get(k) != v
        ]
        if changed:
            print0(f"warning: resuming with changed RL flags: {', '.join(changed)}")
        print0(f"resumed from {ck['dir']} step {last}")
        prev = load_json("rl_history", {})
        self.history = [h for h in prev.get("train", []) if h["step"] <= last]
        self.eval_history = [e for e in prev.get("eval", []) if e["step"] <= last]
        self.eta = ETA(last / self.cfg.num_rollouts)
        return last

    def stop_after_failure(self, step, n_failed, every_rank=True):
        """A rollout or eval failed somewhere: save the state before it (a --resume redoes that rollout; --async: on
        the saved weights, one version newer than the lost rollout's) and exit non-zero at once: a worker thread still
        blocked in a reward call or a tool must not hold the exit. every_rank: every rank got here (a save is
        collective)."""
        if every_rank:
            self.save(step)
            if self.ddp:  # the lead rank writes the meta that marks the step complete after the save's own barrier:
                dist.barrier()  # a rank that exited first would have torchrun kill the lead before it wrote it
        print0(f"stopped: a rollout failed on {n_failed} rank(s); saved step {step} in {self.ckpt['dir']}")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


# -----------------------------------------------------------------------------------------------
# the held-out eval: a failure or a hang on one rank is counted, not raised, so that every rank still reaches the
# all-reduce and learns of it; the run then stops


def local_pass_at_k(worker, items, seeds, group, pass_ks, version, timeout_s, where):
    """group.n_samples_per_prompt responses per prompt at group.temperature, scored (their reward failures are not
    counted as a rollout's) -> [sum over the prompts of pass@k for each k in pass_ks, number of prompts, 1.0 if it
    failed else 0.0]. A failure or a hang past timeout_s is printed with what was in flight; `where` names the rank
    and step."""
    sums, failed = [0.0] * (len(pass_ks) + 1), 0.0
    try:
        with deadline(timeout_s, "the eval"):
            groups = worker.score(worker.sample_groups(items, seeds, version, group), count_failures=False)
        correct = [[s.scalar_reward() >= 0.5 for s in g] for g in groups]
        sums = [sum(rl.pass_at_k(len(c), sum(c), k) for c in correct) for k in pass_ks] + [len(correct)]
    except (Exception, RolloutTimeout) as e:
        traceback.print_exc()
        print(f"{where} failed: {type(e).__name__}: {e}\n  in flight: {worker.inflight}", file=sys.stderr, flush=True)
        failed = 1.0
    worker.inflight.clear()
    return sums + [failed]


def reduce_pass_at_k(local, pass_ks, device, group=None, distributed=False):
    """The ranks' local_pass_at_k lists summed -> ({"eval/pass@k": mean over all prompts}, prompts, failed ranks)."""
    vec = torch.tensor(local, dtype=torch.float64, device=device)
    if distributed:
        dist.all_reduce(vec, group=group)
    out = {f"eval/pass@{k}": (vec[i] / max(vec[-2], 1)).item() for i, k in enumerate(pass_ks)}
    return out, int(vec[-2]), int(vec[-1].item())


# -----------------------------------------------------------------------------------------------
# what the run prints: the step line (its fields defined once, here, with their legend), the idle time, the summary

# name on the step line; the value it shows: a key of the step's metrics, or a function of them for a field composed
# of several; that value's format spec; what it means
STEP_FIELDS = [
    ("reward", "rollout/reward_mean", ".3f", "mean reward of the rollout's samples"),
    ("len", "rollout/response_len_mean", ".1f", "mean response length in tokens"),
    ("pg", "train/pg_loss", "+.4f", "policy-gradient loss"),
    ("clip", "train/clipfrac", ".3f", "fraction of tokens (gspo: of sequences) whose probability ratio was clipped"),
    ("ppo_kl", "train/ppo_kl", "+.2e", "mean rollout-policy minus current log-prob: how far this step's updates moved the policy"),
    ("ent", "train/entropy", ".3f", "mean entropy per token, in nats (falling fast: the policy is collapsing onto few answers)"),
    ("gnorm", "train/grad_norm", ".3f", "gradient norm before clipping"),
    ("lp_diff", "train/train_rollout_logprob_abs_diff", ".1e", "mean |trainer - sampler log-prob| per token (near 0: the engine samples the model being trained)"),
    ("pad", "train/padding_frac", ".0%", "share of padding in the training batches"),
    ("dropped", lambda metrics: int(metrics.get("rollout/groups_dropped", 0)), "", "groups removed by the dynamic-sampling filter"),
    ("dt", lambda metrics: f"{metrics['dt']:.1f}s (rollout {metrics.get('time/rollout', 0):.1f}s, waiting {metrics['perf/idle_frac']:.0%})", "", "seconds for the step (rollout: sampling and scoring; waiting: on other ranks)"),
    ("eta", "eta", "", "time left, evals and saves included"),
]  # fmt: skip
TOOL_FIELDS = ("tool_calls", "tool_errors", "max_turns_hit")  # --multi-turn's tail: tools, err, max_turns


def step_line(done, num_rollouts, metrics):
    """`step 00001/60 | reward 0.250 | len 31.5 | ...`, the line of rollout done+1: the fields of STEP_FIELDS from
    metrics (the step's, with its seconds `dt` and `eta`), then with --multi-turn the tool use per response, with
    --agent the episodes lost (raised, timed out, no number) out of the rollout's `episodes`, and the calls per
    episode."""
    fields = [(name, key(metrics) if callable(key) else metrics[key], spec) for name, key, spec, _ in STEP_FIELDS]
    line = f"step {done + 1:05d}/{num_rollouts} | " + " | ".join(f"{name} {v:{spec}}" for name, v, spec in fields)
    if f"rollout/{TOOL_FIELDS[0]}_mean" in metrics:
        calls, errors, max_turns = (metrics[f"rollout/{k}_mean"] for k in TOOL_FIELDS)
        line += f" | tools {calls:.2f} err {errors:.2f} max_turns {max_turns:.2f}"
    if "rollout/agent_lost_frac" in metrics:
        lost, episodes = round(metrics["rollout/agent_lost_frac"] * metrics["episodes"]), metrics["episodes"]
        line += f" | agent lost {lost}/{episodes} calls {metrics['rollout/agent_calls_mean']:.2f}"
    return line


def step_legend():
    """One line explaining the step line, printed at the start of a run and shown in --help."""
    return "step line: " + "; ".join(f"{name} = {what}" for name, *_, what in STEP_FIELDS)


def idle_line(idle_frac, device_type, world_size):
    """The end-of-run line of the time ranks waited on each other; None on one rank (there is no one to wait on)."""
    if world_size <= 1:
        return None
    return f"idle fraction (time a {device_type.upper()} rank waited on other ranks): " + ", ".join(
        f"{k} {v:.1%}" for k, v in idle_frac.items()
    )


def rl_summary(eval_history, checkpoint_dir, saved_step, tag):
    """The lines an RL run ends with: each eval metric (pass@k, greedy if evaluated) before -> after, in points, the
    checkpoint it saved and the command to chat with it. eval_history: [{"step", "eval/<metric>": value, ...}]."""
    lines = ["RL summary:"]
    if eval_history:
        first, last = eval_history[0], eval_history[-1]
        for key, before in first.items():
            if key.startswith("eval/") and key in last:
                after = last[key]
                lines.append(
                    f"  {key[5:]}: {before:.4f} -> {after:.4f} ({100 * (after - before):+.1f} pts, "
                    f"step {first['step']} -> {last['step']})"
                )
    else:
        lines.append("  no eval ran")
    if saved_step is None:
        lines.append(f"  nothing saved in {checkpoint_dir}")
    else:
        lines.append(f"  saved: step {saved_step} in {checkpoint_dir}")
        lines.append(f"  chat with it: python -m scripts.chat_cli -i rl -g {tag}")
    return "\n".join(lines)
