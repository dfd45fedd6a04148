"""
The sampling engine: RL rollouts and the chat UI both run on it.

- one pre-allocated KV cache of batch_size rows ("slots"), each row at its own position
- a request's prompt is prefilled once, straight into a free row, and its KV copied to the rows of its
  other samples (prefix sharing)
- continuous batching: a slot whose sample ends (stop token, max_tokens, context, abort) is refilled from
  the queue at the next step, so the batch stays full while response lengths vary
- busy samples always sit in slots 0..n-1 (a sample that ends leaves a hole the last busy one moves into),
  so a decode step is one forward of only the smallest ladder size (1, 2, 4, ... batch_size) >= n rows:
  one user on a big engine decodes about as fast as on a batch-1 engine. On CUDA the step is replayed from
  a CUDA graph (one per ladder size and attention-length bucket, captured up front), eager on CPU/MPS
- it samples from its own inference copy of the model (bf16 on CUDA, fp32 elsewhere; weights in one flat
  buffer), refreshed from the trainer's model by load_weights(); share_weights=True uses the model itself
- sampling is batched (temperature, top-k, top-p) and its randomness is a counter-based hash of
  (request seed, sample index, token index): a sample does not depend on what else shares the batch
- every token comes with its mask (1 sampled, 0 forced tool output) and its log-prob under the distribution
  it was sampled from, log_softmax(logits / T) at the request's temperature (T = 1 for greedy), before top-k
  /top-p: exactly what the trainer's GPT.token_logprobs(..., temperature=T) computes, so on-policy importance
  weights are 1. Forced tokens get their true log-prob too, not 0. Top-k/top-p sampling is off-policy: the
  trainer cannot apply the filter, so those log-probs are of the unfiltered tempered distribution
- a failure that belongs to one request (its prefill, its tool call) ends that request with status "error"
  and nothing else; only a failure of the shared decode step ends everything in flight
- tool use: <|python_start|>expr<|python_end|> runs a calculator (with a timeout) and its result is forced
  in as <|output_start|>result<|output_end|>

    engine = Engine(model, tokenizer, batch_size=64)
    completions = engine.generate([Request(prompt_ids, num_samples=8, temperature=1.0, seed=0)])
"""
import collections
import math
import queue
import threading
import traceback
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from nanorl.calculator import calculator


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


# --- tools ---------------------------------------------------------------------------------------

def run_tool(expr, tool=None, timeout=1.0, max_chars=200):
    """Run tool(expr) -> str in a daemon thread. A failure or a timeout comes back as an error string, never
    an exception: the model sees it as the tool's output. A thread cannot be killed, so a runaway tool keeps
    its thread until it returns; the engine only stops waiting (the calculator itself is bounded)."""
    tool = calculator if tool is None else tool
    result = [f"Error: timed out after {timeout}s"]

    def target():
        try:
            result[0] = str(tool(expr))
        except Exception as e:
            result[0] = f"Error: {type(e).__name__}: {e}"

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    return result[0][:max_chars]


# --- sampling -----------------------------------------------------------------------------------

_MASK64 = (1 << 64) - 1


def _signed64(x):
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


def _mix64(x):
    """splitmix64's finalizer on a Python int: turns (seed, sample index) into well-spread row seeds."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


_GOLDEN, _M1, _M2 = _signed64(0x9E3779B97F4A7C15), _signed64(0xBF58476D1CE4E5B9), _signed64(0x94D049BB133111EB)


def _shr(x, s):
    # logical right shift of int64 tensors (torch's >> is arithmetic: it copies the sign bit)
    return (x >> s) & ((1 << (64 - s)) - 1)


def uniform_from_counter(seed, counter):
    """(B,) int64 row seeds and token counters -> (B,) float64 uniforms in [0, 1): splitmix64 on device.
    Counter-based: token t of a sample gets the same number whatever else is in the batch, and no
    per-request generator object has to be stepped in Python."""
    x = seed + counter * _GOLDEN  # int64 arithmetic wraps, as splitmix64 wants
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    x = x ^ _shr(x, 31)
    return _shr(x, 11).double() / float(1 << 53)


def tempered(logits, temperature):
    """(logits - row max) / T per row (T = 1 where T = 0, greedy): the log-probs the engine records are
    log_softmax of this. Subtracting the max first keeps it total for any T > 0: at T = 1e-40 the top
    token gets 0 and the rest -inf, where logits / T would overflow to inf - inf = NaN."""
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    return (logits - logits.amax(dim=-1, keepdim=True)) / t[:, None]


def sample_tokens(logits, temperature, top_k, top_p, uniform, filtered=True):
    """
    One token per row of fp32 logits (B, V) by inverse-CDF sampling with one uniform per row.
    temperature (B,) (0 = greedy), top_k (B,) long (V = off), top_p (B,) (1 = off); filtered=False skips
    the sort when no row uses top-k/top-p. Total: whatever the values, the most likely token stays a candidate.
    """
    V = logits.size(-1)
    x, order = tempered(logits, temperature), None
    if filtered:
        # only the rows that filter are sorted: a row's token must not depend on whether a filtering request
        # shares its batch (inverse-CDF sampling in sorted order picks another token for the same uniform)
        rank = torch.arange(V, device=logits.device).expand_as(x)
        sorts = ((top_k < V) | (top_p < 1))[:, None]
        x_sorted, order_sorted = x.sort(dim=-1, descending=True)
        x, order = torch.where(sorts, x_sorted, x), torch.where(sorts, order_sorted, rank)
    probs = torch.softmax(x, dim=-1)
    if filtered:
        # top-k and top-p both keep a prefix of the sorted tokens; rank 0 is kept whatever top_p is (a top_p of
        # 1e-50 is 0 in float32, and "mass before it < 0" would keep nothing)
        keep = (rank < top_k[:, None]) & (probs.cumsum(-1) - probs < top_p[:, None])
        probs = probs * (keep | (rank == 0) | ~sorts)
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    # u < total strictly, so the search lands on a token whose own probability is > 0
    u = torch.minimum(uniform[:, None].float() * total, torch.nextafter(total, torch.zeros_like(total)))
    idx = torch.searchsorted(cdf, u, right=True).clamp(max=V - 1)
    # a parallel cumsum is not exactly monotone; in the rare case that lands on a removed token, take the top one
    idx = torch.where(probs.gather(1, idx) > 0, idx, probs.argmax(-1, keepdim=True))
    if order is not None:
        idx = order.gather(1, idx)
    return torch.where(temperature > 0, idx[:, 0], logits.argmax(-1))


# --- requests in flight -------------------------------------------------------------------------

class Handle:
    """A submitted request. Its completions fill in while it runs; iterate it (submit(..., stream=True))
    for per-token events, or call result() to wait for all of them."""

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


class _Sample:
    """One sample of a request, waiting for a slot or occupying one."""

    def __init__(self, handle, index, row_seed):
        self.handle, self.index, self.row_seed = handle, index, row_seed
        self.out = handle.completions[index]
        self.slot = None
        self.forced = collections.deque()  # tool output tokens waiting to be fed in
        self.expr = None  # tokens of an open <|python_start|> block, else None

    @property
    def length(self):  # prompt + generated tokens; the cache holds all but the last generated one
        return self.out.prompt_len + len(self.out.tokens)


# --- the engine ---------------------------------------------------------------------------------

class Engine:
    def __init__(self, model, tokenizer, batch_size=64, max_len=None, cuda_graph=None, tool=None,
                 tool_timeout=1.0, prefill_tokens=16384, dtype=None, share_weights=False):
        cfg = model.config
        self.tokenizer = tokenizer
        self.max_len = cfg.sequence_len if max_len is None else max_len
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 2 <= self.max_len <= cfg.sequence_len:
            raise ValueError(f"max_len must be in [2, {cfg.sequence_len}] (the model's context), got {self.max_len}")
        if share_weights and dtype is not None:
            raise ValueError("dtype sets the precision of the engine's own copy of the weights: it has no meaning with share_weights")
        self.batch_size, self.vocab_size = batch_size, cfg.vocab_size
        self.device = next(model.parameters()).device
        # sampling reads every weight once per token: a copy in the inference precision (bf16 on CUDA) halves
        # that traffic and never re-casts fp32 master weights under autocast. Sharing the model itself is for
        # exact fp32 checks; the trainer's updates are then seen without load_weights().
        self.source = model
        if share_weights:
            self.model, self.flat_weights = model, None
        else:
            dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
            self.model, self.flat_weights = inference_copy(model, dtype)
        self.tool, self.tool_timeout, self.prefill_tokens = tool, tool_timeout, prefill_tokens
        sp = tokenizer.encode_special
        self.python_start, self.python_end = sp("<|python_start|>"), sp("<|python_end|>")
        self.output_start, self.output_end = sp("<|output_start|>"), sp("<|output_end|>")
        self.default_stops = frozenset([sp("<|assistant_end|>"), tokenizer.get_bos_token_id()])

        self.cache = self._new_cache()
        B, dev = batch_size, self.device
        # per-slot state on the device, written when a slot is filled (static tensors for the CUDA graphs)
        self.input_ids = torch.zeros(B, dtype=torch.long, device=dev)  # each slot's next input token
        self.temperature = torch.ones(B, device=dev)
        self.top_k = torch.full((B,), self.vocab_size, dtype=torch.long, device=dev)
        self.top_p = torch.ones(B, device=dev)
        self.seed = torch.zeros(B, dtype=torch.long, device=dev)
        self.counter = torch.zeros(B, dtype=torch.long, device=dev)  # tokens drawn so far by each slot's sample
        self.slot_state = [self.input_ids, self.temperature, self.top_k, self.top_p, self.seed, self.counter]
        self.slots = [None] * B  # busy slots are always 0..n-1 between steps (see _compact)

        self.pending = collections.deque()  # samples waiting for a slot, a request's samples next to each other
        self.live = set()  # handles not finished yet (abort() cancels them all)
        self.lock = threading.Condition()  # guards pending/live/cancel_requested; serve_forever sleeps on it
        self.step_lock = threading.RLock()  # one step at a time, whichever thread drives
        self.cancel_requested = False
        self.serving, self.stopping = False, False

        # static shapes: decode batch sizes 1, 2, 4, ... batch_size and attention lengths 64, 128, ... max_len
        self.sizes = sorted({min(1 << i, B) for i in range(B.bit_length() + 1)})
        self.buckets = [L for L in (64 << i for i in range(32)) if L < self.max_len] + [self.max_len]
        self.use_cuda_graph = (self.device.type == "cuda") if cuda_graph is None else cuda_graph
        self.graphs = {}
        if self.use_cuda_graph:
            self._capture_graphs()

    # --- public API -----------------------------------------------------------------------------
    def submit(self, request, stream=False):
        """Queue a request and return its Handle at once. Thread-safe."""
        return self._submit([request], stream)[0]

    def generate(self, requests):
        """Run requests to the end -> for each request, in order, its list of num_samples Completions."""
        handles = self._submit(list(requests), stream=False)  # all validated before any is queued
        for h in handles:
            h.result()
        return [h.completions for h in handles]

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
        dst = dict(self.model.named_parameters())
        if src.keys() != dst.keys() or any(src[n].shape != p.shape for n, p in dst.items()):
            raise ValueError("load_weights: the model's parameters do not match the engine's (names or shapes differ)")
        with self.step_lock:  # never between a step's forward and its sampling
            torch._foreach_copy_(list(dst.values()), [src[n].detach() for n in dst])

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

    @torch.no_grad()
    def step(self):
        """End cancelled samples, refill free slots from the queue (prefill), decode one token in every busy
        slot. Returns False when there was nothing to do. A slot is free the moment its sample ends, so _admit
        can refill a slot a cancel freed in this same step; nothing marks it free later (a deferred "mark free"
        once reset such a refilled row to position 0 at every step, and the new request decoded garbage)."""
        with self.step_lock:
            try:
                if self.cancel_requested:
                    self._drop_cancelled()
                self._admit()
                self._compact()
                n = sum(s is not None for s in self.slots)
                if n:
                    self._decode(n)
                    self._compact()
                return bool(n) or bool(self.pending)
            except BaseException as e:  # the shared decode step failed: nothing in flight can go on
                self._fail_all()
                if isinstance(e, torch.OutOfMemoryError):
                    raise MemoryError(f"out of memory while sampling with batch_size={self.batch_size}, "
                                      f"max_len={self.max_len}: use a smaller batch_size (or max_len)") from e
                raise

    # --- submission -----------------------------------------------------------------------------
    def _check(self, r):
        if not isinstance(r, Request):
            raise TypeError(f"expected a Request, got {type(r).__name__}")
        n = len(r.prompt_ids)
        if n == 0:
            raise ValueError("empty prompt: a prompt needs at least one token (e.g. <|bos|>)")
        if n >= self.max_len:
            raise ValueError(f"prompt of {n} tokens is too long for the context of {self.max_len} tokens "
                             f"(it needs room for at least one generated token)")
        bad = [t for t in r.prompt_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt has unknown token ids {bad[:5]}: ids are ints in [0, {self.vocab_size})")
        if r.stop_tokens is not None and any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in r.stop_tokens):
            raise ValueError(f"stop_tokens {r.stop_tokens} has ids outside the vocab (size {self.vocab_size})")
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

    def _submit(self, requests, stream):
        for r in requests:
            self._check(r)
        handles, samples = [], []
        for r in requests:
            stops = self.default_stops if r.stop_tokens is None else frozenset(r.stop_tokens)
            h = Handle(self, r, stops, stream)
            seed = int(torch.randint(0, 2**62, ()).item()) if r.seed is None else r.seed
            base = _mix64(seed)
            samples += [_Sample(h, j, _mix64(base + r.first_sample + j)) for j in range(r.num_samples)]
            handles.append(h)
        with self.lock:
            self.pending.extend(samples)
            self.live.update(handles)
            self.lock.notify_all()
        return handles

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
        return bool(self.pending) or self.cancel_requested or any(s is not None for s in self.slots)

    def _progress(self, handle):
        """Let a waiting caller's work advance: step inline, or wait while a serve_forever thread steps."""
        if self.serving:
            handle.finished.wait(0.1)
        else:
            self.step()

    # --- one step -------------------------------------------------------------------------------
    def _drop_cancelled(self):
        with self.lock:
            self.cancel_requested = False
            dropped = [s for s in self.pending if s.handle.cancelled]
            self.pending = collections.deque(s for s in self.pending if not s.handle.cancelled)
        for s in dropped + [s for s in self.slots if s is not None and s.handle.cancelled]:
            self._finish(s, "aborted")

    def _admit(self):
        """Move queued samples into free slots. Prompts are prefilled together (up to prefill_tokens padded
        tokens per forward), each once, straight into the slot of its request's first sample here."""
        free = [i for i, s in enumerate(self.slots) if s is None]
        with self.lock:
            take = [self.pending.popleft() for _ in range(min(len(free), len(self.pending)))]
        if not take:
            return
        groups = []  # the samples of one request sit next to each other in the queue
        for s, slot in zip(take, free):
            s.slot, self.slots[slot] = slot, s
            if groups and groups[-1][0].handle is s.handle:
                groups[-1].append(s)
            else:
                groups.append([s])
        chunk, longest = [], 0
        for g in groups:
            n = len(g[0].handle.request.prompt_ids)
            if chunk and (len(chunk) + 1) * max(longest, n) > self.prefill_tokens:
                self._prefill_or_fail(chunk)
                chunk, longest = [], 0
            chunk.append(g)
            longest = max(longest, n)
        self._prefill_or_fail(chunk)

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
        prompts = [list(g[0].handle.request.prompt_ids) for g in groups]
        lens = [len(p) for p in prompts]
        T, dev = max(lens), self.device
        idx = torch.tensor([p + [0] * (T - len(p)) for p in prompts], device=dev)
        first = torch.tensor([g[0].slot for g in groups], device=dev)
        self.cache.pos[first] = 0
        self.cache.rows = first
        try:
            with self._autocast():
                h = self.model.hidden_states(idx, kv_cache=self.cache)
        finally:
            self.cache.rows = None
        # a short prompt's padding left garbage past its end: the mask never shows it and decode overwrites it
        lens_t = torch.tensor(lens, device=dev)
        self.cache.pos[first] = lens_t
        with self._autocast():
            logits = self.model.logits_from_hidden(h[torch.arange(len(groups), device=dev), lens_t - 1])
        samples = [s for g in groups for s in g]
        fan = [(g[0].slot, s.slot) for g in groups for s in g[1:]]
        if fan:  # prefix sharing: the other samples of a request start from a copy of its prefilled row
            src, dst = zip(*fan)
            self.cache.copy_rows(torch.tensor(src, device=dev), torch.tensor(dst, device=dev))
        rows = torch.tensor([s.slot for s in samples], device=dev)
        self._set_slot_params(samples, rows)
        which = torch.tensor([i for i, g in enumerate(groups) for _ in g], device=dev)
        filtered = any(g[0].handle.filtered for g in groups)
        tokens = self._choose_and_record(logits[which], rows, samples, filtered)
        self.input_ids[rows] = tokens

    def _set_slot_params(self, samples, rows):
        reqs = [s.handle.request for s in samples]
        dev, V = self.device, self.vocab_size
        self.temperature[rows] = torch.tensor([float(r.temperature) for r in reqs], device=dev)
        self.top_k[rows] = torch.tensor([min(r.top_k or V, V) for r in reqs], device=dev)
        self.top_p[rows] = torch.tensor([float(r.top_p or 1.0) for r in reqs], device=dev)
        self.seed[rows] = torch.tensor([_signed64(s.row_seed) for s in samples], device=dev)
        self.counter[rows] = torch.tensor([s.handle.request.start_counter for s in samples], device=dev)

    def _compact(self):
        """Keep the busy slots a prefix 0..n-1: the last busy samples move into the holes ended ones left
        (their KV rows and slot state are copied once), so decode can run just the first rows of the cache."""
        n = sum(s is not None for s in self.slots)
        holes = [i for i in range(n) if self.slots[i] is None]
        movers = [s for s in self.slots[n:] if s is not None]
        if not holes:
            return
        src = torch.tensor([s.slot for s in movers], device=self.device)
        dst = torch.tensor(holes, device=self.device)
        self.cache.copy_rows(src, dst)
        for t in self.slot_state:
            t[dst] = t[src]
        for s, i in zip(movers, holes):
            self.slots[s.slot], self.slots[i], s.slot = None, s, i

    def _decode(self, n):
        """One token for each of the n busy slots 0..n-1, run as the smallest ladder batch that holds them."""
        size = next(b for b in self.sizes if b >= n)
        self.cache.pos[n:size] = 0  # the idle rows of the batch decode garbage at position 0, never past the cache
        busy = self.slots[:n]
        logits = self._decode_logits(size, max(s.length for s in busy))
        tokens = self._choose_and_record(logits, slice(0, size), self.slots[:size], any(s.handle.filtered for s in busy))
        self.input_ids[:size] = tokens

    def _decode_logits(self, size, need):
        """Logits (size, V) of one decode step of rows 0..size-1; each writes at its position, reads <= need keys."""
        if not self.use_cuda_graph:
            return self._forward_step(size)
        graph, logits = self.graphs[size, self._bucket(need)]
        graph.replay()
        return logits  # a static tensor: read it before the next replay

    def _forward_step(self, size):
        # eager, or the body a CUDA graph records (then cache.static is set and attend_len is a bucket).
        # The attention kernel is pinned, not left to SDPA's choice: a graph freezes whichever kernel ran at
        # capture, so a torch or cuDNN upgrade must not swap it silently. Memory-efficient attention is the
        # CUDA kernel that takes a boolean mask (flash takes none); on CPU the plain math kernel.
        self.cache.rows = slice(0, size)
        try:
            with self._autocast(), sdpa_kernel(self.decode_attention()):
                return self.model(self.input_ids[:size, None], kv_cache=self.cache)[:, 0]
        finally:
            self.cache.rows = None

    def decode_attention(self):
        """The SDPA backends allowed inside a decode step (see _forward_step)."""
        if self.device.type == "cuda":
            return [SDPBackend.EFFICIENT_ATTENTION]
        return [SDPBackend.MATH]

    def _bucket(self, need):
        return next(L for L in self.buckets if L >= need)

    def _choose_and_record(self, logits, rows, samples, filtered):
        """Pick each row's next token (sampled, or its forced tool token), its log-prob, record them."""
        forced = [s.forced.popleft() if s is not None and s.forced else -1 for s in samples]
        u = uniform_from_counter(self.seed[rows], self.counter[rows])
        temperature = self.temperature[rows]
        tok = sample_tokens(logits, temperature, self.top_k[rows], self.top_p[rows], u, filtered)
        if any(f >= 0 for f in forced):
            f = torch.tensor(forced, device=self.device)
            tok = torch.where(f >= 0, f, tok)
        # the log-prob of the distribution sampled from (before top-k/top-p, which the trainer cannot apply)
        logp = torch.log_softmax(tempered(logits, temperature), dim=-1).gather(1, tok[:, None])[:, 0]
        self.counter[rows] += 1
        host = torch.stack([tok.double(), logp.double()]).tolist()  # the step's one device -> host sync
        for s, t, lp, f in zip(samples, host[0], host[1], forced):
            if s is None or s.out.status != "running":  # an idle row, or its request failed earlier in this loop
                continue
            try:
                self._record(s, int(t), lp, 0 if f >= 0 else 1)
            except Exception as e:  # e.g. its tool output cannot be tokenized: that request ends, no other
                self._fail(s.handle, e)
        return tok

    def _record(self, s, token, logprob, mask):
        out, h = s.out, s.handle
        out.tokens.append(token)
        out.logprobs.append(logprob)
        out.mask.append(mask)
        if h.events is not None:
            h.events.put({"sample": s.index, "token": token, "logprob": logprob, "mask": mask})
        if mask and token in h.stops:
            return self._finish(s, "completed")
        if mask and h.request.use_tools:
            self._tool_state(s, token)
        if len(out.tokens) >= h.request.max_tokens or s.length >= self.max_len:
            self._finish(s, "truncated")

    def _tool_state(self, s, token):
        if token == self.python_start:
            s.expr = []
        elif s.expr is not None and token == self.python_end:
            result = run_tool(self.tokenizer.decode(s.expr), self.tool, self.tool_timeout)
            s.forced.extend([self.output_start] + self.tokenizer.encode(result) + [self.output_end])
            s.expr = None
        elif s.expr is not None:
            s.expr.append(token)

    def _finish(self, s, status):
        """End sample s. Its slot is free at once (the next _admit may reuse it); _compact closes the hole."""
        s.out.status = status
        if s.slot is not None:
            self.slots[s.slot] = None
            s.slot = None
        h = s.handle
        if h.events is not None:
            h.events.put({"sample": s.index, "status": status, "completion": s.out})
        h.remaining -= 1
        if h.remaining == 0:
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
        self.cache.rows = None
        try:
            self.cache.pos.zero_()
        except RuntimeError:  # the device itself may be what failed
            pass

    def _check_invariants(self):
        """For tests, after any step: every sample in a slot knows its slot and is running, the busy slots are
        exactly 0..n-1, no queued sample holds a slot, and each busy row's cache holds its sample's tokens but
        the last one, which is the row's next input."""
        n = sum(s is not None for s in self.slots)
        assert all(s is not None for s in self.slots[:n]), f"busy slots are not a prefix: {self.slots}"
        assert all(s.slot == i and s.out.status == "running" for i, s in enumerate(self.slots[:n]))
        assert len({id(s) for s in self.slots[:n]}) == n, "a sample sits in two slots"
        assert all(s.slot is None and s.out.status == "running" for s in self.pending)
        assert self.cache.pos[:n].tolist() == [s.length - 1 for s in self.slots[:n]], "a row's cache is out of step"
        assert self.input_ids[:n].tolist() == [s.out.tokens[-1] for s in self.slots[:n]], "a row's next input is wrong"
        assert self.cache.rows is None

    # --- memory, precision, CUDA graphs ---------------------------------------------------------
    def _autocast(self):
        # only for fp32 weights on CUDA (share_weights); cache_enabled=False: autocast's weight-cast cache must
        # not outlive a CUDA graph capture
        if self.device.type == "cuda" and self.model.lm_head.weight.dtype == torch.float32:
            return torch.amp.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False)
        return nullcontext()

    def _new_cache(self):
        cfg = self.model.config
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        nbytes = 2 * cfg.n_layer * self.batch_size * cfg.n_kv_head * self.max_len * self.model.head_dim * dtype.itemsize
        avail = _free_memory(self.device)
        msg = (f"the KV cache for batch_size={self.batch_size}, max_len={self.max_len} needs {nbytes / 1e9:.2f} GB"
               + (f" but only {avail / 1e9:.2f} GB is free" if avail is not None else "")
               + ": use a smaller batch_size (or max_len, or a model with fewer KV heads)")
        if avail is not None and nbytes > avail:
            raise MemoryError(msg)
        try:
            return self.model.new_kv_cache(self.batch_size, self.max_len, dtype=dtype)
        except torch.OutOfMemoryError as e:
            raise MemoryError(msg) from e

    @torch.no_grad()
    def _capture_graphs(self):
        """Capture one decode step per (ladder batch size, attention-length bucket) while the cache is empty,
        so the warm-up runs cannot overwrite anyone's KV. A step then replays the smallest batch that holds its
        busy rows and the smallest bucket that covers its longest row: static shapes, one launch, and neither
        idle slots nor short rows pay for the whole cache. The graphs read the weights in place: load_weights()
        (an in-place copy) is seen, swapped tensors are not."""
        cache, pool = self.cache, torch.cuda.graph_pool_handle()
        cache.static = True
        try:
            for size in self.sizes:
                for L in self.buckets:
                    cache.attend_len = L
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):  # warm up outside the capture (cuBLAS workspaces, kernel choice)
                        for _ in range(2):
                            cache.pos.zero_()
                            self._forward_step(size)
                    torch.cuda.current_stream().wait_stream(side)
                    cache.pos.zero_()
                    graph = torch.cuda.CUDAGraph()
                    # one pool for all graphs: they never run at once, and each step reads its logits right away
                    with torch.cuda.graph(graph, pool=pool):
                        logits = self._forward_step(size)
                    self.graphs[size, L] = (graph, logits)
        finally:
            cache.static, cache.attend_len = False, None
            cache.pos.zero_()


@torch.no_grad()
def inference_copy(model, dtype):
    """A frozen copy of model for sampling -> (copy, flat): every parameter of the copy is a view of one flat
    buffer `flat` of dtype, so the whole set of weights is one tensor (one copy, one broadcast). Tied parameters
    stay tied; buffers (the rotary tables) keep their own dtype."""
    with torch.device("meta"):
        twin = type(model)(model.config)
    unique = {id(p): p for p in model.parameters()}
    flat = torch.empty(sum(p.numel() for p in unique.values()), dtype=dtype, device=next(model.parameters()).device)
    views, offset = {}, 0
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in views:
            view = flat[offset:offset + p.numel()].view(p.shape).copy_(p.detach())
            views[id(p)], offset = torch.nn.Parameter(view, requires_grad=False), offset + p.numel()
        module, _, attr = name.rpartition(".")
        setattr(twin.get_submodule(module), attr, views[id(p)])
    for name, b in model.named_buffers():
        module, _, attr = name.rpartition(".")
        twin.get_submodule(module)._buffers[attr] = b.detach().clone()
    if any(t.is_meta for t in [*twin.parameters(), *twin.buffers()]):
        raise ValueError(f"{type(model).__name__} has parameters or buffers its own constructor does not make: "
                         "the engine cannot copy it (pass share_weights=True)")
    return twin.eval(), flat


def _free_memory(device):
    """Bytes a new allocation on device can get, or None when it cannot be told."""
    if device.type == "cuda":  # free on the GPU, plus what torch's caching allocator holds but does not use
        return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type == "cpu":
        try:  # MemAvailable counts reclaimable page cache, unlike "free"
            with open("/proc/meminfo") as f:
                return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
        except (OSError, StopIteration, ValueError):
            return None
    return None


# --- rendering, shared by the CLI and the web server --------------------------------------------

def assistant_parts(tokenizer, tokens):
    """Generated tokens -> assistant content parts [{"type": "text"|"python"|"python_output", "text"}],
    the inverse of Tokenizer.render_conversation's assistant turn. Stops at <|assistant_end|> / <|bos|>."""
    sp = tokenizer.encode_special
    starts = {sp("<|python_start|>"): "python", sp("<|output_start|>"): "python_output"}
    ends = {sp("<|python_end|>"), sp("<|output_end|>")}
    stops = {sp("<|assistant_end|>"), tokenizer.get_bos_token_id()}
    parts, kind, buf = [], "text", []

    def flush():
        if buf or kind != "text":  # an empty tool call is still a tool call
            parts.append({"type": kind, "text": tokenizer.decode(buf)})
        buf.clear()

    for t in tokens:
        if t in stops:
            break
        if t in starts or t in ends:
            flush()
            kind = starts.get(t, "text")
        else:
            buf.append(t)
    flush()
    return parts


class TextStream:
    """Printable text of a token stream: holds back the bytes of a UTF-8 character split across tokens, shows
    tool use as <<expr=result>> (GSM8K's calculator notation) and drops stop tokens."""

    def __init__(self, tokenizer):
        sp = tokenizer.encode_special
        self.tokenizer, self.buf = tokenizer, []
        self.marks = {sp("<|python_start|>"): "<<", sp("<|python_end|>"): "", sp("<|output_start|>"): "=",
                      sp("<|output_end|>"): ">>", sp("<|assistant_end|>"): "", tokenizer.get_bos_token_id(): ""}

    def push(self, token):
        if token in self.marks:
            return self.flush() + self.marks[token]
        self.buf.append(token)
        text = self.tokenizer.decode(self.buf)
        if text.endswith("\ufffd") and len(self.buf) < 8:
            return ""  # probably half a character: wait for the rest
        self.buf = []
        return text

    def flush(self):
        text = self.tokenizer.decode(self.buf) if self.buf else ""
        self.buf = []
        return text
