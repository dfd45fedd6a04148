"""
One rollout on one rank, the sampling side of RL: the Sample record the trainer reads, turning prompts into scored
groups of Samples (RolloutWorker), dynamic sampling with over-sampling (RolloutFill and its filters) and the surplus
buffer. The prompts and the order they are dealt in are nanorl/prompts.py's, the worker's config and flags
nanorl/rl_config.py's.

The flow of one rollout (RLRun.sample_share in nanorl/rl_run.py runs it, round by round):
  PromptSource.get -> prompts (their token ids rendered once, when the run was built) and their seeds ->
  RolloutWorker.sample_groups: n samples each (the engine, multi-turn tool calls or a custom generate function) ->
  RolloutWorker.score: rewards (the graders of nanorl/rewards.py or a remote server) -> RolloutFill: the
  dynamic-sampling filter keeps whole groups, surplus groups wait in the buffer for the next rollout.
  --partial-rollout: RolloutWorker.sample_partial scores and adds each group as it finishes.
"""

from dataclasses import asdict, dataclass, field, replace

import torch

from nanorl.engine import Completion, Request
from nanorl.multiturn import make_tool, multi_turn_generate
from nanorl.remote_rewards import remote_rewards
from nanorl.rewards import safe_reward, set_rewards

# -----------------------------------------------------------------------------------------------
# the Sample record: what the sampler fills in and the trainer reads (its tensor layout: nanorl/rl_trainer.py)

COMPLETED, TRUNCATED, ABORTED = "completed", "truncated", "aborted"


@dataclass
class Sample:
    """One response to one prompt, and everything the trainer and the logs need about it."""

    prompt: object = None  # the conversation (dict) or text the prompt came from
    tokens: list = field(default_factory=list)  # prompt ids + response ids
    response_length: int = 0
    label: object = None
    reward: object = None  # float, or a dict of components with a "total"
    loss_mask: list = field(default_factory=list)  # one per response token: 1 = model wrote it, train on it
    rollout_log_probs: list = field(default_factory=list)  # per response token, from the sampler
    status: str = COMPLETED
    weight_version: int = 0  # the policy version that generated it (off-policy bookkeeping)
    group_index: int = 0  # which prompt (group) of the rollout
    index: int = 0  # which sample of its group
    metadata: dict = field(default_factory=dict)

    @property
    def prompt_length(self):
        return len(self.tokens) - self.response_length

    def scalar_reward(self):
        return self.reward["total"] if isinstance(self.reward, dict) else self.reward

    def to_dict(self):
        return asdict(self)


def new_sample(p, seed, index, weight_version, c):
    """Response `index` to the prompt item p (nanorl/prompts.py's), sampled from `seed`: the engine Completion c."""
    return Sample(
        prompt=p.get("conversation", p.get("text")),
        tokens=list(p["prompt_ids"]) + c.tokens,
        response_length=len(c.tokens),
        label=p["label"],
        loss_mask=list(c.mask),
        rollout_log_probs=list(c.logprobs),
        status=c.status,
        weight_version=weight_version,
        index=index,
        metadata={**p["metadata"], "seed": seed},
    )


def extend_sample(s, completion, python_start=None, output_end=None):
    """Append an engine Completion to a Sample (a partial rollout's continuation). An aborted one keeps only what can
    be continued exactly: if it stopped inside a tool call (the call's forced output not all fed in), the call is cut
    and the model redoes it."""
    s.tokens += completion.tokens
    s.response_length += len(completion.tokens)
    s.loss_mask += completion.mask
    s.rollout_log_probs += completion.logprobs
    s.status = completion.status
    if s.status == ABORTED:
        response = s.tokens[s.prompt_length :]
        open_at = None
        for i, t in enumerate(response):
            if t == python_start:
                open_at = i
            elif t == output_end:
                open_at = None
        if open_at is not None:
            cut = s.response_length - open_at
            del s.tokens[-cut:], s.loss_mask[-cut:], s.rollout_log_probs[-cut:]
            s.response_length = open_at
    return s


# -----------------------------------------------------------------------------------------------
# dynamic sampling: filters, the surplus buffer, filling a rollout


def keep_nonconstant_group(group):
    """Default dynamic-sampling filter (DAPO): a group whose rewards are all equal has zero advantage
    everywhere under GRPO, so it teaches nothing; drop it. Returns (keep, reason)."""
    rewards = [s.scalar_reward() for s in group]
    if max(rewards) == min(rewards):
        return False, "all_correct" if rewards[0] > 0 else "all_wrong" if rewards[0] <= 0 else "constant"
    return True, None


def keep_all_groups(group):
    return True, None


def pop_first(buffer, n):
    """Default buffer filter: the oldest surplus groups go first."""
    return buffer[:n], buffer[n:]


class RolloutBuffer:
    """Groups generated beyond what one rollout needed, kept for the next one (nothing sampled is wasted).
    `partial` holds the groups a partial rollout aborted mid-generation, to be continued first next time. RolloutFill
    takes from `groups` through buffer_filter (the oldest first by default) and puts its surplus back."""

    def __init__(self, buffer_filter=pop_first):
        self.groups, self.partial = [], []
        self.buffer_filter = buffer_filter

    def __len__(self):
        return len(self.groups)

    def take_partial(self):
        taken, self.partial = self.partial, []
        return taken

    def state_dict(self):
        return {
            "groups": [[s.to_dict() for s in g] for g in self.groups],
            "partial": [[s.to_dict() for s in g] for g in self.partial],
        }

    def load_state_dict(self, state):
        # (checkpoints written before the GroupSpec recorded each sample's temperature: it is the run's)
        load = lambda d: Sample(**{k: v for k, v in d.items() if k != "temperature"})
        self.groups = [[load(d) for d in g] for g in state["groups"]]
        self.partial = [[load(d) for d in g] for g in state.get("partial", [])]


class RolloutFill:
    """
    Dynamic sampling's tally of one rollout on one rank: `target` groups that pass `group_filter`, first the buffer's
    surplus of the last rollout, then the groups of each round of over-sampled prompts (next_round, add) until full.
    If max_rounds still leave the batch short (a model that gets everything wrong early in training), finish() tops
    it up with dropped groups rather than looping forever (stats["groups_unfiltered_fill"] says how many); the
    surplus goes back to the buffer. stats counts what was generated, dropped and why.
    """

    COUNTS = ("groups_generated", "groups_from_buffer", "groups_dropped", "rounds", "groups_unfiltered_fill")

    def __init__(self, target, buffer, group_filter, max_rounds=8):
        self.target, self.buffer, self.group_filter, self.max_rounds = target, buffer, group_filter, max_rounds
        taken, buffer.groups = buffer.buffer_filter(buffer.groups, target)  # the buffer's surplus first
        self.kept, self.dropped = list(taken), []
        self.stats = {**dict.fromkeys(self.COUNTS, 0), "groups_from_buffer": len(self.kept)}

    def full(self):
        return len(self.kept) >= self.target

    def next_round(self):
        """Whether another round of prompts is sampled (the batch is short and rounds are left); counts it."""
        more = not self.full() and self.stats["rounds"] < self.max_rounds
        self.stats["rounds"] += more
        return more

    def add(self, g):
        """One generated group, kept or dropped by the filter."""
        self.stats["groups_generated"] += 1
        keep, reason = self.group_filter(g)
        if keep:
            self.kept.append(g)
        else:
            self.dropped.append(g)
            self.stats["groups_dropped"] += 1
            key = f"dropped_{reason or 'filter'}"
            self.stats[key] = self.stats.get(key, 0) + 1

    def finish(self):
        """-> (the rollout's groups, stats); the batch topped up if short, the surplus back in the buffer."""
        if not self.full():
            fill = self.dropped[: self.target - len(self.kept)]
            self.stats["groups_unfiltered_fill"] = len(fill)
            self.stats["groups_dropped"] -= len(fill)
            self.kept.extend(fill)
        self.buffer.groups.extend(self.kept[self.target :])
        return self.kept[: self.target], self.stats


# -----------------------------------------------------------------------------------------------
# generating and scoring groups on one rank


class RolloutWorker:
    """
    Turns prompts into scored groups of Samples on one rank. It owns the engine, the graders and two pieces of
    state: what it is working on right now (`inflight`, named in the report when a rollout fails or hangs) and how
    many rewards have failed in training rollouts (`reward_failures`).
      graders: {split: fn(response_text, label, metadata) -> float | dict}, the grader of the split a prompt came
        from (metadata["split"]); None with a remote reward
      rewards: the RewardConfig (the remote server, what a failed reward becomes)
      custom_generate: --custom-generate-function-path (or --agent's AgentRollout), called as fn(cfg, engine,
        tokenizer, prompts, seeds) with cfg.group the call's GroupSpec (the eval's for the eval) and the prompt items
        as the source deals them (their "prompt_ids" rendered); an object with a metrics(samples) method adds its
        metrics to the rollout's
    """

    def __init__(self, cfg, engine, tokenizer, graders, rewards, custom_generate=None):
        self.cfg, self.engine, self.tokenizer = cfg, engine, tokenizer
        self.graders, self.rewards, self.custom_generate = graders, rewards, custom_generate
        self.tool = make_tool(cfg.tool) if cfg.multi_turn else None
        self.inflight, self.reward_failures = {}, 0
        self.stop_tokens = {tokenizer.encode_special("<|assistant_end|>"), tokenizer.get_bos_token_id()}
        self.python_start = tokenizer.encode_special("<|python_start|>")
        self.output_end = tokenizer.encode_special("<|output_end|>")

    def request(self, prompt_ids, seed, group):
        """The engine Request for the whole group of one prompt, as `group` (a GroupSpec) says."""
        return Request(
            prompt_ids=prompt_ids,
            num_samples=group.n_samples_per_prompt,
            max_tokens=group.max_response_len,
            temperature=group.temperature,
            top_k=self.cfg.top_k,
            top_p=self.cfg.top_p,
            seed=seed,
        )

    def sample_groups(self, prompts, seeds, weight_version, group=None):
        """The default rollout: one engine call over all prompts, each fanned out to a group of samples -> groups.
        group: a GroupSpec, by default the run's (the eval passes its own)."""
        group = group or self.cfg.group
        self.inflight["generating"] = [p["metadata"] for p in prompts]
        if self.custom_generate is not None:  # its config says what to sample: the eval's n and temperature too
            cfg = replace(self.cfg, group=group)
            groups = self.custom_generate(cfg, self.engine, self.tokenizer, prompts, seeds)
            for s in (s for g in groups for s in g):
                s.weight_version = weight_version
            return groups
        reqs = [self.request(p["prompt_ids"], seed, group) for p, seed in zip(prompts, seeds)]
        if self.cfg.multi_turn:
            results = multi_turn_generate(self.engine, reqs, self.cfg.max_turns, self.tool)
        else:
            results = self.engine.submit_and_wait(reqs)
        groups = [
            [new_sample(p, seed, si, weight_version, c) for si, c in enumerate(comps)]
            for p, seed, comps in zip(prompts, seeds, results)
        ]
        if self.cfg.multi_turn:  # each response's tool calls, errors and whether it hit --max-turns
            for samples, comps in zip(groups, results):
                for s, c in zip(samples, comps):
                    s.metadata.update(c.turn_stats())
        return groups

    def sample_partial(self, fill, prompts, seeds, weight_version, buffer):
        """
        --partial-rollout: one round of prompts, each group scored and added to `fill` (a RolloutFill) as soon as all
        its samples end. Once the batch is full, what is still generating is aborted and parked in the buffer with the
        tokens it has (and the weight_version it started under): the next rollout continues it before new prompts.
        """
        group, engine = self.cfg.group, self.engine
        n = group.n_samples_per_prompt
        jobs = []  # (samples of a group, {sample index: (handle, completion index)})
        parked = [s.metadata for g in buffer.partial for s in g[:1]]
        self.inflight["generating"] = parked + [p["metadata"] for p in prompts]
        for samples in buffer.take_partial():
            handles = {}
            for s in samples:
                if s.status == ABORTED:  # continue it: same random stream, from the token it stopped at
                    req = replace(
                        self.request(list(s.tokens), s.metadata["seed"], group),
                        num_samples=1,
                        max_tokens=group.max_response_len - s.response_length,
                        first_sample=s.index,
                        start_counter=s.response_length,
                    )
                    handles[s.index] = (engine.submit(req), 0)
                s.metadata["resumed"] = s.metadata.get("resumed", 0) + (s.status == ABORTED)
            jobs.append((samples, handles))
        for p, seed in zip(prompts, seeds):
            h = engine.submit(self.request(p["prompt_ids"], seed, group))
            empty = Completion([], [], [], ABORTED, len(p["prompt_ids"]))  # nothing sampled yet: extend_sample adds it
            samples = [new_sample(p, seed, si, weight_version, empty) for si in range(n)]
            jobs.append((samples, {si: (h, si) for si in range(n)}))
        try:
            while jobs and not fill.full():
                engine.step()
                for job in [j for j in jobs if all(h.done for h, _ in j[1].values())]:
                    jobs.remove(job)
                    samples, handles = job
                    for si, (h, ci) in handles.items():
                        extend_sample(samples[si], h.completions[ci])
                    fill.add(self.score([samples])[0])
                    if fill.full():
                        break
        finally:  # the batch is full (or this failed): what is left is parked
            self.park(jobs, buffer)

    def park(self, jobs, buffer):
        """Abort the jobs still generating and park their groups in the buffer, each sample cut back to where it can
        be continued exactly."""
        if not jobs:
            return
        self.engine.abort()
        while self.engine.step():
            pass
        for samples, handles in jobs:
            for si, (h, ci) in handles.items():
                extend_sample(samples[si], h.completions[ci], self.python_start, self.output_end)
            buffer.partial.append(samples)

    def response_text(self, s):
        return self.tokenizer.decode([t for t in s.tokens[s.prompt_length :] if t not in self.stop_tokens])

    def grade(self, s, text):
        """The (value, error) of one sample's response `text` from the grader of its split; while that runs, it is
        the sample in flight."""
        self.inflight["scoring"] = {"metadata": s.metadata, "response": text[:200]}
        return safe_reward(self.graders[s.metadata["split"]], text, s.label, s.metadata)

    def score(self, groups, count_failures=True):
        """Reward every unscored sample of groups (custom generate functions may score their own). A reward that
        fails is counted (training rollouts only) and its sample dropped from training or scored 0 (--rm-failure)."""
        todo = [s for g in groups for s in g if s.reward is None]
        texts = [self.response_text(s) for s in todo]
        if self.graders is None:  # --rm-type remote: all the samples in one batched call
            r = self.rewards
            payloads = [
                {"prompt": s.prompt, "response": t, "label": s.label, "metadata": s.metadata}
                for s, t in zip(todo, texts)
            ]
            self.inflight["scoring"] = {"remote": r.rm_url, "samples": len(payloads)}
            results = remote_rewards(r.rm_url, payloads, r.rm_concurrency, r.rm_timeout, r.rm_retries)
        else:  # the graders of the splits: one sample at a time
            results = [self.grade(s, t) for s, t in zip(todo, texts)]
        self.inflight.pop("scoring", None)
        failed = set_rewards(groups, todo, results, self.rewards.rm_failure)
        if count_failures:
            self.reward_failures += len(failed)
        if failed:
            print(
                f"warning: {len(failed)}/{len(todo)} rewards failed ({self.rewards.rm_failure}), "
                f"e.g. {failed[0].metadata['reward_error']}",
                flush=True,
            )
        return groups

    def metrics(self, fstats, samples, rollout_s, buffer):
        """The rollout's metrics: the filter's counts (RolloutFill's stats), rewards, lengths, speed; parked groups
        with --partial-rollout, tool use with --multi-turn."""
        n, rewards = len(samples), [s.scalar_reward() for s in samples]
        tokens = sum(s.response_length for s in samples)
        metrics = {
            **{f"rollout/{k}": v for k, v in fstats.items()},
            "rollout/reward_mean": sum(rewards) / n,
            "rollout/reward_std": float(torch.tensor(rewards).std()) if n > 1 else 0.0,
            "rollout/response_len_mean": tokens / n,
            "rollout/truncated_frac": sum(s.status == TRUNCATED for s in samples) / n,
            "rollout/reward_failures": self.reward_failures,
            "time/rollout": rollout_s,
            "perf/rollout_tok_per_s": tokens / max(rollout_s, 1e-9),
        }
        components = [k for k in next((s.reward for s in samples if isinstance(s.reward, dict)), {}) if k != "total"]
        for k in components:
            total = sum(s.reward.get(k, 0.0) for s in samples if isinstance(s.reward, dict))
            metrics[f"rollout/reward_{k}"] = total / n
        if self.cfg.partial_rollout:
            metrics["rollout/partial_parked_groups"] = len(buffer.partial)
            metrics["rollout/partial_resumed_samples"] = sum(s.metadata.get("resumed", 0) > 0 for s in samples)
        if self.cfg.multi_turn:  # per response: tool calls, calls that errored, and whether it ran into --max-turns
            for k in ("tool_calls", "tool_errors", "max_turns_hit"):
                metrics[f"rollout/{k}_mean"] = sum(s.metadata.get(k, 0) for s in samples) / n
        if hasattr(self.custom_generate, "metrics"):  # a generate function's own counts (--agent's lost episodes)
            metrics.update(self.custom_generate.metrics(samples))
        return metrics
