"""
The sampling engine: RL rollouts, evals and the chat UI all run on it. A scheduler over one pre-allocated KV cache of
batch_size rows ("slots"), each row at its own position. This file: what a caller submits (Request) and gets back
(Completion, through a Handle), the host's records of the samples in flight (InflightSample, SlotRecords), then the
Engine, whose step() is one turn of its loop. Beside it: what a step computes on the device (nanorl/decode.py: the
engine's copy of the weights and its precision, the KV cache and the pinned attention kernels, the lockstep step, the
CUDA graphs, the sampling math), tool calls (nanorl/toolcalls.py). docs/engine.md explains why.

- a request's prompt is prefilled once, straight into a free row, and its KV copied to the rows of its other
  samples (prefix sharing); a slot whose sample ends (stop token, max_tokens, context, abort) is refilled from the
  queue at the next step (continuous batching)
- busy samples always sit in slots 0..n-1 (a sample that ends leaves a hole the last busy one moves into), so a
  decode step is one forward of only the smallest ladder size (1, 2, 4, ... batch_size) >= n rows: replayed from a
  CUDA graph on CUDA, eager elsewhere, through LockstepDecode when the rows all stand at one position
- a decode step's host work does not grow with the batch: tokens are kept in per-slot arrays and checked for stops,
  limits and tool calls with array ops; Python touches only the rows where something happens (a sample ends, calls a
  tool, is streamed), and a Completion's lists are filled when its sample ends
- sampling is batched (temperature, top-k, top-p) and its randomness is a counter-based hash of (request seed,
  sample index, token index): a sample does not depend on what else shares the batch
- every token comes with its mask (1 sampled, 0 forced tool output) and its log-prob log_softmax(logits / T) at the
  request's temperature (T = 1 for greedy), before top-k/top-p: what the trainer's GPT.token_logprobs(...,
  temperature=T) computes, so on-policy importance weights are 1 (top-k/top-p sampling is off-policy)
- a failure that belongs to one request (its prefill, its tool call) ends that request with status "error" and
  nothing else; only a failure of the shared decode step ends everything in flight
- tool use (Request.use_tools): <|python_start|>expr<|python_end|> runs the engine's tool (the calculator by
  default, with a timeout) and its result is forced in as <|output_start|>result<|output_end|>

    engine = Engine(model, tokenizer, batch_size=64)
    completions = engine.submit_and_wait([Request(prompt_ids, num_samples=8, temperature=1.0, seed=0)])
"""

import collections
import itertools
import math
import queue
import threading
import traceback
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn.attention import sdpa_kernel

from nanorl.decode import (
    KERNEL_NAMES,
    LockstepDecode,
    SamplerSettings,
    attention_backends,
    checked_decode_graphs,
    engine_autocast,
    inference_copy,
    new_kv_cache,
    row_seed,
    sample_with_logprobs,
    uniform_from_counter,
)
from nanorl.precision import low_precision_dtype
from nanorl.toolcalls import ToolMarkup, calculator, run_tool

# --- what a caller submits and gets back ---------------------------------------------------------


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


class Handle:
    """A submitted request. Each Completion is filled in when its sample ends; iterate the handle
    (submit(..., stream=True)) for per-token events, or call result() to wait for all of them."""

    def __init__(self, engine, request, stream):
        self.engine, self.request = engine, request
        self.stops = engine.default_stops if request.stop_tokens is None else frozenset(request.stop_tokens)
        self.completions = [
            Completion([], [], [], "running", len(request.prompt_ids)) for _ in range(request.num_samples)
        ]
        # a sample's random stream is its row seed: the request's seed (or one drawn) hashed with its index
        seed = int(torch.randint(0, 2**62, ()).item()) if request.seed is None else request.seed
        self.samples = [
            InflightSample(self, j, row_seed(seed, request.first_sample + j), c) for j, c in enumerate(self.completions)
        ]
        self.events = queue.SimpleQueue() if stream else None
        self.cancelled = False
        self.error = None  # why the request ended "error", when it did
        self.finished = threading.Event()

    @property
    def done(self):
        return self.finished.is_set()

    def cancel(self):
        """Stop this request: its samples end "aborted" with what they have, and free their slots at the next step."""
        self.engine._cancel([self])

    def result(self):
        """Wait until every sample has ended (stepping the engine unless a serve_forever thread does) -> list[Completion]."""
        while not self.finished.is_set():
            if self.engine.serving:
                self.finished.wait(0.1)
            else:
                self.engine.step()
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
    for name, least in (("num_samples", 1), ("max_tokens", 1), ("first_sample", 0), ("start_counter", 0)):
        v = getattr(r, name)
        if not isinstance(v, int) or v < least:
            raise ValueError(f"{name} must be an int >= {least}, got {v!r}")
    # the sampler's settings, one rule each: a number of the right kind in its range (a range refuses NaN, which no
    # comparison holds for, and temperature's refuses inf)
    if not (_is_number(r.temperature) and 0 <= r.temperature < math.inf):
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {r.temperature!r}")
    if r.top_k is not None and (isinstance(r.top_k, bool) or not isinstance(r.top_k, int) or r.top_k < 1):
        raise ValueError(f"top_k must be an int >= 1 (or None), got {r.top_k!r}")
    if r.top_p is not None and not (_is_number(r.top_p) and 0 < r.top_p <= 1):
        raise ValueError(f"top_p must be a number in (0, 1] (or None), got {r.top_p!r}")


def _is_number(v):
    """An int or a float, and no bool (which isinstance counts as an int)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# --- the host's records of the samples in flight -----------------------------------------------


@dataclass(eq=False)  # compared and hashed as itself: the engine keeps samples in sets
class InflightSample:
    """One sample of a request, waiting for a slot or occupying one."""

    handle: Handle
    index: int  # in its request
    row_seed: int
    out: Completion  # the handle's, filled in when the sample ends
    slot: int = None


class SlotRecords:
    """Per slot: the sample's generated tokens with their log-probs, its token budget, its sampler settings, the tool
    output forced in (force; where it is, the mask is 0), and the tokens that need the host when sampled ("watched":
    its stop tokens, and <|python_end|> when it uses tools). A decode step appends to every row and finds the rows that
    need the host with a handful of array ops (append); rows move with their samples (move) and are read back into a
    Completion when the sample ends (lists)."""

    def __init__(self, batch_size, max_len, vocab_size):
        B, self.max_len, self.vocab_size = batch_size, max_len, vocab_size
        self.n_gen, self.prompt_len, self.limit = (np.zeros(B, dtype=np.int64) for _ in range(3))
        # which prefill wrote the slot's prompt KV (Engine._prefill numbers them): slots with one number hold the
        # same prompt KV, bit for bit (prefix sharing), which lets a decode step read it once (LockstepDecode)
        self.prefill = np.zeros(B, dtype=np.int64)
        # the sample's random stream (nanorl/decode.py): its row seed, and the request's start_counter, to which its
        # n_gen tokens add (forced ones too: a continuation's start_counter is its response length)
        self.seed, self.start = np.zeros(B, dtype=np.int64), np.zeros(B, dtype=np.int64)
        self.watch = np.full((B, 3), -1, dtype=np.int64)  # padded with -1; widened for a request with more stops
        self.streamed = np.zeros(B, dtype=bool)
        # the sampler's settings (temperature, top_k, top_p; top_k = vocab size and top_p = 1 are off) in float64,
        # which holds each exactly: a step sends them to the device in one copy with its forced tokens and uniforms
        self.sampler = np.ones((B, 3))
        # the token forced in at each generated position (tool output), -1 where the model samples: the mask
        self.forced = np.full((B, max_len), -1, dtype=np.int64)
        self.out = np.zeros((B, max_len, 2), dtype=np.float64)  # (token, log-prob): one write per step

    def fill(self, sample, python_end):
        """The sample starts in its slot."""
        slot, handle = sample.slot, sample.handle
        r = handle.request
        watch = sorted(t for t in handle.stops | ({python_end} if r.use_tools else set()) if t is not None)
        if len(watch) > self.watch.shape[1]:
            wider = np.full((self.watch.shape[0], len(watch)), -1, dtype=np.int64)
            wider[:, : self.watch.shape[1]] = self.watch
            self.watch = wider
        self.n_gen[slot], self.prompt_len[slot] = 0, len(r.prompt_ids)
        self.seed[slot], self.start[slot] = sample.row_seed, r.start_counter
        self.limit[slot] = min(r.max_tokens, self.max_len - len(r.prompt_ids))  # its budget, and the context
        self.watch[slot] = watch + [-1] * (self.watch.shape[1] - len(watch))
        self.streamed[slot] = handle.events is not None
        self.sampler[slot] = r.temperature, min(r.top_k or self.vocab_size, self.vocab_size), r.top_p or 1.0
        self.forced[slot] = -1

    def force(self, slot, tokens):
        """Feed tokens in from the slot's next token on, one a step (those past the context never are)."""
        k = self.n_gen[slot]
        self.forced[slot, k:][: len(tokens)] = tokens[: self.max_len - k]

    def move(self, src, dst):
        for a in vars(self).values():  # every per-slot array above
            if isinstance(a, np.ndarray):
                a[dst] = a[src]

    def append(self, slots, out, forced):
        """Append one token to each of slots (an index array): out (m, 2) numpy, a (token, log-prob) row per slot,
        forced (m,) the forced tokens or -1. -> bool (m,): the slots that need the host (a watched token sampled, the
        budget or context used up, or streamed). Forced tokens are never watched."""
        k = self.n_gen[slots]
        self.out[slots, k] = out
        sampled = forced < 0
        self.n_gen[slots] += 1
        hit = (self.watch[slots] == out[:, :1]).any(1) & sampled
        return hit | (k + 1 >= self.limit[slots]) | self.streamed[slots]

    def lists(self, slot):
        """(tokens, logprobs, mask) of slot's sample as Python lists, as a Completion holds them."""
        k = self.n_gen[slot]
        out = self.out[slot, :k]
        return out[:, 0].astype(np.int64).tolist(), out[:, 1].tolist(), (self.forced[slot, :k] < 0).astype(int).tolist()


# --- the engine ---------------------------------------------------------------------------------


class Engine:
    def __init__(
        self,
        model,
        tokenizer,
        batch_size=64,
        max_len=None,
        cuda_graph=None,
        tool=None,
        tool_timeout=1.0,
        prefill_tokens=16384,
        dtype=None,
        share_weights=False,
    ):
        cfg = model.config
        self.tokenizer = tokenizer
        self.max_len = cfg.sequence_len if max_len is None else max_len
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 2 <= self.max_len <= cfg.sequence_len:
            raise ValueError(f"max_len must be in [2, {cfg.sequence_len}] (the model's context), got {self.max_len}")
        if share_weights and dtype is not None:
            raise ValueError(
                "dtype sets the precision of the engine's own copy of the weights: it has no meaning with share_weights"
            )
        self.batch_size, self.vocab_size = batch_size, cfg.vocab_size
        self.device = next(model.parameters()).device
        # sampling reads every weight once per token: a copy in the inference precision (bf16 on CUDA) halves
        # that traffic and never re-casts fp32 master weights under autocast. Sharing the model itself is for
        # exact fp32 checks; the trainer's updates are then seen without load_weights().
        self.source = model
        if share_weights:
            self.model, self.flat_weights = model, None
        else:
            dtype = dtype or low_precision_dtype(self.device)
            self.model, self.flat_weights = inference_copy(model, dtype)
        self.params = dict(self.model.named_parameters())  # by name: what load_weights copies into
        self.tool = calculator if tool is None else tool
        self.tool_timeout, self.prefill_tokens = tool_timeout, prefill_tokens
        # every forward runs in this precision, on these attention kernels (decode.attention_backends says why they are pinned)
        self.autocast = engine_autocast(self.device, self.model.lm_head.weight.dtype)
        self.attention = attention_backends(self.device)
        self.markup = ToolMarkup(tokenizer)
        self.default_stops = self.markup.stops

        self.cache = new_kv_cache(self.model, batch_size, self.max_len, self.device)
        self.lockstep = None if share_weights else LockstepDecode(self.model, self.cache)
        B, dev = batch_size, self.device
        # each slot's next input token: the one per-slot state on the device (a static tensor for the CUDA graphs)
        self.input_ids = torch.zeros(B, dtype=torch.long, device=dev)
        # the rest of it on the host, read each step with array ops (never a Python loop over the rows)
        self.records = SlotRecords(B, self.max_len, self.vocab_size)
        self.slots = [None] * B  # busy slots are 0..n_busy-1 between steps (see _compact)
        self.n_busy, self.holes = 0, []  # holes: slots freed since the last _compact
        self.prefills = 0  # prefills so far: numbers each one's rows (records.prefill)

        self.pending = collections.deque()  # samples waiting for a slot, a request's samples next to each other
        self.live = set()  # handles not finished yet (abort() cancels them all)
        self.lock = threading.Condition()  # guards pending/live/cancel_requested; serve_forever sleeps on it
        self.step_lock = threading.RLock()  # one step at a time, whichever thread drives
        self.cancel_requested = False
        self.serving, self.stopping = False, False

        # static shapes: decode batch sizes 1, 2, 4, ... batch_size and attention lengths 64, 128, ... max_len
        self.sizes = sorted({min(1 << i, B) for i in range(B.bit_length() + 1)})
        self.buckets = [L for L in (64 << i for i in range(32)) if L < self.max_len] + [self.max_len]
        self.graphs = {}
        if (self.device.type == "cuda") if cuda_graph is None else cuda_graph:
            args = (self._forward_step, self.cache, self.sizes, self.buckets, self.input_ids, self.vocab_size)
            self.graphs = checked_decode_graphs(*args)
        self.use_cuda_graph = bool(self.graphs)  # none when a graph did not reproduce the eager step

    # --- public API -----------------------------------------------------------------------------
    def submit(self, request, stream=False):
        """Queue a request and return its Handle at once. Thread-safe."""
        return self.submit_all([request], stream)[0]

    def submit_all(self, requests, stream=False):
        """Queue several requests -> their Handles. All are checked before any is queued, and the samples of each
        request stay next to each other in the queue (so they share one prefill). Thread-safe."""
        for r in requests:
            check_request(r, self.max_len, self.vocab_size)
        handles = [Handle(self, r, stream) for r in requests]
        with self.lock:
            self.pending.extend(s for h in handles for s in h.samples)
            self.live.update(handles)
            self.lock.notify_all()
        return handles

    def submit_and_wait(self, requests):
        """Run requests to the end -> for each request, in order, its list of num_samples Completions."""
        handles = self.submit_all(list(requests))
        return [h.result() for h in handles]

    def stream(self, request):
        """One sample, token by token: yields {"token", "logprob", "mask"} dicts, then {"status", "completion"}.
        Closing the generator early cancels the request."""
        if request.num_samples != 1:
            raise ValueError(f"stream() generates one sample, got num_samples={request.num_samples}")
        handle = self.submit(request, stream=True)
        return self._stream_events(handle)

    def abort(self):
        """Abort every request in flight or queued: its samples end "aborted" with what they have so far."""
        with self.lock:
            live = list(self.live)
        self._cancel(live)

    @torch.no_grad()
    def load_weights(self, model=None):
        """Refresh the engine's copy of the weights from model (default: the model it was built from), e.g.
        after each optimizer step. In place, so the CUDA graphs keep reading the right addresses; one fused
        multi-tensor copy that casts to the inference dtype on the way. Nothing to do with share_weights."""
        if self.flat_weights is None:
            return
        src = dict((model or self.source).named_parameters())
        if src.keys() != self.params.keys() or any(src[n].shape != p.shape for n, p in self.params.items()):
            raise ValueError("load_weights: the model's parameters do not match the engine's (names or shapes differ)")
        with self.step_lock:  # never between a step's forward and its sampling
            torch._foreach_copy_(list(self.params.values()), [src[n].detach() for n in self.params])

    def attention_kernels(self):
        """One line for the log: the SDPA kernel each phase is pinned to."""
        graphs = ", CUDA graphs" if self.use_cuda_graph else ""
        kernel = KERNEL_NAMES[self.attention[0]]
        return f"engine attention: prefill = SDPA {kernel}, decode = SDPA {kernel}{graphs} (both pinned)"

    def serve_forever(self):
        """Step the engine in this thread until shutdown() (run it in a daemon thread): requests submitted from
        any number of threads then share one continuous batch."""
        self.serving, self.stopping = True, False
        try:
            while True:
                with self.lock:
                    while not self.stopping and not self._has_work():
                        self.lock.wait()
                    if self.stopping:
                        return
                try:
                    self.step()
                except Exception:  # the failed requests got status "error"; keep serving the next ones
                    traceback.print_exc()
        finally:
            self.serving = False

    def shutdown(self):
        with self.lock:
            self.stopping = True
            self.lock.notify_all()

    # --- submission -----------------------------------------------------------------------------
    def _stream_events(self, handle):
        try:
            for ev in handle:
                ev = dict(ev)
                del ev["sample"]
                yield ev
        finally:
            if not handle.done:
                handle.cancel()

    def _cancel(self, handles):
        with self.lock:
            for h in handles:
                h.cancelled = True
            self.cancel_requested = True
            self.lock.notify_all()

    def _has_work(self):
        return bool(self.pending) or self.cancel_requested or self.n_busy > 0

    # --- one step -------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self):
        """One turn of the engine's loop: end cancelled samples, move queued samples into the free slots and prefill
        their prompts, decode one token in every busy slot. Returns False when there was nothing to do. A slot is free
        the moment its sample ends and the busy ones are compacted before admitting, so a slot a cancel freed is
        refilled in this same step; nothing marks it free later (a deferred "mark free" once reset such a refilled row
        to position 0 at every step, and the new request decoded garbage)."""
        with self.step_lock:
            try:
                if self.cancel_requested:  # the only holes a step starts with: every step ends compacted
                    self._drop_cancelled()
                    self._compact()
                # admit: queued samples take the free slots n_busy.. and start their records there (one whose prefill
                # fails ends empty, not with the slot's last sample's tokens), a request's samples next to each other
                # (one group, one prefill). Prompts are prefilled together, up to prefill_tokens padded tokens a forward
                with self.lock:
                    free = min(self.batch_size - self.n_busy, len(self.pending))
                    take = [self.pending.popleft() for _ in range(free)]
                for slot, s in enumerate(take, start=self.n_busy):
                    s.slot, self.slots[slot] = slot, s
                    self.records.fill(s, self.markup.python_end)
                self.n_busy += len(take)
                chunk, longest = [], 0
                for g in [list(samples) for _, samples in itertools.groupby(take, key=lambda s: s.handle)]:
                    length = len(g[0].handle.request.prompt_ids)
                    if chunk and (len(chunk) + 1) * max(longest, length) > self.prefill_tokens:
                        self._prefill_or_fail(chunk)
                        chunk, longest = [], 0
                    chunk.append(g)
                    longest = max(longest, length)
                if chunk:
                    self._prefill_or_fail(chunk)
                self._compact()
                # decode: one token for each busy slot 0..n-1, run as the smallest ladder batch that holds them
                n = self.n_busy
                if n:
                    size = next(b for b in self.sizes if b >= n)
                    # the idle rows of the batch decode garbage at position 0, never past the cache
                    self.cache.pos[n:size] = 0
                    logits = self._decode_logits(size)
                    # only the busy rows are sampled (the idle ones decoded garbage)
                    self.input_ids[:n] = self._sample_and_record(logits[:n], np.arange(n))
                    self._compact()
                return bool(self.n_busy) or bool(self.pending)
            except BaseException as e:  # the shared decode step failed: nothing in flight can go on
                self._fail_all()
                if isinstance(e, torch.OutOfMemoryError):
                    raise MemoryError(
                        f"out of memory while sampling with batch_size={self.batch_size}, "
                        f"max_len={self.max_len}: use a smaller batch_size (or max_len)"
                    ) from e
                raise

    def _drop_cancelled(self):
        with self.lock:
            self.cancel_requested = False
            dropped = [s for s in self.pending if s.handle.cancelled]
            self.pending = collections.deque(s for s in self.pending if not s.handle.cancelled)
        for s in dropped + [
            s for s in self.slots[: self.n_busy + len(self.holes)] if s is not None and s.handle.cancelled
        ]:
            self._finish(s, "aborted")

    def _prefill_or_fail(self, groups):
        """Prefill groups; if that fails, each group alone, so a failure ends only the request it belongs to."""
        try:
            self._prefill(groups)
        except Exception as e:
            if len(groups) == 1:
                return self._fail(groups[0][0].handle, e)
            for g in groups:
                self._prefill_or_fail([g])

    def _prefill(self, groups):
        dev = self.device
        prompts = [torch.tensor(g[0].handle.request.prompt_ids) for g in groups]
        # each prompt's row (its first sample's) and its length, in one host -> device copy
        first, lens = torch.tensor([[g[0].slot for g in groups], [len(p) for p in prompts]], device=dev)
        self.cache.pos[first] = 0
        last = (torch.arange(len(groups), device=dev), lens - 1)  # each prompt's last token
        logits = self._forward(torch.nn.utils.rnn.pad_sequence(prompts, batch_first=True).to(dev), first, last)
        # a short prompt's padding left garbage past its end: the mask never shows it and decode overwrites it
        self.cache.pos[first] = lens
        samples = [s for g in groups for s in g]
        slots = np.array([s.slot for s in samples])
        which = np.array([i for i, g in enumerate(groups) for _ in g])  # the group of each sample
        rows, which_t = torch.from_numpy(np.stack([slots, which])).to(dev)  # one host -> device copy
        if len(samples) > len(groups):  # prefix sharing: a request's other samples start from a copy of its first row
            self.cache.copy_rows(first[which_t], rows)
        # each prefill's number: rows with one number hold the same prompt KV (what _shared_prompts looks for)
        self.records.prefill[slots] = self.prefills + 1 + which
        self.prefills += len(groups)
        self.input_ids[rows] = self._sample_and_record(logits[which_t], slots)

    def _compact(self):
        """Keep the busy slots a prefix 0..n_busy-1: the last busy samples move into the holes ended ones left
        (their KV rows and slot state are copied once), so decode can run just the first rows of the cache.
        Work in the number of holes, not the batch."""
        n, top = self.n_busy, self.n_busy + len(self.holes)  # slots top.. were free before these holes opened
        holes = sorted(i for i in self.holes if i < n)
        movers = [s for s in self.slots[n:top] if s is not None]
        self.holes = []
        if not holes:
            return
        src = [s.slot for s in movers]
        src_t, dst_t = torch.tensor([src, holes], device=self.device)
        self.cache.copy_rows(src_t, dst_t)
        self.input_ids[dst_t] = self.input_ids[src_t]
        self.records.move(src, holes)
        for s, i in zip(movers, holes):
            self.slots[s.slot], self.slots[i], s.slot = None, s, i

    def _decode_logits(self, size):
        """Logits (size, V) of one decode step of rows 0..size-1, each writing at its position."""
        if not self.use_cuda_graph:
            return self._forward_step(size)
        # the graph of the smallest attention-length bucket that holds the longest busy row's keys
        rec, n = self.records, self.n_busy
        need = int((rec.prompt_len[:n] + rec.n_gen[:n]).max())
        graph, logits = self.graphs[size, self._bucket(need)]
        graph.replay()
        return logits  # a static tensor: read it before the next replay

    def _forward_step(self, size):
        # eager, or the body a CUDA graph records (then cache.static is set and attend_len is a bucket). Eager rows
        # that all stand at one position (batch 1, a prompt's samples) take the model's lean step, on the engine's own
        # copy (a shared model may be sharded: its blocks' hooks must run)
        pos = None if self.cache.static or self.lockstep is None else self.cache.lockstep(size)
        if pos is not None:  # rows from one prefill (a prompt's samples) share its KV: read it once
            with self.autocast, sdpa_kernel(self.attention):
                return self.lockstep(self.input_ids[:size], pos, *self._shared_prompts(size))
        return self._forward(self.input_ids[:size, None], slice(0, size), (slice(None), 0))

    def _forward(self, idx, rows, last):
        """The logits at the positions h[last] of the model's hidden states h (B, T, C) of the tokens idx (B, T)
        appended to cache rows `rows` (a slice of leading rows or a LongTensor, see KVCache.rows), on the pinned
        attention kernels: only the positions that are sampled from go through the head."""
        self.cache.rows = rows
        try:
            with self.autocast, sdpa_kernel(self.attention):
                h = self.model.hidden_states(idx, kv_cache=self.cache)
                return self.model.logits_from_hidden(h[last])
        finally:
            self.cache.rows = slice(None)

    def _shared_prompts(self, size):
        """(P, n) when rows 0..size-1 come in groups of n > 1 rows, each group one prefill's samples, every prompt
        P tokens long (a prompt's samples; equally long prompts' samples side by side): the lockstep step then reads
        each group's prompt KV once. (0, None): no sharing."""
        ids, lens = self.records.prefill[:size], self.records.prompt_len[:size]
        n = int(np.argmax(ids != ids[0])) or size  # the first group's rows
        if n < 2 or size % n or (lens != lens[0]).any():
            return 0, None
        runs = ids.reshape(-1, n)
        if (runs != runs[:, :1]).any():
            return 0, None
        return int(lens[0]), n

    def _bucket(self, need):
        return next(L for L in self.buckets if L >= need)

    def _sample_and_record(self, logits, slots):
        """Pick the next token of the samples in `slots` (numpy; logits row i is slots[i]): sampled, or the tool output
        forced in at its position; record it with its log-prob -> the tokens (on the device)."""
        rec = self.records
        forced = rec.forced[slots, rec.n_gen[slots]]
        temperature, top_k, top_p = rec.sampler[slots].T
        # what lets the sampler skip work: no row filters (no sort), none is greedy (no argmax), every T is 0 or 1 (no
        # division). A top_k of the vocab size or more and a top_p of 1 filter nothing: such a row is not sorted anyway
        filtered, greedy = bool(((top_k < self.vocab_size) | (top_p < 1)).any()), temperature == 0
        unit = bool((greedy | (temperature == 1)).all())
        # the step's one host -> device copy: forced tokens, uniforms (made on the host) and settings, in float64
        counter = rec.start[slots] + rec.n_gen[slots]  # how many tokens each sample has drawn
        host = np.stack([forced, uniform_from_counter(rec.seed[slots], counter), temperature, top_k, top_p])
        forced_t, uniform, temperature_t, top_k_t, top_p_t = torch.from_numpy(host).to(self.device)
        if greedy.all():  # every row greedy (an eval, a chat at T = 0): no uniforms, the argmax alone
            uniform = None
        settings = SamplerSettings(temperature_t.float(), top_k_t.long(), top_p_t.float())  # the sampler's dtypes
        tok, logp = sample_with_logprobs(logits, settings, uniform, filtered, bool(greedy.any()), forced_t.long(), unit)
        out = torch.stack([tok.double(), logp.double()], 1).cpu().numpy()  # the step's one device -> host sync
        for i in np.flatnonzero(rec.append(slots, out, forced)):
            self._record(self.slots[slots[i]], int(out[i, 0]), float(out[i, 1]), forced[i] < 0)
        return tok

    def _record(self, s, token, logprob, sampled):
        """The host's part of a token, for a row that needs it: stream it, end the sample, or run its tool call."""
        if s is None or s.out.status != "running":  # its request failed earlier in this step
            return
        h = s.handle
        try:
            if h.events is not None:
                h.events.put({"sample": s.index, "token": token, "logprob": logprob, "mask": int(sampled)})
            if sampled and token in h.stops:
                self._finish(s, "completed")
            elif self.records.n_gen[s.slot] >= self.records.limit[s.slot]:  # its budget, or the context, used up
                self._finish(s, "truncated")
            elif sampled and h.request.use_tools and token == self.markup.python_end:
                source = self.markup.open_call(self.records.lists(s.slot)[0])
                if source is not None:  # the call's output is fed in next
                    output = run_tool(source, self.tool, self.tool_timeout)
                    self.records.force(s.slot, self.markup.output_tokens(output))
        except Exception as e:  # e.g. its tool output cannot be tokenized: that request ends, no other
            self._fail(h, e)

    def _finish(self, s, status):
        """End sample s, filling its Completion. Its slot is free at once (the next _admit may reuse it);
        _compact closes the hole."""
        s.out.status = status
        if s.slot is not None:
            s.out.tokens, s.out.logprobs, s.out.mask = self.records.lists(s.slot)
            self.holes.append(s.slot)
            self.slots[s.slot], s.slot = None, None
            self.n_busy -= 1
        h = s.handle
        if h.events is not None:
            h.events.put({"sample": s.index, "status": status, "completion": s.out})
        if all(c.status != "running" for c in h.completions):
            with self.lock:
                self.live.discard(h)
            h.finished.set()

    def _fail(self, handle, error):
        """End every sample of one request with status "error" (the error is kept in handle.error)."""
        handle.error = f"{type(error).__name__}: {error}"
        with self.lock:
            queued = [s for s in self.pending if s.handle is handle]
            self.pending = collections.deque(s for s in self.pending if s.handle is not handle)
        for s in queued + [s for s in self.slots if s is not None and s.handle is handle]:
            self._finish(s, "error")

    def _fail_all(self):
        """After an exception in the shared step: end everything in flight with status "error" and start clean."""
        with self.lock:
            pending, self.pending = list(self.pending), collections.deque()
        for s in [s for s in self.slots if s is not None] + pending:
            self._finish(s, "error")
        self.n_busy, self.holes = 0, []
        self.cache.rows = slice(None)
        try:
            self.cache.pos.zero_()
        except RuntimeError:  # the device itself may be what failed
            pass
