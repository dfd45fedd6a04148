"""
The sampling side of RL: the Sample record, the prompt source, the rollout flags, generating and scoring groups
of samples (RolloutWorker), dynamic sampling with over-sampling, the surplus buffer, and packing samples into
training micro-batches.

The flow of one rollout (see scripts/chat_rl.py):
  prompts (PromptSource) -> n samples each (engine, multi-turn tool calls or a custom generate function)
  -> rewards (a local function or a remote server) -> dynamic-sampling filter keeps whole groups
  -> surplus groups wait in the buffer for the next rollout
"""
import importlib
import importlib.util
import inspect
import json
import os
import random
import signal
from contextlib import contextmanager
from dataclasses import dataclass, field, asdict

import torch

from nanorl.common import nonneg_float, nonneg_int, number_in, positive_float, positive_int
from nanorl.engine import Request
from nanorl.errors import MissingFile
from nanorl.rewards import extract_answer, remote_rewards
from tasks import get_task

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


def task_prompts(args, task_name, split, needs_label):
    """A task's examples as RL prompts (the conversation without its answer, plus the label) and the task itself."""
    kw = {"path": args.task_path} if args.task_path else {}
    if task_name == "offline":
        kw["levels"] = tuple(int(x) for x in args.levels.split(","))
    task = get_task(task_name, split, **kw)
    items = []
    for i in range(len(task)):
        conv = task.get_example(i)
        label = conv.get("label")
        if label is None and conv["messages"][-1]["role"] == "assistant":
            ref = conv["messages"][-1]["content"]
            ref = ref if isinstance(ref, str) else "".join(p["text"] for p in ref if p["type"] == "text")
            label = extract_answer(ref)
        if label is None and needs_label:
            raise SystemExit(f"task {task_name!r} ({split}) row {i} has no label, and --rm-type {args.rm_type} needs one")
        items.append({"conversation": conv, "label": label, "metadata": {"task": task_name, "split": split, "row": i}})
    return items, task


def jsonl_prompts(args, path, split, needs_label):
    """--prompt-data: one JSON object a line; the prompt under --input-key (a string or chat messages), the label under
    --label-key. A string prompt is a user turn with --apply-chat-template, else raw text fed as is."""
    items = []
    if not os.path.isfile(path):
        raise MissingFile(f"{path} does not exist")
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt, label = row[args.input_key], row.get(args.label_key)
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
                raise SystemExit(f"--prompt-data {path} line {i}: expected a JSON object with key {args.input_key!r} ({type(e).__name__}: {e})")
            if isinstance(prompt, list):
                item = {"conversation": {"messages": prompt}}
            elif isinstance(prompt, str):
                item = {"conversation": {"messages": [{"role": "user", "content": prompt}]}} if args.apply_chat_template else {"text": prompt}
            else:
                raise SystemExit(f"--prompt-data {path} line {i}: {args.input_key!r} must be a string or a list of messages")
            if label is None and needs_label:
                raise SystemExit(f"--prompt-data {path} line {i} has no {args.label_key!r}, and --rm-type {args.rm_type} needs one")
            items.append({**item, "label": label, "metadata": {"task": os.path.basename(path), "split": split, "row": i}})
    return items, None


def load_prompts(args, needs_label):
    """The RL prompts from --task (its train split; the eval reads --eval-task's or its test split) or from the jsonl
    files --prompt-data / --eval-prompt-data -> (train items, train task), (eval items, eval task), eval name.
    A task is None for prompts from a file (no grader of its own)."""
    if args.prompt_data:
        train = jsonl_prompts(args, args.prompt_data, "train", needs_label)
        evals = jsonl_prompts(args, args.eval_prompt_data, "test", needs_label) if args.eval_prompt_data else train
        name = args.eval_prompt_data or args.prompt_data
    else:
        name = args.eval_task or args.task
        train, evals = task_prompts(args, args.task, "train", needs_label), task_prompts(args, name, "test", needs_label)
    return train, (evals[0][:args.eval_max_problems], evals[1]), name


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
            inputs[r, pos:pos + n] = batch["inputs"][b, :n]
            targets[r, pos:pos + n] = batch["targets"][b, :n]
            doc_ids[r, pos:pos + n] = doc
            index[b, :n] = torch.arange(r * L + pos, r * L + pos + n)
            pos, b = pos + n, b + 1
        doc_ids[r, pos:] = len(row)
    batch.update(packed_inputs=inputs, packed_targets=targets, doc_ids=doc_ids, unpack=index, order=order)
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


def unpack(packed, index):
    """Packed per-token values (R, L) -> per-sample rows (B, T) by collate_packed's index; 0 past a sample's end."""
    return packed.reshape(-1)[index.clamp(min=0)].masked_fill(index < 0, 0.0)


# -----------------------------------------------------------------------------------------------
# the rollout and reward flags, next to the code they configure

def add_args(parser, tools=("calculator", "python")):
    g = parser.add_argument_group("rollout (nanorl/rollout.py)")
    g.add_argument("--over-sampling-batch-size", type=positive_int, default=None, help="turns on dynamic sampling: prompts generated per "
                   "round, groups kept by the filter until the batch is full")
    g.add_argument("--dynamic-sampling-filter-path", default="nanorl.rollout:keep_nonconstant_group",
                   help="module:function(group) -> (keep, reason), used with --over-sampling-batch-size")
    g.add_argument("--max-sampling-rounds", type=positive_int, default=8, help="dynamic sampling: rounds before the batch is topped up with dropped groups")
    g.add_argument("--buffer-filter-path", default="nanorl.rollout:pop_first", help="module:function(buffer, n) -> (taken, rest) for surplus groups")
    g.add_argument("--partial-rollout", action="store_true", help="with over-sampling: once the batch is full, abort what is still "
                   "generating, keep it with its tokens and continue it in the next rollout (pair with --use-tis)")
    g.add_argument("--top-k", type=positive_int, default=None, help="rollout top-k (default: off; anything but off makes rollouts off-policy)")
    g.add_argument("--top-p", type=number_in(float, 0, 1, lo_open=True), default=None, help="rollout top-p (default: off)")
    g.add_argument("--engine-batch-size", type=positive_int, default=256, help="engine rows decoded at once")
    g.add_argument("--custom-generate-function-path", default=None,
                   help="module:function(args, engine, tokenizer, prompts, seeds) -> list of groups (lists) of Sample")
    g.add_argument("--multi-turn", action="store_true", help="run tool calls turn by turn (nanorl/multiturn.py), with per-turn metrics")
    g.add_argument("--max-turns", type=positive_int, default=None, help="--multi-turn: tool calls per response (default 4); one more ends it as truncated")
    g.add_argument("--tool", default=None, choices=tools, help="--multi-turn: what answers a tool call (default calculator)")
    g.add_argument("--rollout-timeout", type=nonneg_float, default=1800, help="seconds a rank's rollout (or eval) may take before the run "
                   "saves and exits non-zero, naming what was in flight (0 = no limit)")
    g = parser.add_argument_group("rewards (nanorl/rewards.py)")
    g.add_argument("--rm-type", default=None, help="task (the task's own grader: chat_eval's verdict; the default with --task) | "
                   "math (the default with --prompt-data) | boxed | mc | exact | f1 | format | weighted e.g. task+format:0.9,0.1 | "
                   "custom (--custom-rm-path) | remote (--rm-url)")
    g.add_argument("--custom-rm-path", default=None, help="module:function(response, label, metadata) -> float or dict")
    g.add_argument("--rm-url", default=None, help="--rm-type remote: each sample is POSTed here as JSON (README: RL)")
    g.add_argument("--rm-concurrency", type=positive_int, default=32, help="--rm-type remote: requests in flight at once")
    g.add_argument("--rm-timeout", type=positive_float, default=30.0, help="--rm-type remote: seconds per request attempt")
    g.add_argument("--rm-retries", type=nonneg_int, default=3, help="--rm-type remote: retries after a refused/timed-out/5xx call")
    g.add_argument("--rm-failure", default="drop", choices=["drop", "zero"],
                   help="a reward that fails (raises, non-number, failed remote call): drop = never trained on, zero = reward 0")


def check_args(args, parser):
    """Rollout and reward flags that must agree, checked before any work."""
    dynamic = args.over_sampling_batch_size is not None
    if args.partial_rollout and not (dynamic and args.over_sampling_batch_size > args.rollout_batch_size):
        parser.error("--partial-rollout needs --over-sampling-batch-size larger than --rollout-batch-size: "
                     "partial rollouts abort the surplus that is still generating once the batch is full")
    if args.partial_rollout and args.custom_generate_function_path:
        parser.error("--partial-rollout drives the engine itself: it cannot be combined with --custom-generate-function-path")
    if args.multi_turn:
        if args.custom_generate_function_path:
            parser.error("--multi-turn and --custom-generate-function-path both generate the rollout: give one of them")
        if args.partial_rollout:
            parser.error("--multi-turn and --partial-rollout cannot be combined: partial rollouts park and resume single engine requests")
        args.max_turns = 4 if args.max_turns is None else args.max_turns
        args.tool = args.tool or "calculator"
    elif args.max_turns is not None or args.tool is not None:
        parser.error("--max-turns and --tool are only used with --multi-turn")
    if args.rm_type == "remote":
        if not args.rm_url:
            parser.error("--rm-type remote needs --rm-url (the reward server's address, e.g. http://127.0.0.1:8000/reward)")
        if not args.rm_url.startswith(("http://", "https://")):
            parser.error(f"--rm-url {args.rm_url!r} must start with http:// or https://")
        if args.custom_rm_path:
            parser.error("--rm-type remote and --custom-rm-path both pick the reward: give one of them")
    elif args.rm_url:
        parser.error(f"--rm-url is only used with --rm-type remote (got --rm-type {args.rm_type})")


class RolloutTimeout(BaseException):
    """Not an Exception: a reward wrapper that catches Exception must not swallow it."""


@contextmanager
def deadline(seconds, what="the rollout"):
    """Raise RolloutTimeout in this (main) thread once `seconds` have passed (0 = no limit). SIGALRM interrupts
    Python code that hangs: a reward call, a custom rollout, a tool."""
    def on_timeout(signum, frame):
        raise RolloutTimeout(f"{what} ran past --rollout-timeout {seconds:g}s")
    if seconds > 0:
        signal.signal(signal.SIGALRM, on_timeout)
        signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        if seconds > 0:
            signal.setitimer(signal.ITIMER_REAL, 0)


# -----------------------------------------------------------------------------------------------
# generating and scoring groups on one rank

def prompt_ids(tokenizer, item):
    """The tokens a prompt item starts the response from: a conversation rendered up to the assistant's turn, or
    raw text (--prompt-data without --apply-chat-template) after <|bos|>."""
    if "text" in item:
        return [tokenizer.get_bos_token_id()] + tokenizer.encode(item["text"])
    return tokenizer.render_for_completion(item["conversation"])


class RolloutWorker:
    """
    Turns prompts into scored groups of Samples on one rank. It owns the engine, the reward function and two
    pieces of state: what it is working on right now (`inflight`, named in the report when a rollout fails or
    hangs) and how many rewards have failed in training rollouts (`reward_failures`).
      reward_fn(response_text, label, metadata) -> (value, None) | (None, reason), or None with --rm-type remote
      tool: what answers a tool call under --multi-turn; custom_generate: --custom-generate-function-path
    """
    def __init__(self, args, engine, tokenizer, reward_fn, tool=None, custom_generate=None):
        self.args, self.engine, self.tokenizer = args, engine, tokenizer
        self.reward_fn, self.tool, self.custom_generate = reward_fn, tool, custom_generate
        self.inflight, self.reward_failures = {}, 0
        self.stop_tokens = {tokenizer.encode_special("<|assistant_end|>"), tokenizer.get_bos_token_id()}
        self.python_start = tokenizer.encode_special("<|python_start|>")
        self.output_end = tokenizer.encode_special("<|output_end|>")

    def request(self, prompt_ids, seed, num_samples, temperature, max_tokens=None, **kw):
        a = self.args
        return Request(prompt_ids=prompt_ids, num_samples=num_samples, max_tokens=a.max_response_len if max_tokens is None else max_tokens,
                       temperature=temperature, top_k=a.top_k, top_p=a.top_p, seed=seed, **kw)

    def new_group(self, p, prompt_ids, seed, num_samples, weight_version):
        """Empty samples of one prompt, to be extended by the engine's completions."""
        return [Sample(prompt=p.get("conversation", p.get("text")), tokens=list(prompt_ids), label=p["label"], status=ABORTED,
                       weight_version=weight_version, index=si, metadata={**p["metadata"], "seed": seed})
                for si in range(num_samples)]

    def generate(self, prompts, seeds, temperature, num_samples, weight_version):
        """The default rollout: one engine call over all prompts, each fanned out to num_samples -> groups."""
        from nanorl.multiturn import multi_turn_generate
        self.inflight["generating"] = [p["metadata"] for p in prompts]
        if self.custom_generate is not None:
            return self.custom_generate(self.args, self.engine, self.tokenizer, prompts, seeds)
        ids_of = [prompt_ids(self.tokenizer, p) for p in prompts]
        reqs = [self.request(ids, seed, num_samples, temperature) for ids, seed in zip(ids_of, seeds)]
        if self.args.multi_turn:
            results = multi_turn_generate(self.engine, reqs, self.args.max_turns, self.tool)
        else:
            results = self.engine.generate(reqs)
        groups = []
        for p, ids, seed, comps in zip(prompts, ids_of, seeds, results):
            group = [extend_sample(s, c) for s, c in zip(self.new_group(p, ids, seed, num_samples, weight_version), comps)]
            if self.args.multi_turn:  # each response's tool calls, errors and whether it hit --max-turns
                for s, c in zip(group, comps):
                    s.metadata.update(c.turn_stats())
            groups.append(group)
        return groups

    def stream(self, prompts, seeds, weight_version, buffer):
        """
        --partial-rollout: yield each group, scored, as soon as all its samples end. When the batch is full the caller
        closes this generator: what is still generating is aborted and parked in the buffer with the tokens it has
        (and the weight_version it started under), and the next rollout continues it before starting new prompts.
        """
        a, n, engine = self.args, self.args.n_samples_per_prompt, self.engine
        jobs = []  # (group, {sample index: (handle, completion index)})
        self.inflight["generating"] = [s.metadata for g in buffer.partial for s in g[:1]] + [p["metadata"] for p in prompts]
        for group in buffer.take_partial():
            handles = {}
            for s in group:
                if s.status == ABORTED:  # continue it: same random stream, from the token it stopped at
                    req = self.request(list(s.tokens), s.metadata["seed"], 1, a.temperature,
                                       max_tokens=a.max_response_len - s.response_length, first_sample=s.index,
                                       start_counter=s.response_length)
                    handles[s.index] = (engine.submit(req), 0)
                s.metadata["resumed"] = s.metadata.get("resumed", 0) + (s.status == ABORTED)
            jobs.append((group, handles))
        for p, seed in zip(prompts, seeds):
            ids = prompt_ids(self.tokenizer, p)
            h = engine.submit(self.request(ids, seed, n, a.temperature))
            jobs.append((self.new_group(p, ids, seed, n, weight_version), {si: (h, si) for si in range(n)}))
        try:
            while jobs:
                engine.step()
                for job in [j for j in jobs if all(h.done for h, _ in j[1].values())]:
                    jobs.remove(job)
                    group, handles = job
                    for si, (h, ci) in handles.items():
                        extend_sample(group[si], h.completions[ci])
                    yield self.score([group])[0]
        finally:
            if jobs:  # the batch is full: abort the rest and park it, cut back to where it can be continued exactly
                engine.abort()
                while engine.step():
                    pass
                for group, handles in jobs:
                    for si, (h, ci) in handles.items():
                        extend_sample(group[si], h.completions[ci], self.python_start, self.output_end)
                    buffer.partial.append(group)

    def response_text(self, s):
        return self.tokenizer.decode([t for t in s.tokens[s.prompt_length:] if t not in self.stop_tokens])

    def score(self, groups, count_failures=True):
        """Reward every unscored sample of groups (custom generate functions may score their own). A reward that
        fails is counted (training rollouts only) and its sample dropped from training or scored 0 (--rm-failure)."""
        a = self.args
        todo = [s for g in groups for s in g if s.reward is None]
        texts = [self.response_text(s) for s in todo]
        if self.reward_fn is None:  # --rm-type remote: all the samples in one batched call
            payloads = [{"prompt": s.prompt, "response": t, "label": s.label, "metadata": s.metadata} for s, t in zip(todo, texts)]
            self.inflight["scoring"] = {"remote": a.rm_url, "samples": len(payloads)}
            results = remote_rewards(a.rm_url, payloads, a.rm_concurrency, a.rm_timeout, a.rm_retries)
        else:
            results = []
            for s, t in zip(todo, texts):
                self.inflight["scoring"] = {"metadata": s.metadata, "response": t[:200]}
                results.append(self.reward_fn(t, s.label, s.metadata))
        self.inflight.pop("scoring", None)
        failed = set_rewards(groups, todo, results, a.rm_failure)
        if count_failures:
            self.reward_failures += len(failed)
        if failed:
            print(f"warning: {len(failed)}/{len(todo)} rewards failed ({a.rm_failure}), e.g. {failed[0].metadata['reward_error']}",
                  flush=True)
        return groups
