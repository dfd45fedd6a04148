"""
Pretraining batches: stream documents, tokenize them, and pack them into (B, T) rows that each start
with <|bos|> at a document start (BOS-aligned: no row begins mid-document, so the model never has to
guess a context it cannot see). Rows are filled greedily with whole documents; the document that does not
fit is cropped to fill the row and its rest is dropped (a small, documented waste of tokens).

DDP: each rank reads only its share of the text (parquet row groups r, r + world, ...; see iter_documents).
The state is where in its stream this rank's current tokenizer batch began and how many of that batch's documents it
consumed: a resumed run opens the stream there (nanorl.dataset.iter_positioned reads nothing before it), tokenizes
that one batch again and continues on the exact next tokens. Start-up work is one batch, however far the run got.
"""

import itertools

import torch

from nanorl.dataset import iter_positioned


class PretrainLoader:
    def __init__(
        self,
        tokenizer,
        B,
        T,
        split="train",
        data_dir=None,
        device="cpu",
        rank=0,
        world_size=1,
        seed=0,
        tokenizer_batch=64,
    ):
        self.tok, self.B, self.T = tokenizer, B, T
        self.split, self.data_dir, self.device = split, data_dir, device
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.tokenizer_batch = tokenizer_batch
        self.docs_consumed = 0  # documents of this rank's shard already packed into rows
        self._reset_stream()

    def _reset_stream(self, start=None):
        self._stream = iter_positioned(
            self.split, self.data_dir, seed=self.seed, rank=self.rank, world_size=self.world_size, start=start
        )
        self._pending = []  # tokenized documents of the current batch not yet used, last first
        self._batch_start, self._batch_used = start, 0  # where the current tokenizer batch began; how many it gave

    def _next_doc(self):
        if not self._pending:
            batch = list(itertools.islice(self._stream, self.tokenizer_batch))
            if not batch:
                raise StopIteration
            self._batch_start, self._batch_used = batch[0][0], 0
            self._pending = self.tok.encode([text for _, text in batch], prepend=self.tok.get_bos_token_id())[::-1]
        self.docs_consumed += 1
        self._batch_used += 1
        return self._pending.pop()

    def next_batch(self):
        rows = []
        for _ in range(self.B):
            row = []
            while len(row) < self.T + 1:
                doc = self._next_doc()
                row.extend(doc[: self.T + 1 - len(row)])
            rows.append(row)
        data = torch.tensor(rows, dtype=torch.long)
        # contiguous, as a copy to the GPU makes them anyway: on every device the compiled graph (specialised on the
        # strides) and base_train's batch-size trial see one layout
        x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
        if self.device != "cpu" and torch.device(self.device).type == "cuda":
            return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)
        return x.to(self.device), y.to(self.device)

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state_dict(self):
        return {
            "docs_consumed": self.docs_consumed,
            "batch_start": self._batch_start,
            "batch_used": self._batch_used,
            "world_size": self.world_size,
            "B": self.B,
            "T": self.T,
        }

    def load_state_dict(self, state):
        if state["world_size"] != self.world_size:
            raise ValueError(
                f"the checkpoint's data order was made with {state['world_size']} ranks, this run has "
                f"{self.world_size}: resume with the same number of ranks"
            )
        # a checkpoint of an older version has no position: it replays the stream from the start
        self._reset_stream(state.get("batch_start"))
        for _ in range(state["batch_used"] if "batch_start" in state else state["docs_consumed"]):
            self._next_doc()
        self.docs_consumed = state["docs_consumed"]
