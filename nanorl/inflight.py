"""
Requests in flight, as the engine keeps them: the Request a caller submits and the Completion it gets back, the
Handle it holds meanwhile, one Sample per sample, and SlotRecords, the host arrays of what each slot's sample has
generated so far (so a decode step checks every row for stops, limits and tool calls with a few array ops).
"""

import collections
import math
import queue
import threading
from dataclasses import dataclass

import numpy as np


@dataclass
class Request:
    prompt_ids: list
    num_samples: int = 1
    max_tokens: int = 256
    temperature: float = 1.0  # 0 = greedy
    top_k: int = None
    top_p: float = None
    seed: int = None  # None: drawn from torch's global RNG (so torch.manual_seed makes a run reproducible)
    stop_tokens: list = None  # None: <|assistant_end|> and <|bos|>; [] never stops before max_tokens
    use_tools: bool = True
    # continuing an aborted sample (partial rollouts): prompt_ids = its prompt + the tokens it has, first_sample = its
    # index in the original request and start_counter = how many tokens it drew, so its random stream picks up where
    # it stopped and the continuation equals an uninterrupted run
    first_sample: int = 0
    start_counter: int = 0


@dataclass
class Completion:
    tokens: list  # the generated tokens (not the prompt); the stop token is included when status is "completed"
    logprobs: list  # log_softmax(logits / T)[token] at the request's temperature (1 if greedy), before top-k/top-p
    mask: list  # 1: sampled by the model, 0: forced in (tool output)
    status: str  # "completed" | "truncated" | "aborted" ("running" while in flight, "error" if a step raised)
    prompt_len: int


# --- requests in flight -------------------------------------------------------------------------


class Handle:
    """A submitted request. Each Completion is filled in when its sample ends; iterate the handle
    (submit(..., stream=True)) for per-token events, or call result() to wait for all of them."""

    def __init__(self, engine, request, stops, stream):
        self.engine, self.request, self.stops = engine, request, stops
        self.completions = [
            Completion([], [], [], "running", len(request.prompt_ids)) for _ in range(request.num_samples)
        ]
        self.events = queue.SimpleQueue() if stream else None
        self.filtered = request.top_k is not None or (request.top_p is not None and request.top_p < 1)
        self.cancelled = False
        self.error = None  # why the request ended "error", when it did
        self.remaining = request.num_samples
        self.finished = threading.Event()

    @property
    def done(self):
        return self.finished.is_set()

    def cancel(self):
        """Stop this request: its samples end "aborted" with what they have, and free their slots at the next step."""
        self.engine._cancel([self])

    def result(self):
        """Wait until every sample has ended (stepping the engine unless a serve_forever thread does) -> list[Completion]."""
        while not self.done:
            self.engine._progress(self)
        return self.completions

    def __iter__(self):
        """Events: {"sample", "token", "logprob", "mask"} per token, {"sample", "status", "completion"} per sample end."""
        if self.events is None:
            raise ValueError("this handle was submitted without stream=True")
        while True:
            try:
                yield self.events.get_nowait()
                continue
            except queue.Empty:
                pass
            if self.done and self.events.empty():  # the final events are queued before finished is set
                return
            if self.engine.serving:
                try:
                    yield self.events.get(timeout=0.1)
                except queue.Empty:
                    pass
            else:
                self.engine.step()


class Sample:
    """One sample of a request, waiting for a slot or occupying one."""

    def __init__(self, handle, index, seed):
        self.handle, self.index, self.row_seed = handle, index, seed
        self.out = handle.completions[index]
        self.slot = None
        self.forced = collections.deque()  # tool output tokens waiting to be fed in


def check_request(r, max_len, vocab_size):
    """Refuse a request the engine cannot run, in one line naming the field (ValueError; TypeError if it is no
    Request). The engine checks every request of a batch before it queues any."""
    if not isinstance(r, Request):
        raise TypeError(f"expected a Request, got {type(r).__name__}")
    n = len(r.prompt_ids)
    if n == 0:
        raise ValueError("empty prompt: a prompt needs at least one token (e.g. <|bos|>)")
    if n >= max_len:
        raise ValueError(
            f"prompt of {n} tokens is too long for the context of {max_len} tokens "
            f"(it needs room for at least one generated token)"
        )
    bad = [t for t in r.prompt_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt has unknown token ids {bad[:5]}: ids are ints in [0, {vocab_size})")
    if r.stop_tokens is not None and any(not isinstance(t, int) or not 0 <= t < vocab_size for t in r.stop_tokens):
        raise ValueError(f"stop_tokens {r.stop_tokens} has ids outside the vocab (size {vocab_size})")
    if not isinstance(r.num_samples, int) or r.num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {r.num_samples}")
    if not isinstance(r.max_tokens, int) or r.max_tokens <= 0:
        raise ValueError(f"max_tokens must be >= 1, got {r.max_tokens}")
    for name in ("temperature", "top_p", "top_k"):  # NaN passes every range check below; inf is no setting
        v = getattr(r, name)
        if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)):
            raise ValueError(f"{name} must be a finite number, got {v!r}")
    if not r.temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {r.temperature}")
    if r.top_k is not None and (not isinstance(r.top_k, int) or r.top_k < 1):
        raise ValueError(f"top_k must be >= 1 (or None), got {r.top_k}")
    if r.top_p is not None and not 0 < r.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (or None), got {r.top_p}")
    if not (
        isinstance(r.first_sample, int)
        and isinstance(r.start_counter, int)
        and r.first_sample >= 0
        and r.start_counter >= 0
    ):
        raise ValueError(f"first_sample and start_counter must be ints >= 0, got {r.first_sample}, {r.start_counter}")


class SlotRecords:
    """Per slot: the sample's generated tokens with their log-probs and masks, its token budget, and the tokens
    that need the host when sampled ("watched": its stop tokens, and <|python_end|> when it uses tools). A decode
    step appends to every row and finds the rows that need the host with a handful of array ops (append); rows
    move with their samples (move) and are read back into a Completion when the sample ends (lists)."""

    def __init__(self, batch_size, max_len):
        B, self.max_len = batch_size, max_len
        self.n_gen, self.prompt_len, self.limit = (np.zeros(B, dtype=np.int64) for _ in range(3))
        self.watch = np.full((B, 3), -1, dtype=np.int64)  # padded with -1; widened for a request with more stops
        self.streamed, self.filtered, self.greedy, self.unit = (np.zeros(B, dtype=bool) for _ in range(4))
        self.out = np.zeros((B, max_len, 2), dtype=np.float64)  # (token, log-prob): one write per step
        self.mask = np.ones((B, max_len), dtype=np.int8)  # 0 where a token was forced in

    def fill(self, slot, handle, python_end):
        """A new sample of handle's request starts in slot."""
        r = handle.request
        watch = sorted(t for t in handle.stops | ({python_end} if r.use_tools else set()) if t is not None)
        if len(watch) > self.watch.shape[1]:
            wider = np.full((self.watch.shape[0], len(watch)), -1, dtype=np.int64)
            wider[:, : self.watch.shape[1]] = self.watch
            self.watch = wider
        self.n_gen[slot], self.prompt_len[slot] = 0, len(r.prompt_ids)
        self.limit[slot] = min(r.max_tokens, self.max_len - len(r.prompt_ids))  # its budget, and the context
        self.watch[slot] = -1
        self.watch[slot, : len(watch)] = watch
        self.mask[slot] = 1
        self.streamed[slot], self.filtered[slot] = handle.events is not None, handle.filtered
        self.greedy[slot], self.unit[slot] = r.temperature == 0, r.temperature in (0, 1)  # unit: no division

    def move(self, src, dst):
        for a in (
            self.n_gen,
            self.prompt_len,
            self.limit,
            self.watch,
            self.streamed,
            self.filtered,
            self.greedy,
            self.unit,
            self.out,
            self.mask,
        ):
            a[dst] = a[src]

    def lengths(self, n):
        """Prompt + generated tokens of slots 0..n-1."""
        return self.prompt_len[:n] + self.n_gen[:n]

    def append(self, rows, idx, host, forced=None):
        """Append one token to each slot of rows (a slice, or the index array idx; idx always the array):
        host = (2, m) float64 tokens and log-probs, forced = (m,) forced tokens or -1 (None: none forced).
        -> bool (m,): the rows that need the host (a watched token sampled, the budget or context used up, or
        streamed). Forced tokens are never watched."""
        k = self.n_gen[rows].copy()  # rows may be a slice: a view would see the += below
        self.out[idx, k] = host.T
        self.n_gen[rows] += 1
        hit = (self.watch[rows] == host[0, :, None]).any(1)
        if forced is not None:
            sampled = forced < 0
            self.mask[idx, k] = sampled
            hit &= sampled
        return hit | (k + 1 >= self.limit[rows]) | self.streamed[rows]

    def full(self, slot):
        return self.n_gen[slot] >= self.limit[slot]

    def generated(self, slot):
        return self.out[slot, : self.n_gen[slot], 0].astype(np.int64).tolist()

    def lists(self, slot):
        """(tokens, logprobs, mask) of slot's sample as Python lists, as a Completion holds them."""
        k = self.n_gen[slot]
        out = self.out[slot, :k]
        return out[:, 0].astype(np.int64).tolist(), out[:, 1].tolist(), self.mask[slot, :k].tolist()
