"""
Serve a checkpoint over HTTP: a chat page at / and an OpenAI-compatible API, all on the sampling engine.

    python -m scripts.chat_web -i sft                      # http://127.0.0.1:8000
    python -m scripts.chat_web -i rl -n 8 --host 0.0.0.0   # one engine replica per GPU
    curl -N localhost:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "hi"}], "stream": true}'
    python -m scripts.chat_web --load-test http://127.0.0.1:8000 --clients 64 --max-tokens 128  # tok/s, TTFT

Every request goes into an engine's continuous batch (one engine replica per GPU, each stepped by its own
serve_forever thread); a request goes to the replica with the fewest samples in flight. The handlers never
block: JSON parsing, validation and tokenisation run in a worker thread, and the handle's event queue is
polled from the event loop, so 64 streaming clients need no 64 threads. A client that goes away mid-stream
cancels its handle, which frees its slots at the engine's next step.

Endpoints: GET / (the page), GET /ui/info and POST /ui/chat (the page's own stream), POST /v1/chat/completions,
GET /v1/models, GET /v1/models/{id}, GET /health, GET /stats. Every error is an OpenAI error object
{"error": {"message", "type", "param", "code"}}.
"""
import asyncio
import collections
import json
import os
import queue
import threading
import time
import uuid
from contextlib import nullcontext
from typing import List, Literal, Optional, Union

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from nanorl.common import ArgumentParser, number_in
from nanorl.engine import Engine, Request, TextStream

UI_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "nanorl", "ui.html")

MAX_MESSAGES = 500  # per conversation
MAX_MESSAGE_CHARS = 8000  # per message
MAX_N = 8  # samples per request
MAX_STOPS = 4  # stop strings per request, as OpenAI
MAX_TOP_LOGPROBS = 20  # as OpenAI

DEFAULT_LIMITS = dict(
    max_tokens=512,  # the most a request may ask for (and its default)
    model="nanorl",  # the name /v1/models reports; a request that names another model gets a 404
    base=False,  # a base model continues the last message's text instead of a chat
    body_timeout=30.0,  # seconds a client has to send a request's body, once its headers are in
    max_body_bytes=64 << 20,  # 500 messages of 8000 characters, even with every character \u-escaped, fit
)


class BadRequest(Exception):
    """A request the server refuses: answered with an OpenAI error object and this status."""

    def __init__(self, message, param=None, code=None, status=400):
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status


class EngineError(RuntimeError):
    """The engine ended this request with status "error" (other requests go on)."""


def error_body(message, kind="invalid_request_error", param=None, code=None):
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# --- request bodies -----------------------------------------------------------------------------
# pydantic checks every field's type and range; strict: "0.5" is not a number and true is not 1; extra="forbid":
# a field this server does not implement is a 400 naming it, never silently ignored.

class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Part(_Body):
    type: Literal["text", "python", "python_output"] = "text"  # python parts: the page's own assistant turns
    text: str


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, List[Part]]

    @model_validator(mode="after")
    def _check(self):
        if self.role == "tool":
            raise ValueError("role 'tool' is not supported: this server has no function calling "
                             "(the model's calculator runs inside the server)")
        parts = [Part(text=self.content)] if isinstance(self.content, str) else self.content
        if self.role != "assistant" and any(p.type != "text" for p in parts):
            raise ValueError(f"{self.role} content parts must have type 'text'")
        size = sum(len(p.text) for p in parts)
        if size > MAX_MESSAGE_CHARS:
            raise ValueError(f"message is too long: {size} characters > {MAX_MESSAGE_CHARS}")
        return self


class PageRequest(_Body):
    """POST /ui/chat, the page's stream. None means the default."""
    messages: List[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2, allow_inf_nan=False)  # 0 = greedy
    top_k: Optional[int] = Field(None, ge=1)
    top_p: Optional[float] = Field(None, gt=0, le=1, allow_inf_nan=False)
    seed: Optional[int] = Field(None, ge=-2**62, le=2**62)


class StreamOptions(_Body):
    include_usage: bool = False


class ChatRequest(PageRequest):
    """POST /v1/chat/completions: the OpenAI fields this server implements, plus top_k."""
    model: Optional[str] = None  # None: the served model
    max_completion_tokens: Optional[int] = Field(None, ge=1)  # OpenAI's current name for max_tokens
    n: Optional[int] = Field(None, ge=1, le=MAX_N)
    stop: Union[str, List[str], None] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    presence_penalty: Optional[float] = None  # only 0 (no penalty): clients that always send the default work
    frequency_penalty: Optional[float] = None
    user: Optional[str] = None  # an end-user id for OpenAI's abuse monitoring; it never changes what is generated

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > MAX_STOPS or not all(stops):
            raise ValueError(f"stop is a non-empty string or a list of up to {MAX_STOPS} of them")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v):
        if v:
            raise ValueError("penalties are not implemented: only 0 (no penalty) is accepted")
        return v


def _validation_error(e):
    """pydantic's first error -> a BadRequest naming the field."""
    err = e.errors()[0]
    # pydantic also names union members and validators in loc (content.str, content.list[Part]): keep the fields
    loc = [str(x) for x in err["loc"] if not (isinstance(x, str) and ("[" in x or x in ("str", "body")))]
    path, msg = ".".join(loc), err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        return BadRequest(f"unsupported parameter '{path}': this server does not implement it", loc[0], "unsupported_parameter")
    return BadRequest(f"'{path}': {msg}" if path else msg, loc[0] if loc else None, "invalid_value")


def _messages(req):
    """Validated messages -> the tokenizer's conversation messages ('developer' is OpenAI's newer 'system')."""
    out = []
    for m in req.messages:
        content = m.content
        if isinstance(content, list):  # assistant turns keep their tool parts; other roles' parts join into text
            content = [p.model_dump() for p in content] if m.role == "assistant" else "".join(p.text for p in content)
        out.append({"role": "system" if m.role == "developer" else m.role, "content": content})
    return out


def render_prompt(tokenizer, messages, max_len, base=False, room=None, token_bytes=None):
    """Messages -> (prompt ids, how many of the oldest messages were left out). room=None: nothing is left out;
    else the fewest oldest user/assistant pairs are (a leading system message stays) so that the prompt leaves
    room tokens to generate, or as many as there are with only the last message kept. token_bytes, the longest
    token's bytes, bounds the tokens from below without tokenising: a huge conversation is refused (or cut) at once."""
    def text_bytes(m):
        c = m["content"]
        return len((c if isinstance(c, str) else "".join(p["text"] for p in c)).encode())
    least = 0  # pairs that must go whatever the tokenizer says: at token_bytes bytes a token they would not fit
    if token_bytes and not base:
        sizes = [text_bytes(m) for m in messages]
        start, total = (1 if messages[0]["role"] == "system" else 0), sum(sizes)
        while total / token_bytes + (room or 1) > max_len:
            if room is None:
                raise BadRequest(f"the conversation is at least {-(-total // token_bytes)} tokens, over the context of "
                                 f"{max_len}", "messages", "context_length_exceeded")
            if start + 2 * least + 1 >= len(messages) - 1:  # only the last user message is left
                break
            total -= sizes[start + 2 * least] + sizes[start + 2 * least + 1]
            least += 1
    if base:  # a base model never saw chat tokens: it continues the last message's text
        last = messages[-1]["content"]
        ids = tokenizer.encode(last if isinstance(last, str) else "".join(p["text"] for p in last), prepend="<|bos|>")
        dropped = 0
    else:
        if messages[-1]["role"] != "user":  # the renderer would silently drop a final assistant message
            raise BadRequest(f"the last message must be from the user (the model writes the next assistant turn), "
                             f"got {messages[-1]['role']!r}", "messages")
        head = messages[:1] if messages[0]["role"] == "system" else []

        def render(drop):
            try:
                return tokenizer.render_for_completion({"messages": head + messages[len(head) + drop:]})
            except ValueError as e:  # roles out of order, a system message alone, ...
                raise BadRequest(str(e), "messages")
        ids, dropped = render(2 * least), 2 * least
        if room is not None and len(ids) + room > max_len:
            lo, hi = least + 1, (len(messages) - len(head) - 1) // 2  # pairs that can go; the last user message stays
            while lo < hi:  # the prompt only shrinks as more pairs go: binary search, a few renders however long
                mid = (lo + hi) // 2
                if len(render(2 * mid)) + room <= max_len:
                    hi = mid
                else:
                    lo = mid + 1
            if hi >= 1:
                ids, dropped = render(2 * hi), 2 * hi
    if len(ids) >= max_len:
        raise BadRequest(f"the conversation is {len(ids)} tokens, over the context of {max_len} "
                         f"(it needs room for at least one generated token)", "messages", "context_length_exceeded")
    return ids, dropped


def prepare(raw, schema, tokenizer, limits, max_len, fit=False):
    """Raw body bytes -> (validated request, prompt ids, engine settings, messages left out). Raises BadRequest.
    For a big conversation this is seconds of CPU (JSON, validation, tokenising): the handlers run it in a worker
    thread. fit=True (the page) leaves out the oldest turns that do not fit beside max_tokens."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise BadRequest("malformed JSON: nested too deeply", code="invalid_json")
    except ValueError as e:  # bad syntax, bad UTF-8, an integer of more than 4300 digits
        raise BadRequest(f"malformed JSON: {e}", code="invalid_json")
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    try:
        req = schema.model_validate(body)
    except ValidationError as e:
        raise _validation_error(e)
    api = isinstance(req, ChatRequest)
    max_tokens, param = req.max_tokens, "max_tokens"
    if api:
        if req.model is not None and req.model != limits["model"]:
            raise BadRequest(f"the model '{req.model}' does not exist: this server serves '{limits['model']}'",
                             "model", "model_not_found", 404)
        if req.max_completion_tokens is not None:
            if max_tokens is not None and max_tokens != req.max_completion_tokens:
                raise BadRequest(f"max_tokens ({max_tokens}) and max_completion_tokens ({req.max_completion_tokens}) "
                                 f"disagree: send one of them", "max_completion_tokens")
            max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
        if req.stream_options is not None and not req.stream:
            raise BadRequest("stream_options is only allowed with stream: true", "stream_options")
        if req.top_logprobs is not None and not req.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
    if max_tokens is not None and max_tokens > limits["max_tokens"]:
        raise BadRequest(f"'{param}' must be <= {limits['max_tokens']} (this server's --max-tokens), got {max_tokens}", param)
    max_tokens = limits["max_tokens"] if max_tokens is None else max_tokens
    ids, dropped = render_prompt(tokenizer, _messages(req), max_len, limits["base"], max_tokens if fit else None,
                                 limits.get("token_bytes"))
    settings = dict(
        max_tokens=min(max_tokens, max_len - len(ids)),  # ending at the context edge is finish_reason "length"
        temperature=req.temperature if req.temperature is not None else (1.0 if api else 0.6),
        top_k=req.top_k if req.top_k is not None or api else 50,
        top_p=req.top_p,
        num_samples=(req.n or 1) if api else 1,
        seed=req.seed,
    )
    return req, ids, settings, dropped


# --- generation ---------------------------------------------------------------------------------

class Replica:
    """One engine with its serving thread, and how many samples the server has in flight on it."""

    def __init__(self, engine, name):
        self.engine, self.name, self.in_flight, self.served = engine, name, 0, 0
        self.thread = threading.Thread(target=engine.serve_forever, daemon=True, name=f"engine-{name}")
        self.thread.start()


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.start = time.time()
        self.requests, self.tokens, self.errors, self.cancelled = 0, 0, 0, 0
        self.recent = collections.deque()  # (time, tokens) of the last WINDOW seconds, for a current tok/s

    WINDOW = 10.0

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


class _SampleText:
    """Turns one sample's tokens into text deltas: tool use as <<expr=result>> (parts=False) or as
    (kind, text) pieces with kind text|python|python_output (parts=True, for the page); stop strings.
    Keeps the tokens and log-probs it was given (up to the one that completed a stop string)."""

    def __init__(self, tokenizer, stops, parts):
        self.ts, self.stops, self.parts = TextStream(tokenizer), stops, parts
        sp = tokenizer.encode_special
        self.kinds = {sp("<|python_start|>"): "python", sp("<|python_end|>"): "text",
                      sp("<|output_start|>"): "python_output", sp("<|output_end|>"): "text"}
        self.kind, self.text, self.sent = "text", "", 0
        self.hold = max((len(s) for s in stops), default=1) - 1  # a stop string may still be forming
        self.done, self.finish_reason = False, None
        self.tokens, self.logprobs, self.count = [], [], 0  # count: every token generated, a stop token too

    def push(self, token, logprob=0.0):
        self.count += 1
        self.tokens.append(token)
        self.logprobs.append(logprob)
        if self.parts and token in self.kinds:
            out = [(self.kind, self.ts.flush())]
            self.kind = self.kinds[token]
            return [p for p in out if p[1]]
        return self._add(self.ts.push(token), final=False)

    def end(self, status):
        out = self._add(self.ts.flush(), final=True)
        self.done, self.finish_reason = True, "length" if status == "truncated" else "stop"
        if status == "completed":  # the engine's stop token (<|assistant_end|>) is no part of the reply
            self.tokens, self.logprobs = self.tokens[:-1], self.logprobs[:-1]
        return out

    def _add(self, text, final):
        if not self.stops:
            return [(self.kind, text)] if text else []
        self.text += text
        # search from where a stop could start that was not complete before
        cut = min((i for i in (self.text.find(s, max(0, self.sent - len(s))) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self.sent = self.text[self.sent:cut], cut
            self.done, self.finish_reason = True, "stop"
            return [(self.kind, out)] if out else []
        upto = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent:upto], upto
        return [(self.kind, out)] if out else []


@torch.no_grad()
def top_logprobs(engine, ids, tokens, k, temperature=1.0):
    """For each generated token, the k most likely tokens there and their log-probs: [[(id, logprob)] * k] per token,
    at the request's temperature like the engine's own log-probs (1 when greedy). The engine keeps only the sampled
    token's log-prob, so this is one forward of prompt + reply on the engine's model, run between its steps (under its
    step lock: on CUDA also never during a graph replay)."""
    seq = torch.tensor([list(ids) + list(tokens[:-1])], device=engine.device)
    ctx = torch.amp.autocast("cuda", dtype=torch.bfloat16) if engine.device.type == "cuda" else nullcontext()
    with engine.step_lock, ctx:
        h = engine.model.hidden_states(seq)[0, len(ids) - 1:]  # position t predicts token t + 1
        logits = engine.model.logits_from_hidden(h)
    values, idx = torch.log_softmax(logits.float() / (temperature or 1.0), dim=-1).topk(min(k, logits.size(-1)), dim=-1)
    return [list(zip(i, v)) for i, v in zip(idx.tolist(), values.tolist())]


async def logprob_content(engine, tokenizer, ids, tokens, logprobs, k, temperature):
    """OpenAI's logprobs.content for one sample: token, logprob (the engine's, at the sampling temperature), bytes,
    top_logprobs."""
    def entry(t, lp):
        b = tokenizer.decode_token_bytes(t)
        return {"token": b.decode("utf-8", errors="replace"), "logprob": lp, "bytes": list(b)}
    tops = [[]] * len(tokens)
    if k and tokens:
        tops = await asyncio.get_running_loop().run_in_executor(None, top_logprobs, engine, ids, tokens, k, temperature)
    return [{**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in top]} for t, lp, top in zip(tokens, logprobs, tops)]


async def generate(state, ids, settings, stops, parts=False, logprobs=None):
    """Submit to the least-loaded replica and yield ("delta", sample, kind, text), ("end", sample, finish_reason,
    logprobs.content or None) and last ("usage", completion tokens of all samples). logprobs: None, or how many
    alternatives each token gets (0: the sampled token's log-prob only). Polls the handle's queue from the event
    loop; leaving early (a disconnect, an error) cancels the request. EngineError: the engine failed this request."""
    base = state["limits"]["base"]
    tok = state["tokenizer"]
    stop_tokens = [tok.get_bos_token_id()] if base else None
    req = Request(list(ids), stop_tokens=stop_tokens, **settings)
    with state["lock"]:
        replica = min(state["replicas"], key=lambda r: r.in_flight)  # ties: the first, so one GPU alone stays warm
        replica.in_flight += req.num_samples
        replica.served += 1
    samples = [_SampleText(tok, stops, parts) for _ in range(req.num_samples)]
    handle = None
    try:
        try:
            handle = replica.engine.submit(req, stream=True)
        except ValueError as e:  # what the engine refuses that the validation above let through
            raise BadRequest(str(e))
        while True:
            got, new_tokens = 0, 0
            while True:
                try:
                    ev = handle.events.get_nowait()
                except queue.Empty:
                    break
                got += 1
                s = samples[ev["sample"]]
                if s.done:  # ended by a stop string: its remaining tokens are dropped
                    continue
                if "token" in ev:
                    new_tokens += 1
                    out = s.push(ev["token"], ev["logprob"])
                else:
                    if ev["status"] == "error":
                        raise EngineError("the engine failed while generating this request")
                    out = s.end(ev["status"])
                for kind, text in out:
                    yield ("delta", ev["sample"], kind, text)
                if s.done:
                    content = None
                    if logprobs is not None:
                        content = await logprob_content(replica.engine, tok, ids, s.tokens, s.logprobs, logprobs, settings["temperature"])
                    yield ("end", ev["sample"], s.finish_reason, content)
            if new_tokens:
                state["stats"].add_tokens(new_tokens)
            if all(s.done for s in samples):
                yield ("usage", sum(s.count for s in samples))
                break
            if not got:
                await asyncio.sleep(0.005)
    finally:
        if handle is not None and not handle.done:
            handle.cancel()  # a disconnect, an error or a stop string: free the slots now
            if not all(s.done for s in samples):
                state["stats"].cancelled += 1  # the client went away (or it failed) mid-generation
        with state["lock"]:
            replica.in_flight -= req.num_samples



# --- slow clients -------------------------------------------------------------------------------

class BodyDeadline:
    """ASGI middleware: read each request's whole body within `timeout` seconds and at most max_bytes, else answer
    408 / 413 and close, so a client that trickles its body cannot hold a connection and a task forever. The app
    then reads the buffered body (and later receive() calls, e.g. a disconnect, come from the connection)."""

    def __init__(self, app, timeout, max_bytes):
        self.app, self.timeout, self.max_bytes = app, timeout, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        from fastapi.responses import JSONResponse
        loop = asyncio.get_running_loop()
        deadline, chunks, size = loop.time() + self.timeout, [], 0
        while True:
            try:
                msg = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                reply = JSONResponse(error_body(f"the request body did not arrive within {self.timeout:g}s",
                                                code="request_timeout"), 408, headers={"connection": "close"})
                return await reply(scope, receive, send)
            if msg["type"] == "http.disconnect":
                return
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                reply = JSONResponse(error_body(f"the request body is over {self.max_bytes} bytes",
                                                code="request_too_large"), 413, headers={"connection": "close"})
                return await reply(scope, receive, send)
            if not msg.get("more_body", False):
                break
        body = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay():
            return body.pop() if body else await receive()
        await self.app(scope, replay, send)


def header_deadline_protocol(timeout):
    """uvicorn's h11 protocol with a deadline on each request's headers: a client that opens a connection (or starts
    another request on a kept-alive one) and has not sent all of its headers within `timeout` seconds gets a 408 and
    is disconnected (uvicorn alone waits forever: a few slow clients could hold every connection)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol
    body = json.dumps(error_body(f"the request headers did not arrive within {timeout:g}s", code="request_timeout")).encode()
    reply = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
             b"content-length: %d\r\n\r\n" % len(body)) + body

    class HeaderDeadline(H11Protocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            self.deadline = self.loop.call_later(timeout, self.too_slow)

        def data_received(self, data):
            super().data_received(data)
            waiting = self.cycle is None or self.cycle.response_complete  # this request's headers are not all here
            if not waiting and self.deadline is not None:
                self.deadline.cancel()
                self.deadline = None
            elif waiting and self.deadline is None and not self.transport.is_closing():
                self.deadline = self.loop.call_later(timeout, self.too_slow)

        def connection_lost(self, exc):
            if self.deadline is not None:
                self.deadline.cancel()
            super().connection_lost(exc)

        def too_slow(self):
            self.deadline = None
            if not self.transport.is_closing():
                self.transport.write(reply)
                self.transport.close()
    return HeaderDeadline


def server_config(app, host, port, header_timeout=10.0):
    """The uvicorn config chat_web serves with (idle kept-alive connections close after 5 s, uvicorn's default)."""
    import uvicorn
    return uvicorn.Config(app, host=host, port=port, http=header_deadline_protocol(header_timeout), log_level="warning")


# --- the app ------------------------------------------------------------------------------------

def create_app(engines, tokenizer, limits=None):
    """A FastAPI app serving these engines (one per device; each gets a serve_forever thread here)."""
    from fastapi import FastAPI, Request as HTTPRequest
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException

    limits = {**DEFAULT_LIMITS, **(limits or {})}
    # the longest token in bytes: a conversation's bytes / this bounds its tokens from below, without tokenising it
    limits["token_bytes"] = max(len(tokenizer.decode_token_bytes(i)) for i in range(tokenizer.vocab_size))
    replicas = [Replica(e, f"{e.device}") for e in engines]
    state = dict(replicas=replicas, tokenizer=tokenizer, limits=limits, lock=threading.Lock(), stats=Stats())
    max_len = min(e.max_len for e in engines)
    app = FastAPI(title="nanorl", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyDeadline, timeout=limits["body_timeout"], max_bytes=limits["max_body_bytes"])
    app.state.nanorl = state

    def shutdown():
        for r in replicas:
            r.engine.shutdown()
    app.state.shutdown = shutdown

    def error(status, message, param=None, code=None, kind=None, headers=None):
        kind = kind or ("invalid_request_error" if status < 500 else "server_error")
        return JSONResponse(error_body(message, kind, param, code), status_code=status, headers=headers)

    # every error is OpenAI's error object, FastAPI's own 404/405/422 included
    @app.exception_handler(BadRequest)
    async def bad_request(request, e):
        return error(e.status, e.message, e.param, e.code)

    @app.exception_handler(HTTPException)
    async def http_error(request, e):
        hint = ""
        if e.status_code == 404 and request.url.path.rstrip("/").endswith(("/chat/completions", "/models")):
            hint = ": the OpenAI API is under /v1 (a client's base_url ends in /v1)"
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return error(e.status_code, f"{e.detail}: {request.method} {request.url.path}{hint}", code=code, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, e):
        b = _validation_error(e)
        return error(400, b.message, b.param, b.code)

    @app.exception_handler(Exception)
    async def crashed(request, e):
        return error(500, f"internal error: {type(e).__name__}: {e}")

    async def parse(request, schema, fit=False):
        return await run_in_threadpool(prepare, await request.body(), schema, tokenizer, limits, max_len, fit)

    def sse(obj):
        return f"data: {json.dumps(obj)}\n\n"

    def stream(events):
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    def failure(e):
        """An error after the stream began: this request's error event (other requests go on)."""
        state["stats"].errors += 1
        if isinstance(e, BadRequest):
            return error_body(e.message, param=e.param, code=e.code)
        return error_body(str(e) if isinstance(e, EngineError) else f"internal error: {type(e).__name__}: {e}", "server_error")

    with open(UI_PATH, encoding="utf-8") as f:  # read once: no file I/O on the event loop
        page = f.read()

    @app.get("/")
    async def index():
        return HTMLResponse(page)

    @app.get("/health")
    async def health():
        alive = all(r.thread.is_alive() for r in replicas)
        return JSONResponse({"status": "ok" if alive else "degraded", "replicas": len(replicas)}, status_code=200 if alive else 503)

    @app.get("/stats")
    async def stats():
        st = state["stats"]
        per = [{"replica": i, "device": r.name, "in_flight_samples": r.in_flight, "requests": r.served,
                "busy_slots": sum(s is not None for s in r.engine.slots), "batch_size": r.engine.batch_size,
                "queued": len(r.engine.pending)} for i, r in enumerate(replicas)]
        return {"requests_served": st.requests, "errors": st.errors, "cancelled": st.cancelled, "tokens_generated": st.tokens,
                "tokens_per_s": round(st.tokens_per_s(), 2), "queue_length": sum(p["queued"] for p in per),
                "uptime_s": round(time.time() - st.start, 1), "replicas": per}

    model_card = {"id": limits["model"], "object": "model", "created": int(state["stats"].start), "owned_by": "nanorl",
                  "context_length": max_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != limits["model"]:
            raise BadRequest(f"the model '{model_id}' does not exist: this server serves '{limits['model']}'",
                             "model", "model_not_found", 404)
        return model_card

    @app.get("/ui/info")
    async def ui_info():
        return {"model": limits["model"], "context_length": max_len, "max_tokens": limits["max_tokens"]}

    @app.post("/ui/chat")
    async def ui_chat(request: HTTPRequest):
        """The page's stream: data: {"prompt_tokens", "dropped", "context"} first (dropped: how many of the oldest
        messages did not fit), then {"token": text, "type": text|python|python_output} and {"finish_reason"}, then [DONE]."""
        _, ids, settings, dropped = await parse(request, PageRequest, fit=True)

        async def events():
            yield sse({"prompt_tokens": len(ids), "dropped": dropped, "context": max_len})
            try:
                async for ev in generate(state, ids, settings, [], parts=True):
                    if ev[0] == "delta":
                        yield sse({"token": ev[3], "type": ev[2]})
                    elif ev[0] == "end":
                        yield sse({"finish_reason": ev[2]})
                state["stats"].requests += 1
            except Exception as e:
                yield sse({"error": failure(e)["error"]["message"]})
            yield "data: [DONE]\n\n"
        return stream(events())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        req, ids, settings, _ = await parse(request, ChatRequest)
        stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        cid, created, n = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time()), settings["num_samples"]
        head = {"id": cid, "created": created, "model": limits["model"]}

        def usage(tokens):
            return {"prompt_tokens": len(ids), "completion_tokens": tokens, "total_tokens": len(ids) + tokens}

        if req.stream:
            with_usage = req.stream_options is not None and req.stream_options.include_usage

            def chunk(choices, **extra):
                return sse({**head, "object": "chat.completion.chunk", "choices": choices,
                            **({"usage": None} if with_usage else {}), **extra})

            async def events():
                for i in range(n):
                    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
                try:
                    async for ev in generate(state, ids, settings, stops, logprobs=logprobs):
                        if ev[0] == "delta":
                            yield chunk([{"index": ev[1], "delta": {"content": ev[3]}, "logprobs": None, "finish_reason": None}])
                        elif ev[0] == "end":  # a sample's log-probs come with its finish_reason, all at once
                            lp = None if ev[3] is None else {"content": ev[3], "refusal": None}
                            yield chunk([{"index": ev[1], "delta": {}, "logprobs": lp, "finish_reason": ev[2]}])
                        elif with_usage:
                            yield chunk([], usage=usage(ev[1]))
                    state["stats"].requests += 1
                except Exception as e:
                    yield sse(failure(e))
                yield "data: [DONE]\n\n"
            return stream(events())

        texts, finish, lps, tokens = [""] * n, [None] * n, [None] * n, 0
        try:
            async for ev in generate(state, ids, settings, stops, logprobs=logprobs):
                if ev[0] == "delta":
                    texts[ev[1]] += ev[3]
                elif ev[0] == "end":
                    finish[ev[1]] = ev[2]
                    lps[ev[1]] = None if ev[3] is None else {"content": ev[3], "refusal": None}
                else:
                    tokens = ev[1]
        except EngineError as e:
            state["stats"].errors += 1
            return error(500, str(e))
        state["stats"].requests += 1
        return {**head, "object": "chat.completion",
                "choices": [{"index": i, "message": {"role": "assistant", "content": texts[i]}, "logprobs": lps[i],
                             "finish_reason": finish[i]} for i in range(n)],
                "usage": usage(tokens)}

    return app


def load_test(url, clients, max_tokens, prompt="Tell me a story about a robot."):
    """Hit a running server with `clients` concurrent streaming requests (one each) and report aggregate tokens/s
    (from /stats: the tokens the engine generated, not text chunks) and time to first token p50/p95."""
    import httpx
    ttft, errors = [], []
    before = httpx.get(url + "/stats").json()["tokens_generated"]
    barrier = threading.Barrier(clients)
    # one shared client, made up front: a new httpx client per request builds an SSL context (~tens of ms of
    # CPU each), which would be counted as time to first token
    http = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=clients, max_keepalive_connections=clients))

    def client(i):
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stream": True, "seed": i}
        barrier.wait()  # all start together, as a burst of users would
        t0 = time.perf_counter()
        try:
            with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
                first = None
                for line in r.iter_lines():
                    if first is None and line.startswith("data: {") and '"content": "' in line and '"content": ""' not in line:
                        first = time.perf_counter() - t0
                ttft.append(first if first is not None else time.perf_counter() - t0)
        except Exception as e:
            errors.append(repr(e))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    http.close()
    tokens = httpx.get(url + "/stats").json()["tokens_generated"] - before
    ttft.sort()
    pct = lambda q: ttft[min(len(ttft) - 1, int(q * len(ttft)))] if ttft else float("nan")
    print(f"{clients} clients x max_tokens={max_tokens}: {tokens} tokens in {wall:.2f}s = {tokens / wall:.1f} tok/s aggregate, "
          f"TTFT p50 {pct(0.5) * 1000:.0f} ms, p95 {pct(0.95) * 1000:.0f} ms, {len(errors)} errors")
    return dict(tokens=tokens, wall=wall, ttft_p50=pct(0.5), ttft_p95=pct(0.95), errors=errors)


def main():
    parser = ArgumentParser(description="Serve a nanorl model: chat page + OpenAI-compatible API")
    parser.add_argument("-i", "--source", type=str, default="sft", choices=["base", "mid", "sft", "rl"], help="which model")
    parser.add_argument("-g", "--model-tag", type=str, default=None, help="model tag; None picks the newest")
    parser.add_argument("-s", "--model-step", "--step", type=number_in(int, 0), default=None, help="checkpoint step; None picks the last")
    parser.add_argument("--hf-model", type=str, default=None, metavar="DIR", help="serve a Hugging Face model directory instead of --source")
    parser.add_argument("--host", type=str, default="127.0.0.1", help="address to listen on; 0.0.0.0 serves other machines")
    parser.add_argument("-p", "--port", type=number_in(int, 0, 65535), default=8000, help="port to listen on (0: any free one)")
    parser.add_argument("-n", "--num-gpus", type=number_in(int, 1), default=1, help="one engine replica per GPU (CPU: always one)")
    parser.add_argument("-b", "--batch-size", type=number_in(int, 1), default=32, help="engine slots per replica (concurrent samples)")
    parser.add_argument("-m", "--max-tokens", type=number_in(int, 1), default=512,
                        help="the most tokens a request may generate (and what a request that names none gets); --load-test: tokens per client")
    parser.add_argument("--device-type", type=str, default=None, choices=["cuda", "cpu", "mps"], help="None detects the device")
    parser.add_argument("--header-timeout", type=number_in(float, 0.01), default=10.0,
                        help="seconds a client has to send a request's headers before it is disconnected")
    parser.add_argument("--body-timeout", type=number_in(float, 0.01), default=30.0,
                        help="seconds a client has to send a request's body (then 408)")
    parser.add_argument("--load-test", type=str, default=None, metavar="URL", help="don't serve: load-test the server at URL")
    parser.add_argument("--clients", type=number_in(int, 1), default=64, help="--load-test: concurrent streaming clients")
    args = parser.parse_args()
    if args.load_test:
        load_test(args.load_test.rstrip("/"), args.clients, args.max_tokens)
        return

    import sys
    import uvicorn
    from nanorl.checkpoint import load_model
    from nanorl.common import autodetect_device_type

    device_type = args.device_type or autodetect_device_type()
    if device_type == "cuda":
        if args.num_gpus > torch.cuda.device_count():
            sys.exit(f"--num-gpus {args.num_gpus} but only {torch.cuda.device_count()} GPUs are visible")
        devices = [torch.device("cuda", i) for i in range(args.num_gpus)]
    else:
        devices = [torch.device(device_type)]  # one replica: extra CPU replicas would only share the same cores
    engines, tokenizer, meta = [], None, {}
    for dev in devices:
        try:
            model, tokenizer, meta = load_model(args.source, dev, phase="eval", model_tag=args.model_tag, step=args.model_step, hf_model=args.hf_model)
        except (FileNotFoundError, ValueError) as e:
            sys.exit(f"could not load the {args.source} model: {e}")
        engines.append(Engine(model, tokenizer, batch_size=args.batch_size))
    name = f"nanorl-{args.source}-{meta.get('model_tag', 'model')}"
    limits = dict(max_tokens=args.max_tokens, model=name, base=args.source == "base", body_timeout=args.body_timeout)
    app = create_app(engines, tokenizer, limits)
    print(f"serving {name} on {len(engines)} replica(s) ({', '.join(map(str, devices))}) at http://{args.host}:{args.port} "
          f"(OpenAI API: http://{args.host}:{args.port}/v1)")
    uvicorn.Server(server_config(app, args.host, args.port, args.header_timeout)).run()


if __name__ == "__main__":
    main()
