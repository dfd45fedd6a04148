"""
Serve a checkpoint over HTTP: a chat page at / and an OpenAI-compatible API, all on the sampling engine.

    python -m scripts.chat_web -i sft                      # http://127.0.0.1:8000
    python -m scripts.chat_web -i rl --num-gpus 8 --host 0.0.0.0
    curl -N localhost:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "hi"}], "stream": true}'
    python -m scripts.chat_web --load-test http://127.0.0.1:8000 --clients 64 --max-tokens 128  # tok/s, TTFT

Every request goes into an engine's continuous batch (one engine replica per GPU, each stepped by its own
serve_forever thread); a request goes to the replica with the fewest samples in flight. The handlers never
block: they poll the handle's event queue from the event loop, so 64 streaming clients need no 64 threads.
A client that goes away mid-stream cancels its handle, which frees its slots at the engine's next step.

Endpoints: GET / (the page), POST /chat/completions (the page's SSE stream), POST /v1/chat/completions,
GET /v1/models, GET /health, GET /stats.
"""
import argparse
import asyncio
import collections
import json
import os
import queue
import threading
import time
import uuid

from nanorl.engine import Engine, Request, TextStream

UI_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "nanorl", "ui.html")

DEFAULT_LIMITS = dict(
    max_messages=500,  # per conversation
    max_message_chars=8000,  # per message
    max_tokens=512,  # the most a request may ask for (and the default for the page)
    max_n=8,  # samples per request
    model="nanorl",  # the name /v1/models reports
    base=False,  # a base model continues the last message's text instead of a chat
)


class BadRequest(Exception):
    def __init__(self, message, param=None):
        super().__init__(message)
        self.message, self.param = message, param


# --- replicas and stats -------------------------------------------------------------------------

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


# --- request parsing ----------------------------------------------------------------------------

def _number(body, key, default, lo, hi, integer=False, lo_open=False):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise BadRequest(f"'{key}' must be {'an integer' if integer else 'a number'}, got {v!r}", key)
    if (v <= lo if lo_open else v < lo) or (hi is not None and v > hi):
        raise BadRequest(f"'{key}' must be in {'(' if lo_open else '['}{lo}, {hi if hi is not None else 'inf'}], got {v}", key)
    return v


def parse_request(body, tokenizer, limits, max_len, openai=True):
    """JSON body -> (prompt ids, Request settings, stop strings, stream). Raises BadRequest with a clear message."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of {role, content} objects", "messages")
    if len(messages) > limits["max_messages"]:
        raise BadRequest(f"too many messages: {len(messages)} > {limits['max_messages']}", "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRequest(f"message {i} must be an object with 'role' and 'content'", "messages")
        role, content = m.get("role"), m.get("content")
        if role not in ("system", "user", "assistant"):
            raise BadRequest(f"message {i}: role must be 'system', 'user' or 'assistant', got {role!r}", "messages")
        if isinstance(content, list):  # OpenAI's content parts, or our own assistant parts
            if not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in content):
                raise BadRequest(f"message {i}: content parts must be objects with a 'text' string", "messages")
            if role == "assistant" and all(p.get("type") in ("text", "python", "python_output") for p in content):
                size = sum(len(p["text"]) for p in content)
            else:
                content = "".join(p["text"] for p in content)
                size = len(content)
        elif isinstance(content, str):
            size = len(content)
        else:
            raise BadRequest(f"message {i}: content must be a string", "messages")
        if size > limits["max_message_chars"]:
            raise BadRequest(f"message {i} is too long: {size} characters > {limits['max_message_chars']}", "messages")
        clean.append({"role": role, "content": content})

    if limits["base"]:  # a base model never saw chat tokens: it continues the last message's text
        last = clean[-1]["content"]
        ids = tokenizer.encode(last if isinstance(last, str) else "".join(p["text"] for p in last), prepend="<|bos|>")
    else:
        if clean[-1]["role"] != "user":  # the renderer would silently drop a final assistant message
            raise BadRequest(f"the last message must be from the user (the model writes the next assistant turn), "
                             f"got {clean[-1]['role']!r}", "messages")
        try:
            ids = tokenizer.render_for_completion({"messages": clean})
        except ValueError as e:  # roles out of order, a system message alone, ...
            raise BadRequest(str(e), "messages")
    if len(ids) >= max_len:
        raise BadRequest(f"the conversation is {len(ids)} tokens, over the context of {max_len} "
                         f"(it needs room for at least one generated token)", "messages")

    max_tokens = _number(body, "max_tokens", limits["max_tokens"], 1, limits["max_tokens"], integer=True)
    settings = dict(
        max_tokens=min(max_tokens, max_len - len(ids)),  # ending at the context edge is finish_reason "length"
        temperature=float(_number(body, "temperature", 1.0 if openai else 0.6, 0, 2)),
        top_k=_number(body, "top_k", None if openai else 50, 1, None, integer=True),
        top_p=_number(body, "top_p", None, 0, 1, lo_open=True),
        num_samples=_number(body, "n", 1, 1, limits["max_n"], integer=True),
        seed=_number(body, "seed", None, -2**62, 2**62, integer=True),
    )
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop
    if stop is None:
        stop = []
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("'stop' must be a non-empty string or a list of up to 4 of them", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false", "stream")
    return ids, settings, stop, stream


# --- generation ---------------------------------------------------------------------------------

class _SampleText:
    """Turns one sample's tokens into text deltas: tool use as <<expr=result>> (parts=False) or as
    (kind, text) pieces with kind text|python|python_output (parts=True, for the page); stop strings."""

    def __init__(self, tokenizer, stops, parts):
        self.ts, self.stops, self.parts = TextStream(tokenizer), stops, parts
        sp = tokenizer.encode_special
        self.kinds = {sp("<|python_start|>"): "python", sp("<|python_end|>"): "text",
                      sp("<|output_start|>"): "python_output", sp("<|output_end|>"): "text"}
        self.kind, self.text, self.sent = "text", "", 0
        self.hold = max((len(s) for s in stops), default=1) - 1  # a stop string may still be forming
        self.done, self.finish_reason, self.tokens = False, None, 0

    def push(self, token):
        if self.parts and token in self.kinds:
            out = [(self.kind, self.ts.flush())]
            self.kind = self.kinds[token]
            return [p for p in out if p[1]]
        return self._add(self.ts.push(token), final=False)

    def end(self, status):
        out = self._add(self.ts.flush(), final=True)
        self.done, self.finish_reason = True, "length" if status == "truncated" else "stop"
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


async def generate(state, ids, settings, stops, parts=False):
    """Submit to the least-loaded replica and yield ("delta", sample, kind, text), ("end", sample, finish_reason)
    and last ("usage", completion tokens of all samples).
    Polls the handle's queue from the event loop; leaving early (a disconnect, an error) cancels the request."""
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
        handle = replica.engine.submit(req, stream=True)
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
                    s.tokens += 1
                    new_tokens += 1
                    out = s.push(ev["token"])
                else:
                    if ev["status"] == "error":
                        raise RuntimeError("the engine failed while generating this request")
                    out = s.end(ev["status"])
                for kind, text in out:
                    yield ("delta", ev["sample"], kind, text)
                if s.done:
                    yield ("end", ev["sample"], s.finish_reason)
            if new_tokens:
                state["stats"].add_tokens(new_tokens)
            if all(s.done for s in samples):
                yield ("usage", sum(s.tokens for s in samples))
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


# --- the app ------------------------------------------------------------------------------------

def create_app(engines, tokenizer, limits=None):
    """A FastAPI app serving these engines (one per device; each gets a serve_forever thread here)."""
    from fastapi import FastAPI, Request as HTTPRequest
    from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse

    limits = {**DEFAULT_LIMITS, **(limits or {})}
    replicas = [Replica(e, f"{e.device}") for e in engines]
    state = dict(replicas=replicas, tokenizer=tokenizer, limits=limits, lock=threading.Lock(), stats=Stats())
    max_len = min(e.max_len for e in engines)
    app = FastAPI(title="nanorl")
    app.state.nanorl = state

    def shutdown():
        for r in replicas:
            r.engine.shutdown()
    app.state.shutdown = shutdown

    def error(status, message, param=None, kind="invalid_request_error"):
        return JSONResponse({"error": {"message": message, "type": kind, "param": param}}, status_code=status)

    async def read(request, openai):
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"malformed JSON: {e}")
        return parse_request(body, tokenizer, limits, max_len, openai)

    def sse(obj):
        return f"data: {json.dumps(obj)}\n\n"

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

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": limits["model"], "object": "model", "created": int(state["stats"].start),
                                            "owned_by": "nanorl", "context_length": max_len}]}

    @app.post("/chat/completions")
    async def chat_page(request: HTTPRequest):
        """The page's stream: data: {"token": text, "type": text|python|python_output} lines, then data: [DONE]."""
        try:
            ids, settings, _, _ = await read(request, openai=False)
        except BadRequest as e:
            return error(400, e.message, e.param)
        settings["num_samples"] = 1

        async def events():
            try:
                async for ev in generate(state, ids, settings, [], parts=True):
                    if ev[0] == "delta":
                        yield sse({"token": ev[3], "type": ev[2]})
                    elif ev[0] == "end":
                        yield sse({"finish_reason": ev[2]})
                state["stats"].requests += 1
            except RuntimeError as e:
                state["stats"].errors += 1
                yield sse({"error": str(e)})
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        try:
            ids, settings, stops, stream = await read(request, openai=True)
        except BadRequest as e:
            return error(400, e.message, e.param)
        cid, created, n = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time()), settings["num_samples"]
        head = {"id": cid, "created": created, "model": limits["model"]}

        if stream:
            async def events():
                def chunk(i, delta, finish=None):
                    return sse({**head, "object": "chat.completion.chunk",
                                "choices": [{"index": i, "delta": delta, "finish_reason": finish}]})
                for i in range(n):
                    yield chunk(i, {"role": "assistant", "content": ""})
                try:
                    async for ev in generate(state, ids, settings, stops):
                        if ev[0] == "delta":
                            yield chunk(ev[1], {"content": ev[3]})
                        elif ev[0] == "end":
                            yield chunk(ev[1], {}, ev[2])
                    state["stats"].requests += 1
                except RuntimeError as e:
                    state["stats"].errors += 1
                    yield sse({"error": {"message": str(e), "type": "server_error", "param": None}})
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

        texts, finish, tokens = [""] * n, [None] * n, 0
        try:
            async for ev in generate(state, ids, settings, stops):
                if ev[0] == "delta":
                    texts[ev[1]] += ev[3]
                elif ev[0] == "end":
                    finish[ev[1]] = ev[2]
                else:
                    tokens = ev[1]
        except RuntimeError as e:
            state["stats"].errors += 1
            return error(500, str(e), kind="server_error")
        state["stats"].requests += 1
        return {**head, "object": "chat.completion",
                "choices": [{"index": i, "message": {"role": "assistant", "content": texts[i]}, "finish_reason": finish[i]}
                            for i in range(n)],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": tokens, "total_tokens": len(ids) + tokens}}

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
    parser = argparse.ArgumentParser(description="Serve a nanorl model: chat page + OpenAI-compatible API")
    parser.add_argument("-i", "--source", type=str, default="sft", choices=["base", "mid", "sft", "rl"], help="which model")
    parser.add_argument("-g", "--model-tag", type=str, default=None, help="model tag (default: the newest)")
    parser.add_argument("-s", "--step", type=int, default=None, help="checkpoint step (default: the last)")
    parser.add_argument("--host", type=str, default="127.0.0.1", help="0.0.0.0 to serve other machines")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--num-gpus", type=int, default=1, help="one engine replica per GPU (CPU: always one)")
    parser.add_argument("--batch-size", type=int, default=32, help="engine slots per replica (concurrent samples)")
    parser.add_argument("--max-tokens", type=int, default=512, help="the most tokens a request may generate")
    parser.add_argument("--device-type", type=str, default=None, help="cuda|cpu|mps (default: autodetect)")
    parser.add_argument("--load-test", type=str, default=None, metavar="URL", help="don't serve: load-test the server at URL")
    parser.add_argument("--clients", type=int, default=64, help="--load-test: concurrent streaming clients")
    args = parser.parse_args()
    if args.load_test:
        load_test(args.load_test.rstrip("/"), args.clients, args.max_tokens)
        return

    import sys
    import torch
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
            model, tokenizer, meta = load_model(args.source, dev, phase="eval", model_tag=args.model_tag, step=args.step)
        except (FileNotFoundError, ValueError) as e:
            sys.exit(f"could not load the {args.source} model: {e}")
        engines.append(Engine(model, tokenizer, batch_size=args.batch_size))
    name = f"nanorl-{args.source}-{meta.get('model_tag', 'model')}"
    app = create_app(engines, tokenizer, dict(max_tokens=args.max_tokens, model=name, base=args.source == "base"))
    print(f"serving {name} on {len(engines)} replica(s) ({', '.join(map(str, devices))}) at http://{args.host}:{args.port}")
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
