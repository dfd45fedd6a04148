"""
Serve a checkpoint over HTTP: a chat page at / and an OpenAI-compatible API, all on the sampling engine.

    python -m scripts.chat_web -i sft                      # http://127.0.0.1:8000
    python -m scripts.chat_web -i rl -n 8 --host 0.0.0.0   # one engine replica per GPU
    curl -N localhost:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "hi"}], "stream": true}'
    python -m scripts.bench serve http://127.0.0.1:8000 --clients 64 --max-tokens 128  # load test: tok/s, TTFT

Every request goes into an engine's continuous batch (one engine replica per GPU, each stepped by its own
serve_forever thread); a request goes to the replica with the fewest samples in flight. The handlers never
block: JSON parsing, validation and tokenisation run in a worker thread, and the handle's event queue is
polled from the event loop, so 64 streaming clients need no 64 threads. A client that goes away mid-stream
cancels its handle, which frees its slots at the engine's next step.

Endpoints: GET / (the page), GET /ui/info and POST /ui/chat (the page's own stream), POST /v1/chat/completions,
GET /v1/models, GET /v1/models/{id}, GET /health, GET /stats. Every error is an OpenAI error object
{"error": {"message", "type", "param", "code"}}. The request bodies and prompt fitting are in nanorl/openai_api.py,
the engine side (replicas, text streams, slow-client guards) in nanorl/serving.py.
"""
import dataclasses
import errno
import functools
import json
import os
import socket
import sys
import time
import uuid

import torch
import uvicorn
from fastapi import APIRouter, FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from nanorl.checkpoint import load_model
from nanorl.common import ArgumentParser, autodetect_device_type, number_in
from nanorl.engine import Engine
from nanorl.openai_api import BadRequest, ChatRequest, PageRequest, ServeConfig, error_body, prepare, validation_error
from nanorl.serving import BodyGuard, EngineError, HeaderDeadline, Replica, ServerState, generate

UI_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "nanorl", "ui.html")

router = APIRouter()


def state(request) -> ServerState:
    return request.app.state.nanorl


# --- errors: every one is OpenAI's error object, FastAPI's own 404/405/422 included -----------------------------------


def error(status, message, param=None, code=None, kind=None, headers=None):
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    return JSONResponse(error_body(message, kind, param, code), status_code=status, headers=headers)


async def on_bad_request(request, e):
    return error(e.status, e.message, e.param, e.code)


async def on_http_error(request, e):
    hint = ""
    if e.status_code == 404 and request.url.path.rstrip("/").endswith(("/chat/completions", "/models")):
        hint = ": the OpenAI API is under /v1 (a client's base_url ends in /v1)"
    code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "http_error")
    return error(e.status_code, f"{e.detail}: {request.method} {request.url.path}{hint}", code=code, headers=e.headers)


async def on_invalid(request, e):
    b = validation_error(e)
    return error(400, b.message, b.param, b.code)


async def on_crash(request, e):
    return error(500, f"internal error: {type(e).__name__}: {e}", code="internal_error")


def failure(st, e):
    """An error after the stream began: this request's error event (other requests go on)."""
    st.stats.errors += 1
    if isinstance(e, BadRequest):
        return error_body(e.message, param=e.param, code=e.code)
    if isinstance(e, EngineError):
        return error_body(str(e), "server_error", code="engine_error")
    return error_body(f"internal error: {type(e).__name__}: {e}", "server_error", code="internal_error")


# --- helpers ----------------------------------------------------------------------------------------------------------


async def parse(request, schema, fit=False):
    st = state(request)
    return await run_in_threadpool(prepare, await request.body(), schema, st.tokenizer, st.config, st.max_len, fit)


def sse(obj):
    return f"data: {json.dumps(obj)}\n\n"


def event_stream(events):
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def model_card(st):
    return {"id": st.config.model, "object": "model", "created": int(st.stats.start), "owned_by": "nanorl",
            "context_length": st.max_len}


# --- the page and the server's own endpoints --------------------------------------------------------------------------


@router.get("/")
async def index(request: HTTPRequest):
    return HTMLResponse(state(request).page)


@router.get("/health")
async def health(request: HTTPRequest):
    replicas = state(request).replicas
    alive = all(r.thread.is_alive() for r in replicas)
    body = {"status": "ok" if alive else "degraded", "replicas": len(replicas)}
    return JSONResponse(body, status_code=200 if alive else 503)


@router.get("/stats")
async def stats(request: HTTPRequest):
    st = state(request)
    per = [{"replica": i, "device": r.name, "in_flight_samples": r.in_flight, "requests": r.served,
            "busy_slots": sum(s is not None for s in r.engine.slots), "batch_size": r.engine.batch_size,
            "queued": len(r.engine.pending)} for i, r in enumerate(st.replicas)]
    s = st.stats
    return {"requests_served": s.requests, "errors": s.errors, "cancelled": s.cancelled, "tokens_generated": s.tokens,
            "tokens_per_s": round(s.tokens_per_s(), 2), "queue_length": sum(p["queued"] for p in per),
            "uptime_s": round(time.time() - s.start, 1), "replicas": per}


@router.get("/v1/models")
async def models(request: HTTPRequest):
    return {"object": "list", "data": [model_card(state(request))]}


@router.get("/v1/models/{model_id:path}")
async def model(request: HTTPRequest, model_id: str):
    st = state(request)
    if model_id != st.config.model:
        raise BadRequest(f"the model '{model_id}' does not exist: this server serves '{st.config.model}'",
                         "model", "model_not_found", 404)
    return model_card(st)


@router.get("/ui/info")
async def ui_info(request: HTTPRequest):
    st = state(request)
    # the page reserves its max_tokens beside the conversation (leaving out the oldest turns to make room): by default
    # a quarter of the context, so that a small model keeps its history (a 256-token one asked for 512 would keep none)
    default = min(st.config.max_tokens, max(1, st.max_len // 4))
    return {"model": st.config.model, "context_length": st.max_len, "max_tokens": st.config.max_tokens,
            "default_max_tokens": default}


@router.post("/ui/chat")
async def ui_chat(request: HTTPRequest):
    """The page's stream: data: {"prompt_tokens", "dropped", "context"} first (dropped: how many of the oldest
    messages did not fit), then {"token": text, "type": text|python|python_output} and {"finish_reason"}, then
    [DONE]."""
    st = state(request)
    _, ids, settings, dropped = await parse(request, PageRequest, fit=True)

    async def events():
        yield sse({"prompt_tokens": len(ids), "dropped": dropped, "context": st.max_len})
        try:
            async for ev in generate(st, ids, settings, [], parts=True):
                if ev[0] == "delta":
                    yield sse({"token": ev[3], "type": ev[2]})
                elif ev[0] == "end":
                    yield sse({"finish_reason": ev[2]})
            st.stats.requests += 1
        except Exception as e:
            yield sse({"error": failure(st, e)["error"]["message"]})
        yield "data: [DONE]\n\n"

    return event_stream(events())


# --- the OpenAI chat API ----------------------------------------------------------------------------------------------


def _usage(prompt, completion):
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _logprobs(content):
    return None if content is None else {"content": content, "refusal": None}


def _chat_stream(st, req, ids, settings, stops, logprobs, head):
    """stream: true -> the chunks: each sample's role, its text deltas, its finish_reason (with its log-probs), and
    with stream_options.include_usage a last chunk with the usage and no choices."""
    with_usage = req.stream_options is not None and req.stream_options.include_usage

    def chunk(choices, **extra):
        return sse({**head, "object": "chat.completion.chunk", "choices": choices,
                    **({"usage": None} if with_usage else {}), **extra})

    async def events():
        for i in range(settings["num_samples"]):
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        try:
            async for ev in generate(st, ids, settings, stops, logprobs=logprobs):
                if ev[0] == "delta":
                    yield chunk([{"index": ev[1], "delta": {"content": ev[3]}, "logprobs": None,
                                  "finish_reason": None}])
                elif ev[0] == "end":  # a sample's log-probs come with its finish_reason, all at once
                    yield chunk([{"index": ev[1], "delta": {}, "logprobs": _logprobs(ev[3]), "finish_reason": ev[2]}])
                elif with_usage:
                    yield chunk([], usage=_usage(len(ids), ev[1]))
            st.stats.requests += 1
        except Exception as e:
            yield sse(failure(st, e))
        yield "data: [DONE]\n\n"

    return event_stream(events())


async def _chat_whole(st, ids, settings, stops, logprobs, head):
    """stream: false -> one chat.completion with every sample."""
    n = settings["num_samples"]
    texts, finish, lps, tokens = [""] * n, [None] * n, [None] * n, 0
    try:
        async for ev in generate(st, ids, settings, stops, logprobs=logprobs):
            if ev[0] == "delta":
                texts[ev[1]] += ev[3]
            elif ev[0] == "end":
                finish[ev[1]], lps[ev[1]] = ev[2], _logprobs(ev[3])
            else:
                tokens = ev[1]
    except EngineError as e:
        st.stats.errors += 1
        return error(500, str(e), code="engine_error")
    st.stats.requests += 1
    choices = [{"index": i, "message": {"role": "assistant", "content": texts[i]}, "logprobs": lps[i],
                "finish_reason": finish[i]} for i in range(n)]
    return {**head, "object": "chat.completion", "choices": choices, "usage": _usage(len(ids), tokens)}


@router.post("/v1/chat/completions")
async def chat_completions(request: HTTPRequest):
    st = state(request)
    req, ids, settings, _ = await parse(request, ChatRequest)
    stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    head = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": st.config.model}
    if req.stream:
        return _chat_stream(st, req, ids, settings, stops, logprobs, head)
    return await _chat_whole(st, ids, settings, stops, logprobs, head)


# --- the app and its server -------------------------------------------------------------------------------------------


def create_app(engines, tokenizer, config=None):
    """A FastAPI app serving these engines (one per device; each gets a serve_forever thread here)."""
    config = config or ServeConfig()
    # the longest token in bytes: a conversation's bytes / this bounds its tokens from below, without tokenising it
    token_bytes = max(len(tokenizer.decode_token_bytes(i)) for i in range(tokenizer.vocab_size))
    config = dataclasses.replace(config, token_bytes=token_bytes)
    with open(UI_PATH, encoding="utf-8") as f:
        page = f.read()
    replicas = [Replica(e, f"{e.device}") for e in engines]
    app = FastAPI(title="nanorl", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.nanorl = ServerState(replicas, tokenizer, config, min(e.max_len for e in engines), page)
    app.state.connections = {}  # the open connections' header deadlines (server_config), for BodyGuard
    app.add_middleware(BodyGuard, timeout=config.body_timeout, max_bytes=config.max_body_bytes,
                       open=app.state.connections)
    app.add_exception_handler(BadRequest, on_bad_request)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_invalid)
    app.add_exception_handler(Exception, on_crash)
    app.include_router(router)

    def shutdown():
        for r in replicas:
            r.engine.shutdown()

    app.state.shutdown = shutdown
    return app


def server_config(app, host, port, header_timeout=10.0):
    """The uvicorn config chat_web serves with: each request's headers must arrive within header_timeout seconds
    (HeaderDeadline), idle kept-alive connections close after 5 s (uvicorn's default). proxy_headers=False: the
    deadline finds a request's connection by the client address in the ASGI scope, which X-Forwarded-For would
    rewrite."""
    http = functools.partial(HeaderDeadline, header_timeout, app.state.connections)
    return uvicorn.Config(app, host=host, port=port, http=http, log_level="warning", proxy_headers=False)


def load_engines(args):
    """One engine per device (GPUs: --num-gpus; CPU/MPS: one). Exits with one line if the model cannot load."""
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
            model, tokenizer, meta = load_model(args.source, dev, phase="eval", model_tag=args.model_tag,
                                                step=args.model_step, hf_model=args.hf_model)
        except (FileNotFoundError, ValueError) as e:
            sys.exit(f"could not load the {args.source} model: {e}")
        engines.append(Engine(model, tokenizer, batch_size=args.batch_size))
    return engines, tokenizer, meta, devices


def parse_args(argv=None):
    parser = ArgumentParser(description="Serve a nanorl model: chat page + OpenAI-compatible API")
    parser.add_argument("-i", "--source", type=str, default="sft", choices=["base", "mid", "sft", "rl"],
                        help="which model")
    parser.add_argument("-g", "--model-tag", type=str, default=None, help="model tag; None picks the newest")
    parser.add_argument("-s", "--model-step", "--step", type=number_in(int, 0), default=None,
                        help="checkpoint step; None picks the last")
    parser.add_argument("--hf-model", type=str, default=None, metavar="DIR",
                        help="serve a Hugging Face model directory instead of --source")
    parser.add_argument("--host", type=str, default="127.0.0.1",
                        help="address to listen on; 0.0.0.0 serves other machines")
    parser.add_argument("-p", "--port", type=number_in(int, 0, 65535), default=8000,
                        help="port to listen on (0: any free one)")
    parser.add_argument("-n", "--num-gpus", type=number_in(int, 1), default=1,
                        help="one engine replica per GPU (CPU: always one)")
    parser.add_argument("-b", "--batch-size", type=number_in(int, 1), default=32,
                        help="engine slots per replica (concurrent samples)")
    parser.add_argument("-m", "--max-tokens", type=number_in(int, 1), default=512,
                        help="the most tokens a request may generate (and what a request that names none gets)")
    parser.add_argument("--device-type", type=str, default=None, choices=["cuda", "cpu", "mps"],
                        help="None detects the device")
    parser.add_argument("--header-timeout", type=number_in(float, 0.01), default=10.0,
                        help="seconds a client has to send a request's headers before it is disconnected")
    parser.add_argument("--body-timeout", type=number_in(float, 0.01), default=30.0,
                        help="seconds a client has to send a request's body (then 408)")
    return parser.parse_args(argv)


def bind(host, port):
    """The listening socket, bound before anything else: a taken port is one line at once, not uvicorn's errno line
    after the model has loaded and "serving at" was printed."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as e:
        sys.exit(f"--host {host}: {e.strerror}")
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a port in TIME_WAIT can be reused
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            sys.exit(f"port {port} is in use on {host}: stop the server there or pick another --port")
        sys.exit(f"cannot listen on {host}:{port}: {e.strerror}")
    return sock


def main():
    args = parse_args()
    sock = bind(args.host, args.port)
    engines, tokenizer, meta, devices = load_engines(args)
    name = f"nanorl-{args.source}-{meta.get('model_tag', 'model')}"
    config = ServeConfig(max_tokens=args.max_tokens, model=name, base=args.source == "base",
                         body_timeout=args.body_timeout)
    app = create_app(engines, tokenizer, config)
    url = f"http://{args.host}:{sock.getsockname()[1]}"  # --port 0: the port the system picked
    print(f"serving {name} on {len(engines)} replica(s) ({', '.join(map(str, devices))}) at {url} "
          f"(OpenAI API: {url}/v1)", flush=True)
    uvicorn.Server(server_config(app, args.host, args.port, args.header_timeout)).run(sockets=[sock])


if __name__ == "__main__":
    main()
