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
        self.completions = [Completion([], [], [], "running", len(request.prompt_ids)) for _ in range(request.num_samples)]
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
        raise ValueError(f"prompt of {n} tokens is too long for the context of {max_len} tokens "
                         f"(it needs room for at least one generated token)")
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
    if not (isinstance(r.first_sample, int) and isinstance(r.start_counter, int) and r.first_sample >= 0 and r.start_counter >= 0):
        raise ValueError(f"first_sample and start_counter must be ints >= 0, got {r.first_sample}, {r.start_counter}")


class SlotRecords:
    """Per slot: the sample's generated tokens, their log-probs and masks, and what ends it (stop tokens, a token
    budget) or needs the host (tool use, streaming). Rows move with their samples (move) and are read back into a
    Completion when the sample ends (lists)."""

    def __init__(self, batch_size, max_len):
        B, self.max_len = batch_size, max_len
        self.n_gen, self.prompt_len, self.limit = (np.zeros(B, dtype=np.int64) for _ in range(3))
        self.stops = np.full((B, 2), -1, dtype=np.int64)  # padded with -1; widened for a request with more stops
        self.tools, self.streamed, self.filtered, self.greedy = (np.zeros(B, dtype=bool) for _ in range(4))
        self.tokens = np.zeros((B, max_len), dtype=np.int64)
        self.logprobs = np.zeros((B, max_len), dtype=np.float64)
        self.mask = np.zeros((B, max_len), dtype=np.int8)

    def fill(self, slot, handle):
        """A new sample of handle's request starts in slot."""
        r, stops = handle.request, sorted(handle.stops)
        if len(stops) > self.stops.shape[1]:
            wider = np.full((self.stops.shape[0], len(stops)), -1, dtype=np.int64)
            wider[:, :self.stops.shape[1]] = self.stops
            self.stops = wider
        self.n_gen[slot], self.prompt_len[slot] = 0, len(r.prompt_ids)
        self.limit[slot] = min(r.max_tokens, self.max_len - len(r.prompt_ids))  # its budget, and the context
        self.stops[slot] = -1
        self.stops[slot, :len(stops)] = stops
        self.tools[slot], self.streamed[slot] = r.use_tools, handle.events is not None
        self.filtered[slot], self.greedy[slot] = handle.filtered, r.temperature == 0

    def move(self, src, dst):
        for a in (self.n_gen, self.prompt_len, self.limit, self.stops, self.tools, self.streamed, self.filtered,
                  self.greedy, self.tokens, self.logprobs, self.mask):
            a[dst] = a[src]

    def lengths(self, n):
        """Prompt + generated tokens of slots 0..n-1."""
        return self.prompt_len[:n] + self.n_gen[:n]

    def append(self, slots, tok, logp, sampled, python_end):
        """Append one token to each of `slots` -> (stop, full, call) bool arrays: it sampled a stop token; it used
        its budget or the context; it closed a tool call that will run. Forced tokens never stop a sample nor
        close a call, and a call on the last allowed token is not run."""
        k = self.n_gen[slots]
        self.tokens[slots, k], self.logprobs[slots, k], self.mask[slots, k] = tok, logp, sampled
        self.n_gen[slots] = k + 1
        stop = sampled & (self.stops[slots] == tok[:, None]).any(1)
        full = ~stop & (k + 1 >= self.limit[slots])
        call = sampled & ~stop & ~full & self.tools[slots] & (tok == python_end)
        return stop, full, call

    def generated(self, slot):
        return self.tokens[slot, :self.n_gen[slot]].tolist()

    def lists(self, slot):
        """(tokens, logprobs, mask) of slot's sample as Python lists, as a Completion holds them."""
        k = self.n_gen[slot]
        return self.tokens[slot, :k].tolist(), self.logprobs[slot, :k].tolist(), self.mask[slot, :k].tolist()
