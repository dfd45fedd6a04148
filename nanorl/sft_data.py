"""
Conversations -> packed (B, T) training rows for midtraining and SFT (the loop itself is in scripts/chat_sft.py).

Each conversation is rendered with its loss mask (only what the assistant wrote is trained on) and
shifted into (inputs, targets) of its own: a target is -1 wherever the mask is 0, so no document ever
predicts into the next one. Whole conversations are then packed best-fit into rows of T tokens with a
document id per token, which nanorl.gpt turns into block-diagonal attention with positions restarting
per document. Only a row's tail is padding. Too-long conversations are truncated and counted.
"""

import os

import torch
import torch.distributed as dist

from nanorl.common import epoch_order
from nanorl.errors import BadValue, MissingFile, Unreadable, UserError
from nanorl.logger import print0


def render_example(tokenizer, conversation, seq_len):
    """(inputs, targets, truncated): at most seq_len positions, targets -1 where the assistant did not write."""
    ids, mask = tokenizer.render_conversation(conversation)
    truncated = len(ids) > seq_len + 1
    ids, mask = ids[: seq_len + 1], mask[: seq_len + 1]
    targets = [t if m else -1 for t, m in zip(ids[1:], mask[1:])]
    return ids[:-1], targets, truncated


class SFTLoader:
    """
    Packed batches from a Task, this rank's strided share of a per-epoch shuffle. Best-fit packing: each
    row takes the longest pending conversation that still fits, from a pool of `pool_size`, so little is
    padded. epochs=None loops forever; otherwise next_batch() returns None once the data is used up.
    state_dict() holds the epoch, the cursor and the pending pool, so a resumed run sees the same rows.
    """

    def __init__(
        self,
        task,
        tokenizer,
        batch_size,
        seq_len,
        rank=0,
        world_size=1,
        seed=0,
        shuffle=True,
        epochs=None,
        pool_size=64,
        device="cpu",
    ):
        if len(task) < world_size:
            raise ValueError(f"the data has {len(task)} conversations, fewer than the {world_size} ranks")
        self.task, self.tokenizer = task, tokenizer
        self.B, self.T = batch_size, seq_len
        self.rank, self.world_size, self.seed, self.shuffle = rank, world_size, seed, shuffle
        self.epochs, self.pool_size, self.device = epochs, pool_size, device
        self.pad_id = tokenizer.get_bos_token_id()  # any real token: padded positions have target -1
        self.epoch, self.cursor, self.pool = 0, 0, []
        self.order = self._make_order()
        self.stats = dict(conversations=0, truncated=0, no_target=0, positions=0, padding=0, loss_tokens=0)

    def _make_order(self):
        return epoch_order(len(self.task), self.seed, self.epoch, self.rank, self.world_size, self.shuffle)

    def _render(self, index):
        inputs, targets, truncated = render_example(self.tokenizer, self.task.get_example(index), self.T)
        return {"index": index, "inputs": inputs, "targets": targets, "truncated": truncated}

    def _next_doc(self):
        """The next conversation with something to learn, or None when the last epoch is done."""
        skipped = 0
        while True:
            if self.cursor >= len(self.order):
                if self.epochs is not None and self.epoch + 1 >= self.epochs:
                    return None
                self.epoch, self.cursor = self.epoch + 1, 0
                self.order = self._make_order()
            doc = self._render(self.order[self.cursor])
            self.cursor += 1
            self.stats["conversations"] += 1
            self.stats["truncated"] += doc["truncated"]
            if all(t == -1 for t in doc["targets"]):
                self.stats["no_target"] += 1  # e.g. a prompt longer than the context: nothing to train on
                skipped += 1
                if skipped > len(self.order):  # a whole epoch of them: looping would never end
                    raise ValueError(f"no conversation has an assistant token within the first {self.T + 1} tokens")
                continue
            return doc

    def _fill_pool(self):
        while len(self.pool) < self.pool_size:
            doc = self._next_doc()
            if doc is None:
                return
            self.pool.append(doc)

    @property
    def progress(self):
        """Epochs done, fractional: the LR schedule and the stopping rule follow it."""
        return self.progress_at(self.state_dict())

    def progress_at(self, state):
        """Epochs done at a state_dict() (the training loop reads the loader one step ahead of the model)."""
        return state["epoch"] + state["cursor"] / len(self.order)

    def next_batch(self):
        """(inputs, targets, doc_ids), each (B, T) long tensors on the device; None when the data is used up."""
        B, T = self.B, self.T
        inputs = torch.full((B, T), self.pad_id, dtype=torch.long)
        targets = torch.full((B, T), -1, dtype=torch.long)
        doc_ids = torch.zeros((B, T), dtype=torch.long)
        placed = 0
        for b in range(B):
            pos, doc_id = 0, 0
            while True:
                self._fill_pool()
                fits = [j for j, d in enumerate(self.pool) if len(d["inputs"]) <= T - pos]
                if not fits:
                    break
                doc = self.pool.pop(max(fits, key=lambda j: len(self.pool[j]["inputs"])))
                n = len(doc["inputs"])
                inputs[b, pos : pos + n] = torch.tensor(doc["inputs"])
                targets[b, pos : pos + n] = torch.tensor(doc["targets"])
                doc_ids[b, pos : pos + n] = doc_id
                pos, doc_id, placed = pos + n, doc_id + 1, placed + 1
            doc_ids[b, pos:] = doc_id  # the tail is one more "document" of padding
            self.stats["padding"] += T - pos
        if placed == 0:
            return None
        self.stats["positions"] += B * T
        self.stats["loss_tokens"] += int((targets >= 0).sum())
        if torch.device(self.device).type == "cuda":  # a copy from pinned memory that does not wait for the device
            return tuple(t.pin_memory().to(self.device, non_blocking=True) for t in (inputs, targets, doc_ids))
        return inputs.to(self.device), targets.to(self.device), doc_ids.to(self.device)

    def __iter__(self):
        while (batch := self.next_batch()) is not None:
            yield batch

    def padding_fraction(self):
        return padding_fraction(self.state_dict())

    def state_dict(self):
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "pool": [d["index"] for d in self.pool],
            "stats": dict(self.stats),
        }

    def load_state_dict(self, state):
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self.order = self._make_order()
        self.pool = [self._render(i) for i in state["pool"]]
        self.stats = dict(state["stats"])


def padding_fraction(state):
    """The fraction of packed positions that are padding, at a loader's state_dict()."""
    return state["stats"]["padding"] / max(state["stats"]["positions"], 1)


# -----------------------------------------------------------------------------------------------
# the data flags of scripts/mid_train.py and scripts/chat_sft.py


def levels(args):
    return tuple(int(l) for l in args.levels.split(","))


class TaskPaths(dict):
    """--task-path's {name: path}, remembering which names the stage's mixture asked for (a name it never asks for
    would be a flag quietly ignored: a typo, or a task of another stage's mixture)."""

    def __init__(self, items):
        super().__init__(items)
        self.asked = set()

    def get(self, name, default=None):
        self.asked.add(name)
        return super().get(name, default)

    def check_all_asked(self):
        unused = sorted(set(self) - self.asked)
        if unused:
            raise BadValue(
                f"--task-path {unused[0]}={self[unused[0]]}: this stage's mixture has no task {unused[0]!r} "
                f"(its tasks: {', '.join(sorted(self.asked))})"
            )


def task_paths(args):
    out = {}
    for item in args.task_path:
        if "=" not in item:
            raise SystemExit(f"--task-path {item!r}: expected NAME=PATH, e.g. gsm8k=/data/gsm8k")
        name, path = item.split("=", 1)
        out[name.lower()] = path
    return TaskPaths(out)


def build_data(args, hub_mixture, offline_mixture):
    """(train task, val task, description) of a stage's mixture: hub_mixture(args, task paths) with --data hub,
    else offline_mixture(args). Every rank loads it, and the ranks agree before any trains: a rank on other data would
    end its epoch, and with it everyone's training (progress is the furthest rank's), at another point.
    - a --task-path the user named that is not there, or any failure while some path was named: all stop, in one line;
    - some ranks loaded the Hub's datasets and others could not: all stop, naming the rank and what it could not load;
    - no path named and no rank could load them (no network): all fall back to the offline curriculum, as documented,
      so a run without network still does something useful."""
    paths = task_paths(args)
    if args.data != "hub":
        if paths:
            raise BadValue(f"--task-path {next(iter(paths))}=...: only --data hub reads task files (--data is offline)")
        return *offline_mixture(args), "offline"
    try:
        for name, path in paths.items():  # before any download: a typo in a path must not wait behind the Hub
            if not os.path.exists(path):
                raise MissingFile(f"--task-path {name}={path}: no such file or directory")
        train, val = hub_mixture(args, paths)
        paths.check_all_asked()
        failure = None
    except (UserError, RuntimeError, OSError) as e:
        failure = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
    world = dist.get_world_size() if dist.is_initialized() else 1
    every = [failure]
    if world > 1:  # the same verdict on every rank: all train on the Hub's data, all stop, or all fall back
        every = [None] * world
        dist.all_gather_object(every, failure)
    failures = [(rank, why) for rank, why in enumerate(every) if why is not None]
    if not failures:
        return train, val, "hub"
    rank, why = failures[0]
    where = f"rank {rank} of {world}: " if world > 1 else ""
    if paths:
        raise Unreadable(f"--data hub: {where}{why} (no offline fallback: --task-path names files)")
    if len(failures) < world:
        raise Unreadable(
            f"--data hub: {where}{why}; the other ranks loaded the datasets and the ranks would train on different "
            "data: fix that node's network or Hub cache, or pass --task-path files"
        )
    print0(f"warning: --data hub could not load its datasets:\n  {why}\nfalling back to the offline curriculum")
    return *offline_mixture(args), f"offline (fallback: {why[:200]})"
