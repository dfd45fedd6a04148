"""
What a server needs around the sampling engine: engine replicas stepped by their own threads, a request's token
stream turned into text (stop strings, tool parts), log-probs and OpenAI's response chunks, and the serving counters
with their Prometheus text. No routes here (scripts/chat_web.py) and no HTTP middleware (nanorl/middleware.py).
"""

import asyncio
import collections
import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

import torch

from nanorl.engine import Request
from nanorl.openai_api import BadRequest, ServeConfig, error_body
from nanorl.precision import autocast_ctx
from nanorl.toolcalls import MarkupStream


class EngineError(RuntimeError):
    """The engine ended this request with status "error" (other requests go on)."""


class Replica:
    """One engine with its serving thread, and how many samples the server has in flight on it."""

    def __init__(self, engine, name):
        self.engine, self.name, self.in_flight, self.served = engine, name, 0, 0
        self.thread = threading.Thread(target=engine.serve_forever, daemon=True, name=f"engine-{name}")
        self.thread.start()


class Histogram:
    """A Prometheus histogram: how many observations fell at or below each bound, their count and sum."""

    def __init__(self, bounds):
        self.bounds, self.counts, self.count, self.sum = bounds, [0] * len(bounds), 0, 0.0

    def observe(self, x):
        self.count, self.sum = self.count + 1, self.sum + x
        for i, b in enumerate(self.bounds):
            if x <= b:
                self.counts[i] += 1


class Stats:
    WINDOW = 10.0  # seconds of recent tokens behind the current tok/s

    def __init__(self):
        self.lock = threading.Lock()
        self.start = time.time()
        self.requests, self.tokens, self.errors, self.cancelled = 0, 0, 0, 0
        self.recent = collections.deque()  # (time, tokens) of the last WINDOW seconds
        self.prompt_tokens = 0
        self.answered = collections.Counter()  # (route, status) -> HTTP requests answered
        self.ttft = Histogram([0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30])  # seconds to the first token
        self.duration = Histogram([0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120])  # seconds per request

    def add_tokens(self, n):
        now = time.time()
        with self.lock:
            self.tokens += n
            self.recent.append((now, n))

    def tokens_per_s(self):
        now = time.time()
        with self.lock:
            while self.recent and self.recent[0][0] < now - self.WINDOW:
                self.recent.popleft()
            span = min(self.WINDOW, now - self.start)
            return sum(n for _, n in self.recent) / max(span, 1e-3)


@dataclass
class Trace:
    """One HTTP request, for its log line and the metrics; handlers fill in the tokens (request.state.trace)."""

    method: str
    path: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    start: float = field(default_factory=time.perf_counter)
    status: int = 500  # until a response starts
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft: float | None = None  # seconds from the request's arrival to its first generated token
    error: str | None = None  # an error after a stream began (its status stays 200)

    def line(self, took):
        tokens = f" in={self.prompt_tokens} out={self.completion_tokens}" if self.prompt_tokens else ""
        ttft = f" ttft={self.ttft:.3f}s" if self.ttft is not None else ""
        error = f" error: {self.error}" if self.error else ""
        return f"{self.id} {self.method} {self.path} {self.status}{tokens}{ttft} {took:.3f}s{error}"


@dataclass
class ServerState:
    """Everything a request handler reads: app.state.nanorl."""

    replicas: list
    tokenizer: object
    config: ServeConfig
    max_len: int  # the context every replica can hold
    page: str = ""  # the chat page's HTML, read once (no file I/O on the event loop)
    lock: threading.Lock = field(default_factory=threading.Lock)  # guards the replicas' in_flight counts
    stats: Stats = field(default_factory=Stats)


# --- a sample's tokens as text ----------------------------------------------------------------------------------------


class SampleText:
    """Turns one sample's tokens into text deltas: tool use as <<expr=result>> (parts=False) or as
    (kind, text) pieces with kind text|python|python_output (parts=True, for the page); stop strings.
    Keeps the tokens and log-probs it was given (up to the one that completed a stop string)."""

    def __init__(self, tokenizer, stops, parts):
        # parts: tool blocks as their own pieces; else inline, calls shown as <<source=result>>
        self.stream, self.stops, self.parts = MarkupStream(tokenizer, inline=not parts), stops, parts
        self.kind, self.text, self.sent = "text", "", 0
        self.hold = max((len(s) for s in stops), default=1) - 1  # a stop string may still be forming
        self.done, self.finish_reason = False, None
        self.tokens, self.logprobs, self.count = [], [], 0  # count: every token generated, a stop token too

    def push(self, token, logprob=0.0):
        self.count += 1
        self.tokens.append(token)
        self.logprobs.append(logprob)
        if self.parts and token in self.stream.markup.kinds:  # a block boundary: the held text ends its block
            out = self.stream.push(token)
            self.kind = self.stream.kind
            return [p for p in out if p[1]]
        return self._add(self.stream.text(token), final=False)

    def end(self, status):
        out = self._add(self.stream.text_flush(), final=True)
        self.done, self.finish_reason = True, "length" if status == "truncated" else "stop"
        if status == "completed":  # the engine's stop token (<|assistant_end|>) is no part of the reply
            self.tokens, self.logprobs = self.tokens[:-1], self.logprobs[:-1]
        return out

    def _add(self, text, final):
        if not self.stops:
            return [(self.kind, text)] if text else []
        self.text += text
        # search from where a stop could start that was not complete before
        found = (self.text.find(s, max(0, self.sent - len(s))) for s in self.stops)
        cut = min((i for i in found if i >= 0), default=-1)
        if cut >= 0:
            out, self.sent = self.text[self.sent : cut], cut
            self.done, self.finish_reason = True, "stop"
            return [(self.kind, out)] if out else []
        upto = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent : upto], upto
        return [(self.kind, out)] if out else []


@torch.no_grad()
def top_logprobs(engine, ids, tokens, k, temperature=1.0):
    """For each generated token, the k most likely tokens there and their log-probs: [[(id, logprob)] * k] per token,
    at the request's temperature like the engine's own log-probs (1 when greedy). The engine keeps only the sampled
    token's log-prob, so this is one forward of prompt + reply on the engine's model, run between its steps (under its
    step lock: on CUDA also never during a graph replay)."""
    seq = torch.tensor([list(ids) + list(tokens[:-1])], device=engine.device)
    ctx = autocast_ctx(engine.device.type)
    with engine.step_lock, ctx:
        h = engine.model.hidden_states(seq)[0, len(ids) - 1 :]  # position t predicts token t + 1
        logits = engine.model.logits_from_hidden(h)
    logp = torch.log_softmax(logits.float() / (temperature or 1.0), dim=-1)
    values, idx = logp.topk(min(k, logits.size(-1)), dim=-1)
    return [list(zip(i, v)) for i, v in zip(idx.tolist(), values.tolist())]


def logprob_entries(tokenizer, tokens, logprobs, tops=None):
    """OpenAI's logprobs.content for one sample: token, logprob (the engine's, at the sampling temperature), bytes,
    top_logprobs (tops: top_logprobs()'s alternatives per token, or None)."""

    def entry(t, lp):
        b = tokenizer.decode_token_bytes(t)
        return {"token": b.decode("utf-8", errors="replace"), "logprob": lp, "bytes": list(b)}

    tops = tops or [[]] * len(tokens)
    return [
        {**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in top]}
        for t, lp, top in zip(tokens, logprobs, tops)
    ]


async def logprob_content(engine, tokenizer, ids, tokens, logprobs, k, temperature):
    """logprob_entries() with k alternatives per token, their forward run in a worker thread."""
    tops = None
    if k and tokens:
        loop = asyncio.get_running_loop()
        tops = await loop.run_in_executor(None, top_logprobs, engine, ids, tokens, k, temperature)
    return logprob_entries(tokenizer, tokens, logprobs, tops)


# --- a request on the engines -----------------------------------------------------------------------------------------


def _pick_replica(state, num_samples):
    with state.lock:
        replica = min(state.replicas, key=lambda r: r.in_flight)  # ties: the first, so one GPU alone stays warm
        replica.in_flight += num_samples
        replica.served += 1
    return replica


def _drain(handle):
    """The events the engine has put on this handle's queue so far."""
    events = []
    while True:
        try:
            events.append(handle.events.get_nowait())
        except queue.Empty:
            return events


async def generate(state, ids, settings, stops, parts=False, logprobs=None, trace=None):
    """Submit to the least-loaded replica and yield ("delta", sample, kind, text), ("end", sample, finish_reason,
    logprobs.content or None) and last ("usage", completion tokens of all samples). logprobs: None, or how many
    alternatives each token gets (0: the sampled token's log-prob only). Polls the handle's queue from the event
    loop; leaving early (a disconnect, an error) cancels the request. EngineError: the engine failed this request.
    trace: gets the prompt and completion tokens and the time to the first token."""
    tok = state.tokenizer
    if trace is not None:
        trace.prompt_tokens = len(ids)
        state.stats.prompt_tokens += len(ids)
    req = Request(list(ids), **settings)
    replica = _pick_replica(state, req.num_samples)
    samples = [SampleText(tok, stops, parts) for _ in range(req.num_samples)]
    handle = None
    try:
        try:
            handle = replica.engine.submit(req, stream=True)
        except ValueError as e:  # what the engine refuses that the validation above let through
            raise BadRequest(str(e))
        while True:
            events, new_tokens = _drain(handle), 0
            for ev in events:
                s = samples[ev["sample"]]
                if s.done:  # ended by a stop string: its remaining tokens are dropped
                    continue
                if "token" in ev:
                    new_tokens += 1
                    out = s.push(ev["token"], ev["logprob"])
                elif ev["status"] == "error":
                    raise EngineError("the engine failed while generating this request")
                else:
                    out = s.end(ev["status"])
                for kind, text in out:
                    yield ("delta", ev["sample"], kind, text)
                if s.done:
                    content = None
                    if logprobs is not None:
                        content = await logprob_content(
                            replica.engine, tok, ids, s.tokens, s.logprobs, logprobs, settings["temperature"]
                        )
                    yield ("end", ev["sample"], s.finish_reason, content)
            if new_tokens:
                state.stats.add_tokens(new_tokens)
                if trace is not None and trace.ttft is None:
                    trace.ttft = time.perf_counter() - trace.start
                    state.stats.ttft.observe(trace.ttft)
            if all(s.done for s in samples):
                yield ("usage", sum(s.count for s in samples))
                break
            if not events:
                await asyncio.sleep(0.005)
    finally:
        if handle is not None and not handle.done:
            handle.cancel()  # a disconnect, an error or a stop string: free the slots now
            if not all(s.done for s in samples):
                state.stats.cancelled += 1  # the client went away (or it failed) mid-generation
                if trace is not None and trace.error is None:
                    trace.error = "cancelled before the end (the client went away)"
        if trace is not None:
            trace.completion_tokens = sum(s.count for s in samples)
        with state.lock:
            replica.in_flight -= req.num_samples


# --- the metrics in Prometheus' text format ---------------------------------------------------------------------------


def prometheus_text(state):
    """The serving counters in Prometheus' text format (version 0.0.4)."""
    st, out = state.stats, []

    def metric(name, kind, help, samples):
        out.extend([f"# HELP nanorl_{name} {help}", f"# TYPE nanorl_{name} {kind}"])
        out.extend(f"nanorl_{name}{labels} {value}" for labels, value in samples)

    def histogram(name, help, h):
        buckets = [(f'{{le="{b}"}}', c) for b, c in zip(h.bounds, h.counts)] + [('{le="+Inf"}', h.count)]
        metric(name, "histogram", help, [])
        out.extend(f"nanorl_{name}_bucket{labels} {c}" for labels, c in buckets)
        out.extend([f"nanorl_{name}_sum {h.sum}", f"nanorl_{name}_count {h.count}"])

    answered = sorted(st.answered.items())
    metric(
        "http_requests_total",
        "counter",
        "HTTP requests answered, by route and status.",
        [(f'{{route="{r}",status="{s}"}}', n) for (r, s), n in answered],
    )
    metric("prompt_tokens_total", "counter", "Prompt tokens of the generation requests.", [("", st.prompt_tokens)])
    metric("generation_tokens_total", "counter", "Tokens generated.", [("", st.tokens)])
    metric(
        "requests_cancelled_total",
        "counter",
        "Generations cut short by a disconnect or an error.",
        [("", st.cancelled)],
    )
    metric(
        "samples_running",
        "gauge",
        "Samples in flight on the engines.",
        [("", sum(r.in_flight for r in state.replicas))],
    )
    metric(
        "queue_length",
        "gauge",
        "Requests waiting for an engine slot.",
        [("", sum(len(r.engine.pending) for r in state.replicas))],
    )
    histogram("time_to_first_token_seconds", "Seconds from a request's arrival to its first generated token.", st.ttft)
    histogram("request_duration_seconds", "Seconds from a request's arrival to the end of its response.", st.duration)
    return "\n".join(out) + "\n"


# --- OpenAI responses from a request's events -------------------------------------------------------------------------


def sse(obj):
    return f"data: {json.dumps(obj)}\n\n"


def event_stream(events):
    from fastapi.responses import StreamingResponse  # fastapi only where a server runs

    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def failure(st, e, trace):
    """An error after the stream began: this request's error event (other requests go on)."""
    st.stats.errors += 1
    trace.error = f"{type(e).__name__}: {e}"
    if isinstance(e, BadRequest):
        return error_body(e.message, param=e.param, code=e.code)
    if isinstance(e, EngineError):
        return error_body(str(e), "server_error", code="engine_error")
    return error_body(f"internal error: {type(e).__name__}: {e}", "server_error", code="internal_error")


def usage(prompt, completion):
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def chat_logprobs(content):
    return None if content is None else {"content": content, "refusal": None}


def text_logprobs(content):
    """logprobs.content -> the legacy completions API's logprobs: tokens, token_logprobs, top_logprobs (token ->
    logprob), text_offset (where each token starts in the sample's text)."""
    if content is None:
        return None
    starts = [0]
    for e in content[:-1]:
        starts.append(starts[-1] + len(e["token"]))
    return {
        "tokens": [e["token"] for e in content],
        "token_logprobs": [e["logprob"] for e in content],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in content],
        "text_offset": starts,
    }


def openai_stream(st, trace, events, head, with_usage, delta, end, opening=()):
    """stream: true -> SSE chunks: `opening` choices, the choices delta(sample, text) gives per text piece (maybe
    none: text held back), those of end(sample, finish_reason, logprobs.content) as each sample ends, with include_usage
    a last chunk of usage and no choices, then [DONE]. events: the generate() stream of this request."""

    def chunk(choices, **extra):
        return sse({**head, "choices": choices, **({"usage": None} if with_usage else {}), **extra})

    async def chunks():
        for choice in opening:
            yield chunk([choice])
        try:
            async for ev in events:
                if ev[0] in ("delta", "end"):  # a sample's log-probs come with its finish_reason, all at once
                    for choice in delta(ev[1], ev[3]) if ev[0] == "delta" else end(ev[1], ev[2], ev[3]):
                        yield chunk([choice])
                elif with_usage:
                    yield chunk([], usage=usage(trace.prompt_tokens, ev[1]))
            st.stats.requests += 1
        except Exception as e:
            yield sse(failure(st, e, trace))
        yield "data: [DONE]\n\n"

    return event_stream(chunks())


async def collect(st, events, n):
    """stream: false -> each sample's text, finish_reason and logprobs.content, and the completion tokens."""
    texts, finish, contents, tokens = [""] * n, [None] * n, [None] * n, 0
    async for ev in events:
        if ev[0] == "delta":
            texts[ev[1]] += ev[3]
        elif ev[0] == "end":
            finish[ev[1]], contents[ev[1]] = ev[2], ev[3]
        else:
            tokens = ev[1]
    st.stats.requests += 1
    return texts, finish, contents, tokens
