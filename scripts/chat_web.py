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

Endpoints: GET / (the page), GET /ui/info and POST /ui/chat (the page's own stream); the OpenAI API: POST
/v1/chat/completions (function calling too, for an open model whose chat template renders tools), POST
/v1/completions (text continuation, for a base model), GET /v1/models, GET /v1/models/{id}; POST /tokenize and
/detokenize (as vLLM's); GET /health, /stats, /metrics (Prometheus text), /version. With
--api-key, the API, /tokenize, /detokenize and the page's stream need "Authorization: Bearer KEY". Every error is an
OpenAI error object {"error": {"message", "type", "param", "code"}}; every request logs one line (id, status, tokens
in/out, time). The request bodies and prompt fitting are in nanorl/openai_api.py, tools and tool calls in
nanorl/function_calls.py, the engine side (replicas, text streams, metrics, slow-client guards) in nanorl/serving.py.
"""

import argparse
import dataclasses
import errno
import functools
import hmac
import importlib.metadata
import logging
import os
import socket
import sys
import time

import torch
import uvicorn
from fastapi import APIRouter, Depends, FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from nanorl import openai_api
from nanorl.common import autodetect_device_type
from nanorl.engine import Engine
from nanorl.flags import ArgumentParser, number_in
from nanorl.function_calls import ReplyStream, chat_choice, reply_message
from nanorl.middleware import BodyGuard, HeaderDeadline, RequestLog
from nanorl.model_loading import add_model_args, load_model_from_args
from nanorl.openai_api import (
    BadRequest,
    ChatRequest,
    PageRequest,
    ServeConfig,
    check_model,
    error_body,
    prepare,
    prepare_completion,
    stop_strings,
    tool_plan,
    validation_error,
)
from nanorl.serving import (
    EngineError,
    Replica,
    ServerState,
    chat_logprobs,
    collect,
    event_stream,
    failure,
    generate,
    openai_stream,
    prometheus_text,
    sse,
    text_logprobs,
    usage,
)

UI_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "nanorl", "ui.html")

try:
    VERSION = importlib.metadata.version("nanorl")
except importlib.metadata.PackageNotFoundError:  # run from a clone that was not pip-installed
    VERSION = "unknown"

router = APIRouter()  # the page and the server's own endpoints, open to all


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


async def on_engine_error(request, e):
    state(request).stats.errors += 1
    return error(500, str(e), code="engine_error")


# --- helpers ----------------------------------------------------------------------------------------------------------


async def require_api_key(request: HTTPRequest):
    """With --api-key, the API and the page's stream need "Authorization: Bearer <key>" (as OpenAI's)."""
    key = state(request).config.api_key
    sent = request.headers.get("authorization", "").encode()
    if key and not hmac.compare_digest(sent, f"Bearer {key}".encode()):
        raise BadRequest(
            "a missing or wrong API key: send the header 'Authorization: Bearer <key>' with the key "
            "chat_web was started with (--api-key)",
            code="invalid_api_key",
            status=401,
        )


api = APIRouter(dependencies=[Depends(require_api_key)])  # the routes an API key guards


async def in_thread(request, fn, *args):
    """fn(raw body, tokenizer, config, *args) in a worker thread: parsing and tokenising never block the loop."""
    st = state(request)
    return await run_in_threadpool(fn, await request.body(), st.tokenizer, st.config, *args)


def model_card(st):
    return {
        "id": st.config.model,
        "object": "model",
        "created": int(st.stats.start),
        "owned_by": "nanorl",
        "context_length": st.max_len,
    }


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
    per = [
        {
            "replica": i,
            "device": r.name,
            "in_flight_samples": r.in_flight,
            "requests": r.served,
            "busy_slots": sum(s is not None for s in r.engine.slots),
            "batch_size": r.engine.batch_size,
            "queued": len(r.engine.pending),
        }
        for i, r in enumerate(st.replicas)
    ]
    s = st.stats
    return {
        "requests_served": s.requests,
        "errors": s.errors,
        "cancelled": s.cancelled,
        "tokens_generated": s.tokens,
        "tokens_per_s": round(s.tokens_per_s(), 2),
        "queue_length": sum(p["queued"] for p in per),
        "uptime_s": round(time.time() - s.start, 1),
        "replicas": per,
    }


@router.get("/metrics")
async def metrics(request: HTTPRequest):
    return PlainTextResponse(prometheus_text(state(request)), media_type="text/plain; version=0.0.4")


@router.get("/version")
async def version(request: HTTPRequest):
    return {"version": VERSION, "model": state(request).config.model, "torch": torch.__version__}


@api.get("/v1/models")
async def models(request: HTTPRequest):
    return {"object": "list", "data": [model_card(state(request))]}


@api.get("/v1/models/{model_id:path}")
async def model(request: HTTPRequest, model_id: str):
    st = state(request)
    check_model(model_id, st.config)
    return model_card(st)


@api.post("/tokenize")
async def tokenize(request: HTTPRequest):
    ids = await in_thread(request, openai_api.tokenize, state(request).max_len)
    return {"tokens": ids, "count": len(ids), "max_model_len": state(request).max_len}


@api.post("/detokenize")
async def detokenize(request: HTTPRequest):
    return {"prompt": await in_thread(request, openai_api.detokenize)}


@router.get("/ui/info")
async def ui_info(request: HTTPRequest):
    st = state(request)
    # the page's max-tokens box starts at the server's limit: a reply runs on while the context has room, and only
    # a quarter of the context is kept free for it when the oldest turns must go (openai_api.reply_reserve)
    return {
        "model": st.config.model,
        "context_length": st.max_len,
        "max_tokens": st.config.max_tokens,
        "api_key": st.config.api_key is not None,
    }


@api.post("/ui/chat")
async def ui_chat(request: HTTPRequest):
    """The page's stream: data: {"prompt_tokens", "dropped", "context"} first (dropped: how many of the oldest
    messages did not fit), then {"token": text, "type": text|python|python_output} and {"finish_reason"}, then
    [DONE]."""
    st, trace = state(request), request.state.trace
    _, ids, settings, dropped = await in_thread(request, prepare, st.max_len, PageRequest, True)

    async def events():
        yield sse({"prompt_tokens": len(ids), "dropped": dropped, "context": st.max_len})
        try:
            async for ev in generate(st, ids, settings, [], parts=True, trace=trace):
                if ev[0] == "delta":
                    yield sse({"token": ev[3], "type": ev[2]})
                elif ev[0] == "end":
                    yield sse({"finish_reason": ev[2]})
            st.stats.requests += 1
        except Exception as e:
            yield sse({"error": failure(st, e, trace)["error"]["message"]})
        yield "data: [DONE]\n\n"

    return event_stream(events())


# --- the OpenAI API: chat and text completions ------------------------------------------------------------------------


@api.post("/v1/chat/completions")
async def chat_completions(request: HTTPRequest):
    """Chat, with function calling for the chat templates that render tools (nanorl/function_calls.py)."""
    st, trace = state(request), request.state.trace
    req, ids, settings, _ = await in_thread(request, prepare, st.max_len, ChatRequest)
    plan = tool_plan(req, st.tokenizer)  # None: no tools
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    events = generate(st, ids, settings, stop_strings(req), logprobs=logprobs, trace=trace)
    head = {"id": f"chatcmpl-{trace.id}", "created": int(time.time()), "model": st.config.model}
    n = settings["num_samples"]
    if req.stream:
        replies = [ReplyStream(i, plan) for i in range(n)]
        return openai_stream(
            st,
            trace,
            events,
            {**head, "object": "chat.completion.chunk"},
            req.stream_options is not None and req.stream_options.include_usage,
            delta=lambda i, text: replies[i].push(text),
            end=lambda i, why, lp: replies[i].end(why, chat_logprobs(lp)),
            opening=[
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(n)
            ],
        )
    texts, finish, contents, tokens = await collect(st, events, n)
    choices = [chat_choice(i, reply_message(texts[i], plan), finish[i], chat_logprobs(contents[i])) for i in range(n)]
    return {**head, "object": "chat.completion", "choices": choices, "usage": usage(len(ids), tokens)}


@api.post("/v1/completions")
async def completions(request: HTTPRequest):
    """Text in, its continuation out, as a document goes on (the base model's endpoint; a chat model's too)."""
    st, trace = state(request), request.state.trace
    req, ids, settings = await in_thread(request, prepare_completion, st.max_len)
    events = generate(st, ids, settings, stop_strings(req), logprobs=req.logprobs, trace=trace)
    head = {
        "id": f"cmpl-{trace.id}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": st.config.model,
    }
    if req.stream:
        return openai_stream(
            st,
            trace,
            events,
            head,
            req.stream_options is not None and req.stream_options.include_usage,
            delta=lambda i, text: [{"index": i, "text": text, "logprobs": None, "finish_reason": None}],
            end=lambda i, why, lp: [{"index": i, "text": "", "logprobs": text_logprobs(lp), "finish_reason": why}],
        )
    n = settings["num_samples"]
    texts, finish, contents, tokens = await collect(st, events, n)
    choices = [
        {"index": i, "text": texts[i], "logprobs": text_logprobs(contents[i]), "finish_reason": finish[i]}
        for i in range(n)
    ]
    return {**head, "choices": choices, "usage": usage(len(ids), tokens)}


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
    app.add_middleware(
        BodyGuard, timeout=config.body_timeout, max_bytes=config.max_body_bytes, open=app.state.connections
    )
    app.add_middleware(RequestLog, stats=app.state.nanorl.stats)  # outermost: it sees BodyGuard's refusals too
    app.add_exception_handler(BadRequest, on_bad_request)
    app.add_exception_handler(EngineError, on_engine_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_invalid)
    app.add_exception_handler(Exception, on_crash)
    app.include_router(router)
    app.include_router(api)

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
            model, tokenizer, meta = load_model_from_args(args, dev, phase="eval")
        except (FileNotFoundError, ValueError) as e:
            sys.exit(f"could not load the {args.source} model: {e}")
        engines.append(Engine(model, tokenizer, batch_size=args.batch_size))
        # the other replicas load the checkpoint this one did, by tag and step: not a newer one a run saves meanwhile,
        # and the tag's choice (and its line, when there are several tags) is made once
        args.model_tag, args.model_step = meta.get("model_tag", args.model_tag), meta.get("step", args.model_step)
    return engines, tokenizer, meta, devices


class NoPrompt(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(
            f"-p {values!r}: chat_web serves the page and the API and takes no prompt (the port is --port); "
            "a one-shot answer is chat_cli's -p: python -m scripts.chat_cli -i rl -p 'What is 2+2?'"
        )


def parse_args(argv=None):
    parser = ArgumentParser(description="Serve a nanorl model: chat page + OpenAI-compatible API")
    add_model_args(parser, "sft", short=True)
    parser.add_argument(
        "--host", type=str, default="127.0.0.1", help="address to listen on; 0.0.0.0 serves other machines"
    )
    parser.add_argument(
        "--port", type=number_in(int, 0, 65535), default=8000, help="port to listen on (0: any free one)"
    )
    # -p is chat_cli's prompt: here it is refused with where to go, never read as a port
    parser.add_argument("-p", action=NoPrompt, help=argparse.SUPPRESS)
    parser.add_argument(
        "-n", "--num-gpus", type=number_in(int, 1), default=1, help="one engine replica per GPU (CPU: always one)"
    )
    parser.add_argument(
        "-b", "--batch-size", type=number_in(int, 1), default=32, help="engine slots per replica (concurrent samples)"
    )
    parser.add_argument(
        "-m",
        "--max-tokens",
        type=number_in(int, 1),
        default=512,
        help="the most tokens a request may generate (and what a request that names none gets)",
    )
    parser.add_argument(
        "--device-type", type=str, default=None, choices=["cuda", "cpu", "mps"], help="None detects the device"
    )
    parser.add_argument(
        "--header-timeout",
        type=number_in(float, 0.01),
        default=10.0,
        help="seconds a client has to send a request's headers before it is disconnected",
    )
    parser.add_argument(
        "--body-timeout",
        type=number_in(float, 0.01),
        default=30.0,
        help="seconds a client has to send a request's body (then 408)",
    )
    parser.add_argument(
        "--api-key",
        type=str,
        default=None,
        help="if set, the API and the page need 'Authorization: Bearer KEY'; $NANORL_API_KEY also sets it (and keeps "
        "it out of the process list)",
    )
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
    config = ServeConfig(
        max_tokens=args.max_tokens,
        model=name,
        base=args.source == "base",
        body_timeout=args.body_timeout,
        api_key=args.api_key or os.environ.get("NANORL_API_KEY") or None,
    )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")  # one line per request (RequestLog)
    app = create_app(engines, tokenizer, config)
    url = f"http://{args.host}:{sock.getsockname()[1]}"  # --port 0: the port the system picked
    print(
        f"serving {name} on {len(engines)} replica(s) ({', '.join(map(str, devices))}) at {url} (OpenAI API: {url}/v1)",
        flush=True,
    )
    uvicorn.Server(server_config(app, args.host, args.port, args.header_timeout)).run(sockets=[sock])


if __name__ == "__main__":
    main()
