"""
Pretraining batches: stream documents, tokenize them, and pack them into (B, T) rows that each start
with <|bos|> at a document start (BOS-aligned: no row begins mid-document, so the model never has to
guess a context it cannot see). Rows are filled greedily with whole documents; the document that does not
fit is cropped to fill the row and its rest is dropped (a small, documented waste of tokens).

DDP: each rank reads only its share of the text (parquet row groups r, r + world, ...; see iter_documents).
The state is the number of documents this rank consumed: a resumed run skips exactly that many documents
and continues on the exact next tokens.
"""

import itertools

import torch

from nanorl.dataset import iter_documents


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

    def _reset_stream(self):
        self._stream = iter_documents(
            self.split, self.data_dir, seed=self.seed, rank=self.rank, world_size=self.world_size
        )
        self._pending = []  # tokenized documents not yet used

    def _next_doc(self):
        if not self._pending:
            texts = list(itertools.islice(self._stream, self.tokenizer_batch))
            if not texts:
                raise StopIteration
            self._pending = self.tok.encode(texts, prepend=self.tok.get_bos_token_id())[::-1]
        self.docs_consumed += 1
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
        x, y = data[:, :-1], data[:, 1:]
        if self.device != "cpu" and torch.device(self.device).type == "cuda":
            return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)
        return x.to(self.device), y.to(self.device)

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state_dict(self):
        return {"docs_consumed": self.docs_consumed, "world_size": self.world_size, "B": self.B, "T": self.T}

    def load_state_dict(self, state):
        if state["world_size"] != self.world_size:
            raise ValueError(
                f"the checkpoint's data order was made with {state['world_size']} ranks, this run has "
                f"{self.world_size}: resume with the same number of ranks"
            )
        self._reset_stream()
        self.docs_consumed = 0
        for _ in range(state["docs_consumed"]):  # replay the stream up to where we stopped
            self._next_doc()
