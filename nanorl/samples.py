"""
The Sample record that RL passes from sampler to trainer, and its tensor layout: what the rollout side
(nanorl/rollout.py) fills in and the training side (nanorl/rl_trainer.py) reads.

  Sample                one response to one prompt: tokens, loss mask, the sampler's log-probs, reward, status
  extend_sample         append an engine Completion to a Sample (a partial rollout's cut included)
  pack_micro_batches    samples -> rows of whole samples end to end -> micro-batches of rows
  collate               samples -> padded (B, T) tensors aligned for next-token prediction
  collate_packed        one micro-batch -> collate() plus the packed (R, L) tensors the model runs on
  unpack, pad_like      packed per-token outputs / per-sample rows back to the (B, T) layout
"""

from dataclasses import asdict, dataclass, field

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
    # the temperature it was sampled at: rollout_log_probs are log_softmax(logits / temperature), so the trainer
    # must divide its logits by the same one (it checks). None: not recorded (a custom generate function's sample)
    temperature: float | None = None

    @property
    def prompt_length(self):
        return len(self.tokens) - self.response_length

    def scalar_reward(self):
        return self.reward["total"] if isinstance(self.reward, dict) else self.reward

    def to_dict(self):
        return asdict(self)


def extend_sample(s, completion, python_start=None, output_end=None):
    """Append an engine Completion to a Sample. An aborted one keeps only what can be continued exactly: if it
    stopped inside a tool call (the call's forced output not all fed in), the call is cut and the model redoes it."""
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
