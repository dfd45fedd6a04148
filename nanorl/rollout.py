"""
Rollout machinery for RL: the Sample record, the prompt source, dynamic sampling with over-sampling,
the surplus buffer, and packing samples into training micro-batches.

The flow of one rollout (see scripts/chat_rl.py):
  prompts (PromptSource) -> n samples each (engine or a custom generate function) -> rewards
  -> dynamic-sampling filter keeps whole groups -> surplus groups wait in the buffer for the next rollout
"""
import importlib
import importlib.util
import inspect
import os
import random
from dataclasses import dataclass, field, asdict

import torch

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


# -----------------------------------------------------------------------------------------------
# prompts

class PromptSource:
    """
    Prompts (conversation, label, metadata) from a task, reshuffled every epoch with a seed; each DDP
    rank walks its own strided shard. state_dict() makes a resumed run continue on the exact next prompt.
    """
    def __init__(self, items, seed=0, rank=0, world_size=1, shuffle=True):
        if not items:
            raise ValueError("the prompt source is empty: the RL task gave no prompts")
        self.items = items
        self.seed, self.rank, self.world_size, self.shuffle = seed, rank, world_size, shuffle
        self.epoch, self.offset = 0, 0
        self._order = self._make_order()

    def _make_order(self):
        order = list(range(len(self.items)))
        if self.shuffle:
            random.Random(self.seed * 1000003 + self.epoch).shuffle(order)
        return order[self.rank::self.world_size]

    def get(self, n):
        """The next n prompts of this rank. self.last_keys holds a key per prompt that is the same whichever
        rank serves it (epoch, position in the global order): seeding by it makes a run on k ranks sample
        exactly what a run on one rank samples."""
        out, self.last_keys = [], []
        while len(out) < n:
            if self.offset >= len(self._order):
                self.epoch, self.offset = self.epoch + 1, 0
                self._order = self._make_order()
            out.append(self.items[self._order[self.offset]])
            self.last_keys.append((self.epoch, self.offset * self.world_size + self.rank))
            self.offset += 1
        return out

    def state_dict(self):
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed}

    def load_state_dict(self, state):
        self.epoch, self.offset, self.seed = state["epoch"], state["offset"], state["seed"]
        self._order = self._make_order()


# -----------------------------------------------------------------------------------------------
# user-supplied functions: "module:function" or "path/to/file.py:function"

def load_function(path, expected_params, flag):
    """Import a user function and check its signature before any GPU work starts."""
    if ":" not in path:
        raise ValueError(f"{flag} {path!r}: expected 'module:function' or 'file.py:function'")
    mod_name, fn_name = path.rsplit(":", 1)
    try:
        if mod_name.endswith(".py") or os.path.sep in mod_name:
            spec = importlib.util.spec_from_file_location(os.path.basename(mod_name)[:-3], mod_name)
            if spec is None:
                raise ImportError(f"no such file {mod_name}")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(mod_name)
    except Exception as e:
        raise ValueError(f"{flag} {path!r}: could not import {mod_name!r} ({type(e).__name__}: {e})") from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"{flag} {path!r}: {mod_name!r} has no function {fn_name!r}; expected {fn_name}({', '.join(expected_params)})")
    try:
        inspect.signature(fn).bind(*expected_params)
    except TypeError as e:
        raise ValueError(f"{flag} {path!r}: wrong signature {inspect.signature(fn)}; expected {fn_name}({', '.join(expected_params)})") from e
    return fn


# -----------------------------------------------------------------------------------------------
# dynamic sampling

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
    `partial` holds the groups a partial rollout aborted mid-generation, to be continued first next time."""
    def __init__(self, buffer_filter=pop_first):
        self.groups, self.partial = [], []
        self.buffer_filter = buffer_filter

    def add(self, groups):
        self.groups.extend(groups)

    def pop(self, n):
        taken, self.groups = self.buffer_filter(self.groups, n)
        return taken

    def __len__(self):
        return len(self.groups)

    def take_partial(self):
        taken, self.partial = self.partial, []
        return taken

    def state_dict(self):
        return {"groups": [[s.to_dict() for s in g] for g in self.groups],
                "partial": [[s.to_dict() for s in g] for g in self.partial]}

    def load_state_dict(self, state):
        self.groups = [[Sample(**d) for d in g] for g in state["groups"]]
        self.partial = [[Sample(**d) for d in g] for g in state.get("partial", [])]


def extend_sample(s, completion, python_start=None, output_end=None):
    """Append an engine Completion to a Sample. An aborted one keeps only what can be continued exactly: if it
    stopped inside a tool call (the call's forced output not all fed in), the call is cut and the model redoes it."""
    s.tokens += completion.tokens
    s.response_length += len(completion.tokens)
    s.loss_mask += completion.mask
    s.rollout_log_probs += completion.logprobs
    s.status = completion.status
    if s.status == ABORTED:
        response = s.tokens[s.prompt_length:]
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


def fill_rollout(target_groups, buffer, make_groups, group_filter, max_rounds=8, stop_when_full=False):
    """
    Collect `target_groups` groups that pass `group_filter`: first from the buffer (surplus of the last
    rollout), then by calling make_groups() (which over-samples a batch of prompts) until full.
    Surplus goes back to the buffer. If max_rounds of over-sampling still leave the batch short (a model
    that gets everything wrong early in training), the batch is topped up with dropped groups rather than
    looping forever, and stats["groups_unfiltered_fill"] says how many.
    stop_when_full (partial rollouts): make_groups() yields groups as they finish; once the batch is full the
    round is closed, which aborts and parks what is still generating.
    Returns (groups, stats) where stats counts what was dropped and why.
    """
    stats = {"groups_generated": 0, "groups_from_buffer": 0, "groups_dropped": 0, "rounds": 0, "groups_unfiltered_fill": 0}
    kept, dropped = [], []
    for g in buffer.pop(target_groups):
        stats["groups_from_buffer"] += 1
        kept.append(g)
    while len(kept) < target_groups and stats["rounds"] < max_rounds:
        stats["rounds"] += 1
        groups = make_groups()
        try:
            for g in groups:
                stats["groups_generated"] += 1
                keep, reason = group_filter(g)
                if keep:
                    kept.append(g)
                else:
                    dropped.append(g)
                    stats["groups_dropped"] += 1
                    key = f"dropped_{reason or 'filter'}"
                    stats[key] = stats.get(key, 0) + 1
                if stop_when_full and len(kept) >= target_groups:
                    break
        finally:
            if hasattr(groups, "close"):  # a generator: closing it aborts and parks what is in flight
                groups.close()
    if len(kept) < target_groups:
        fill = dropped[:target_groups - len(kept)]
        stats["groups_unfiltered_fill"] = len(fill)
        stats["groups_dropped"] -= len(fill)
        kept.extend(fill)
    buffer.add(kept[target_groups:])
    return kept[:target_groups], stats


# -----------------------------------------------------------------------------------------------
# rewards

def set_rewards(groups, scored, results, on_failure="drop"):
    """
    Give the samples `scored` (drawn from `groups`) their rewards from `results`, a (value, error) pair each.
    A failed reward (value None) is never trained on with on_failure="drop": its loss mask is zeroed and it
    takes the mean reward of its group's good samples, so its advantage is 0 and the others' baseline is not
    biased. With on_failure="zero" it is an ordinary sample with reward 0.0. Returns the failed samples;
    each carries its error in metadata["reward_error"].
    """
    if on_failure not in ("drop", "zero"):
        raise ValueError(f"on_failure must be 'drop' or 'zero', got {on_failure!r}")
    failed = []
    for s, (value, err) in zip(scored, results, strict=True):
        if value is None:
            failed.append(s)
            s.metadata["reward_error"] = err
            if on_failure == "zero":
                value = 0.0
            else:
                s.loss_mask = [0] * s.response_length
        s.reward = value
    for group in groups:
        valid = [s.scalar_reward() for s in group if s.reward is not None]
        fill = sum(valid) / len(valid) if valid else 0.0
        for s in group:
            if s.reward is None:
                s.reward = fill
    return failed


# -----------------------------------------------------------------------------------------------
# training batches

def pack_micro_batches(samples, max_tokens):
    """
    Split samples into micro-batches whose padded size (rows x longest row) stays within max_tokens.
    Samples are sorted by length first so each micro-batch holds similar lengths and padding stays small
    (rows are padded, not packed: padded causal attention runs the fast flash kernel on GPUs).
    A sample longer than max_tokens gets a micro-batch of its own. Returns lists of sample indices.
    """
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].tokens))
    batches, cur = [], []
    for i in order:
        longest = max([len(samples[j].tokens) for j in cur] + [len(samples[i].tokens)])
        if cur and longest * (len(cur) + 1) > max_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


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
        inputs[b, :n - 1] = torch.tensor(s.tokens[:-1])
        resp = slice(P - 1, P - 1 + R)
        targets[b, resp] = torch.tensor(s.tokens[P:])
        loss_mask[b, resp] = torch.tensor(s.loss_mask, dtype=torch.float32)
        if s.rollout_log_probs:
            rollout_logp[b, resp] = torch.tensor(s.rollout_log_probs, dtype=torch.float32)
    return {"inputs": inputs.to(device), "targets": targets.to(device),
            "loss_mask": loss_mask.to(device), "rollout_logp": rollout_logp.to(device)}
