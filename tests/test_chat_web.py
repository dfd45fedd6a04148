"""scripts/chat_web.py on a tiny random-weight model (CPU): API schema, validation, concurrency, disconnects, a browser."""

import base64
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A real uvicorn server on 127.0.0.1 (port 0) in a background thread, over one engine with 8 slots."""
    d = tmp_path_factory.mktemp("web")
    env = {**os.environ, "NANORL_BASE_DIR": str(d)}
    subprocess.run(
        [sys.executable, "-m", "scripts.tok_train", "--vocab-size", "600", "--max-chars", "300000"],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
    )
    import torch

    from nanorl.checkpoint import save_checkpoint
    from nanorl.engine import Engine
    from nanorl.gpt import GPTConfig
    from nanorl.gpt import build_model as build_gpt
    from nanorl.model_loading import checkpoint_root, load_model_dir
    from nanorl.openai_api import ServeConfig
    from nanorl.tokenizer import get_tokenizer
    from scripts.chat_web import create_app

    old = os.environ.get("NANORL_BASE_DIR")
    os.environ["NANORL_BASE_DIR"] = str(d)
    try:
        tok = get_tokenizer()
        torch.manual_seed(0)
        cfg = GPTConfig(sequence_len=256, vocab_size=tok.vocab_size, n_layer=1, n_head=1, n_kv_head=1, n_embd=32)
        m = build_gpt(cfg, "cpu")
        with torch.no_grad():
            m.lm_head.weight.normal_(0, 0.2)
        ckpt = checkpoint_root("sft") + "/t"
        save_checkpoint(ckpt, 0, m.state_dict(), meta={"model_config": cfg.to_dict()})
        model, tokenizer, _ = load_model_dir(ckpt, device="cpu", phase="eval")
    finally:
        if old is None:
            del os.environ["NANORL_BASE_DIR"]
        else:
            os.environ["NANORL_BASE_DIR"] = old
    engine = Engine(model, tokenizer, batch_size=8)
    app = create_app([engine], tokenizer, ServeConfig(max_tokens=64, model="tiny"))
    with serve(app) as url:
        yield dict(url=url, engine=engine, app=app, model=model, tokenizer=tokenizer, base_dir=d)


@contextlib.contextmanager
def serve(app, header_timeout=10.0):
    """Run app on a real uvicorn server as chat_web configures it, 127.0.0.1 and a free port, in a background thread."""
    import uvicorn

    from scripts.chat_web import server_config

    srv = uvicorn.Server(server_config(app, "127.0.0.1", 0, header_timeout))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    t0 = time.time()
    while not srv.started:
        assert thread.is_alive() and time.time() - t0 < 30, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{srv.servers[0].sockets[0].getsockname()[1]}"
    finally:
        srv.should_exit = True
        thread.join(10)
        app.state.shutdown()


def user(text="hello"):
    return [{"role": "user", "content": text}]


def sse_data(text):
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


def wait_idle(engine, timeout=10):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if all(s is None for s in engine.slots) and not engine.pending and not engine.live:
            return True
        time.sleep(0.02)
    return False


# --- the API ------------------------------------------------------------------------------------


def test_openai_non_streaming_schema(server):
    r = httpx.post(
        server["url"] + "/v1/chat/completions",
        json={"messages": user(), "max_tokens": 10, "n": 2, "seed": 1},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion" and body["model"] == "tiny"
    assert isinstance(body["created"], int) and len(body["choices"]) == 2
    for i, c in enumerate(body["choices"]):
        assert c["index"] == i and c["message"]["role"] == "assistant" and isinstance(c["message"]["content"], str)
        assert c["finish_reason"] in ("stop", "length")
    u = body["usage"]
    assert (
        u["prompt_tokens"] > 0
        and 1 <= u["completion_tokens"] <= 20
        and u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    )
    # a seed makes it reproducible, whatever else shares the batch
    again = httpx.post(
        server["url"] + "/v1/chat/completions",
        json={"messages": user(), "max_tokens": 10, "n": 2, "seed": 1},
        timeout=30,
    ).json()
    assert [c["message"] for c in again["choices"]] == [c["message"] for c in body["choices"]]


def test_openai_streaming_schema(server):
    with httpx.stream(
        "POST",
        server["url"] + "/v1/chat/completions",
        timeout=30,
        json={"messages": user(), "max_tokens": 8, "stream": True, "temperature": 0.0},
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        data = sse_data(r.read().decode())
    assert data[-1] == "[DONE]"
    chunks = [json.loads(x) for x in data[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    # greedy streaming equals greedy non-streaming
    full = httpx.post(
        server["url"] + "/v1/chat/completions",
        json={"messages": user(), "max_tokens": 8, "temperature": 0.0},
        timeout=30,
    ).json()
    assert text == full["choices"][0]["message"]["content"]


def test_stop_strings_and_length(server):
    url = server["url"] + "/v1/chat/completions"
    full = httpx.post(url, json={"messages": user(), "max_tokens": 30, "temperature": 0.0}, timeout=30).json()
    text = full["choices"][0]["message"]["content"]
    if full["choices"][0]["finish_reason"] == "length":
        assert full["usage"]["completion_tokens"] == 30
    if len(text) >= 6:
        stop = text[3:6]
        cut = httpx.post(
            url, json={"messages": user(), "max_tokens": 30, "temperature": 0.0, "stop": [stop]}, timeout=30
        ).json()
        assert cut["choices"][0]["message"]["content"] == text[: text.find(stop)]
        assert cut["choices"][0]["finish_reason"] == "stop"
        with httpx.stream(
            "POST",
            url,
            json={"messages": user(), "max_tokens": 30, "temperature": 0.0, "stop": stop, "stream": True},
            timeout=30,
        ) as r:
            chunks = [json.loads(x) for x in sse_data(r.read().decode())[:-1]]
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == text[: text.find(stop)]
    assert wait_idle(server["engine"])  # the rows cut short by a stop string were cancelled


def test_page_stream_and_index(server):
    r = httpx.get(server["url"] + "/")
    assert (
        r.status_code == 200
        and "<textarea" in r.text
        and "http" not in r.text.split("<script>")[0].lower().replace("http-equiv", "")
    )
    r = httpx.post(server["url"] + "/ui/chat", json={"messages": user(), "max_tokens": 5}, timeout=30)
    data = sse_data(r.text)
    assert data[-1] == "[DONE]"
    events = [json.loads(x) for x in data[:-1]]
    prompt = server["tokenizer"].render_for_completion({"messages": user()})
    assert events[0] == {"prompt_tokens": len(prompt), "dropped": 0, "context": 256}
    assert any("token" in e for e in events) and all(
        e.get("type", "text") in ("text", "python", "python_output") for e in events
    )


def test_tool_parts_are_typed(server):
    # force a tool call through the parts renderer directly: <|python_start|>2+3<|python_end|><|output_start|>5<|output_end|>
    from nanorl.serving import SampleText as _SampleText

    tok = server["tokenizer"]
    sp = tok.encode_special
    s = _SampleText(tok, [], parts=True)
    out = []
    for t in (
        tok.encode("So ")
        + [sp("<|python_start|>")]
        + tok.encode("2+3")
        + [sp("<|python_end|>"), sp("<|output_start|>")]
        + tok.encode("5")
        + [sp("<|output_end|>")]
        + tok.encode(" done")
    ):
        out += s.push(t)
    out += s.end("completed")
    merged = []
    for kind, text in out:
        if merged and merged[-1][0] == kind:
            merged[-1][1] += text
        else:
            merged.append([kind, text])
    assert merged == [["text", "So "], ["python", "2+3"], ["python_output", "5"], ["text", " done"]]
    plain = _SampleText(tok, [], parts=False)  # the API shows it in GSM8K's notation
    text = "".join(
        x
        for t in [sp("<|python_start|>")]
        + tok.encode("2+3")
        + [sp("<|python_end|>"), sp("<|output_start|>")]
        + tok.encode("5")
        + [sp("<|output_end|>")]
        for _, x in plain.push(t)
    )
    assert text == "<<2+3=5>>"


# Malformed requests: (method, path, body, status, a fragment of the error message). A str body is sent raw.
DEEP = "[" * 100000 + "]" * 100000
MALFORMED = (
    [
        ("POST", "/v1/chat/completions", "{not json", 400, "malformed JSON"),
        ("POST", "/v1/chat/completions", "", 400, "malformed JSON"),
        ("POST", "/v1/chat/completions", b"\xff\xfe{}", 400, "malformed JSON"),
        ("POST", "/v1/chat/completions", "[1, 2]", 400, "JSON object"),
        ("POST", "/v1/chat/completions", DEEP, 400, "nested too deeply"),
        ("POST", "/v1/chat/completions", '{"messages": ' + DEEP + "}", 400, "nested too deeply"),
        ("POST", "/v1/chat/completions", '{"messages": [], "seed": ' + "9" * 5000 + "}", 400, "malformed JSON"),
        (
            "POST",
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
            400,
            "finite",
        ),
        (
            "POST",
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "hi"}], "top_p": NaN}',
            400,
            "finite",
        ),
        (
            "POST",
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}',
            400,
            "finite",
        ),
        (
            "POST",
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "hi"}], "top_p": 1e999}',
            400,
            "finite",
        ),
        ("POST", "/v1/chat/completions", {"messages": []}, 400, "'messages'"),
        ("POST", "/v1/chat/completions", {}, 400, "'messages': Field required"),
        (
            "POST",
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}] * 250
                + [{"role": "user", "content": "c"}]
            },
            400,
            "at most 500",
        ),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 8001}]}, 400, "too long"),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "'messages.0.role'"),
        (
            "POST",
            "/v1/chat/completions",
            {"messages": [{"role": "tool", "content": "5", "tool_call_id": "x"}]},
            400,
            "this model's chat format has no function calling",
        ),
        (
            "POST",
            "/v1/chat/completions",
            {"messages": [{"role": "tool", "content": "5"}]},
            400,
            "a tool message needs the tool_call_id",
        ),
        (
            "POST",
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            400,
            "messages.0.content",
        ),
        (
            "POST",
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "python", "text": "1+1"}]}]},
            400,
            "parts must have type 'text'",
        ),
        (
            "POST",
            "/v1/chat/completions",
            {"messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "hi"}]},
            400,
            "expected 'user'",
        ),
        # consecutive messages of one role are merged (as OpenAI accepts them), so a system message between two user
        # messages is what breaks the user/assistant alternation
        (
            "POST",
            "/v1/chat/completions",
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "system", "content": "x"},
                    {"role": "user", "content": "hi"},
                ]
            },
            400,
            "expected 'assistant'",
        ),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": 7}]}, 400, "messages.0.content"),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "content is required"),
        (
            "POST",
            "/v1/chat/completions",
            {"messages": [{"role": "system", "content": "be nice"}]},
            400,
            "last message must be from the user",
        ),
        (
            "POST",
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hi"}]},
            400,
            "last message must be from the user",
        ),
        (
            "POST",
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "word " * 1500}]},
            400,
            "over the context",
        ),
    ]
    + [
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **extra}, 400, fragment)
        for extra, fragment in [
            ({"max_tokens": 0}, "'max_tokens'"),
            ({"max_tokens": 65}, "'max_tokens' must be <= 64"),
            ({"max_completion_tokens": 65}, "'max_completion_tokens' must be <= 64"),
            ({"max_completion_tokens": 0}, "'max_completion_tokens'"),
            ({"max_tokens": 5, "max_completion_tokens": 6}, "disagree"),
            ({"max_tokens": 2.5}, "'max_tokens'"),
            ({"max_tokens": "10"}, "'max_tokens'"),
            ({"max_tokens": True}, "'max_tokens'"),
            ({"temperature": 2.5}, "'temperature'"),
            ({"temperature": -0.1}, "'temperature'"),
            ({"temperature": "hot"}, "'temperature'"),
            ({"top_k": 0}, "'top_k'"),
            ({"top_p": 0}, "'top_p'"),
            ({"top_p": 1.5}, "'top_p'"),
            ({"n": 0}, "'n'"),
            ({"n": 9}, "'n'"),
            ({"seed": 2**63}, "'seed'"),
            ({"stop": 5}, "'stop'"),
            ({"stop": ["a", "b", "c", "d", "e"]}, "'stop'"),
            ({"stop": ""}, "'stop'"),
            ({"stream": "yes"}, "'stream'"),
            ({"stream_options": {"include_usage": True}}, "only allowed with stream"),
            ({"stream": True, "stream_options": {"include_usage": True, "x": 1}}, "'stream_options.x'"),
            ({"logprobs": True, "top_logprobs": 21}, "'top_logprobs'"),
            ({"top_logprobs": 2}, "needs logprobs"),
            ({"response_format": {"type": "json_object"}}, "unsupported parameter 'response_format'"),
            ({"presence_penalty": 0.5}, "penalties are not implemented"),
            ({"frequency_penalty": -1}, "penalties are not implemented"),
            ({"logit_bias": {"50": 100}}, "unsupported parameter 'logit_bias'"),
            ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "has no function calling"),
            ({"tools": [{"type": "function"}]}, "'tools.0.function': Field required"),
            ({"tool_choice": "auto"}, "tool_choice needs tools"),
            ({"functions": []}, "unsupported parameter 'functions'"),
            ({"min_p": 0.1}, "unsupported parameter 'min_p'"),
            ({"reasoning_effort": "low"}, "unsupported parameter 'reasoning_effort'"),
            ({"model": 5}, "'model'"),
        ]
    ]
    + [
        (
            "POST",
            "/ui/chat",
            {"messages": [{"role": "user", "content": "hi"}], "n": 2},
            400,
            "unsupported parameter 'n'",
        ),
        ("POST", "/ui/chat", {"messages": [{"role": "user", "content": "hi"}], "temperature": 3}, 400, "'temperature'"),
        ("POST", "/ui/chat", "{not json", 400, "malformed JSON"),
        ("POST", "/ui/chat", '{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, "finite"),
        (
            "POST",
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4o"},
            404,
            "does not exist",
        ),
        ("GET", "/v1/models/gpt-4o", None, 404, "does not exist"),
        ("POST", "/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 404, "base_url ends in /v1"),
        ("GET", "/models", None, 404, "under /v1"),
        ("GET", "/nope", None, 404, "Not Found"),
        ("GET", "/v1/chat/completions", None, 405, "Method Not Allowed"),
        ("DELETE", "/v1/models", None, 405, "Method Not Allowed"),
        ("PUT", "/ui/chat", "{}", 405, "Method Not Allowed"),
    ]
)


def test_malformed_requests_get_openai_errors(server):
    """Every malformed request gets its 4xx and an OpenAI error object naming what is wrong; the server stays up."""
    wrong = []
    for method, path, body, status, fragment in MALFORMED:
        kw = (
            {}
            if body is None
            else {"content": body, "headers": {"content-type": "application/json"}}
            if isinstance(body, (str, bytes))
            else {"json": body}
        )
        r = httpx.request(method, server["url"] + path, timeout=30, **kw)
        err = r.json().get("error") if r.headers.get("content-type") == "application/json" else None
        if not (
            r.status_code == status
            and isinstance(err, dict)
            and set(err) == {"message", "type", "param", "code"}
            and fragment in err["message"]
            and err["type"] == "invalid_request_error"
            and isinstance(err["code"], str)
            and err["code"]
        ):  # every error names a code
            wrong.append((method, path, str(body)[:80], r.status_code, r.text[:300]))
    print(
        f"{len(MALFORMED)} malformed requests tried, {len(MALFORMED) - len(wrong)} got their 4xx with an OpenAI error"
    )
    assert not wrong, wrong
    assert httpx.get(server["url"] + "/health").json()["status"] == "ok"
    # the error names the field in param too
    r = httpx.post(server["url"] + "/v1/chat/completions", json={"messages": user(), "logit_bias": {}}, timeout=30)
    assert r.json()["error"]["param"] == "logit_bias" and r.json()["error"]["code"] == "unsupported_parameter"
    r = httpx.post(server["url"] + "/v1/chat/completions", json={"messages": user(), "model": "gpt-4o"}, timeout=30)
    assert r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["param"] == "model"


def test_base_model_prompt(server):
    # a base model gets the last message as plain text after <|bos|>, no chat tokens
    from nanorl.openai_api import ChatRequest, ServeConfig, prepare

    tok = server["tokenizer"]
    body = json.dumps({"messages": user("The sky is"), "max_tokens": 5}).encode()
    req, ids, settings, dropped = prepare(body, tok, ServeConfig(base=True), 256, ChatRequest)
    assert ids == tok.encode("The sky is", prepend="<|bos|>") and settings["max_tokens"] == 5 and dropped == 0
    assert req.stop is None and not req.stream


def test_prompt_over_context(server):
    # 8000 chars per message is allowed, but a few of them do not fit a 256-token context
    r = httpx.post(server["url"] + "/v1/chat/completions", json={"messages": user("word " * 1500)}, timeout=30)
    assert r.status_code == 400 and "over the context" in r.json()["error"]["message"]


def test_health_models_stats(server):
    assert httpx.get(server["url"] + "/health").json()["status"] == "ok"
    models = httpx.get(server["url"] + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
    httpx.post(server["url"] + "/v1/chat/completions", json={"messages": user(), "max_tokens": 4}, timeout=30)
    st = httpx.get(server["url"] + "/stats").json()
    assert st["requests_served"] >= 1 and st["tokens_generated"] >= 1 and st["tokens_per_s"] > 0
    assert st["queue_length"] == 0 and st["replicas"][0]["batch_size"] == 8 and "busy_slots" in st["replicas"][0]


def test_bench_serve_load_test(server, capsys):
    """`bench serve`: 6 streaming clients at once; the tokens it reports are what /stats counted for them (each
    client's completion_tokens), and every client saw a first token."""
    from scripts.bench import bench_serve, load_test

    r = load_test(server["url"], 6, 5)
    assert r["errors"] == [] and 6 <= r["tokens"] <= 30 and r["wall"] > 0
    assert 0 < r["ttft_p50"] <= r["ttft_p95"] <= r["wall"]
    bench_serve(type("Args", (), dict(url=server["url"] + "/", clients=2, max_tokens=3))())
    lines = capsys.readouterr().out.strip().splitlines()
    out = json.loads(lines[-1])
    assert out["bench"] == "serve" and out["clients"] == 2 and out["errors"] == 0 and 2 <= out["tokens"] <= 6
    assert lines[0].startswith(f"2 clients x max_tokens=3: {out['tokens']} tokens in ")


# --- concurrency and disconnects ----------------------------------------------------------------


def test_twenty_concurrent_clients(server):
    """20 streaming clients on 8 slots: all finish, through the continuous batch (several in a batch at once)."""
    engine, results, peak = server["engine"], [None] * 20, [0]
    stop = threading.Event()

    def watch():  # the most slots busy at once: > 1 means requests really share the batch
        while not stop.is_set():
            peak[0] = max(peak[0], sum(s is not None for s in engine.slots))
            time.sleep(0.002)

    def client(i):
        with httpx.stream(
            "POST",
            server["url"] + "/v1/chat/completions",
            timeout=60,
            json={"messages": user(f"client {i}"), "max_tokens": 24, "stream": True, "seed": i},
        ) as r:
            results[i] = sse_data(r.read().decode())

    w = threading.Thread(target=watch)
    w.start()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    stop.set()
    w.join()
    assert all(r is not None and r[-1] == "[DONE]" for r in results)
    assert all(json.loads(r[-2])["choices"][0]["finish_reason"] in ("stop", "length") for r in results)
    assert peak[0] > 1
    assert wait_idle(engine)


def test_disconnect_frees_the_slot(server, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="nanorl.serve")
    engine, stats = server["engine"], server["app"].state.nanorl.stats
    cancelled = stats.cancelled
    body = json.dumps({"messages": user(), "max_tokens": 64, "stream": True}).encode()
    port = int(server["url"].rsplit(":", 1)[1])
    s = socket.create_connection(("127.0.0.1", port))  # a raw socket, so the disconnect is abrupt
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    assert b"200 OK" in s.recv(4096)
    t0 = time.time()
    while not any(sl is not None for sl in engine.slots):
        assert time.time() - t0 < 5
        time.sleep(0.001)
    with engine.step_lock:  # freeze the engine with the request in its slot, then hang up
        assert any(sl is not None for sl in engine.slots), "finished before the test could freeze it"
        s.close()
        while stats.cancelled == cancelled:
            assert time.time() - t0 < 10, "the server did not notice the disconnect"
            time.sleep(0.01)
    assert wait_idle(engine), "the disconnected request still holds a slot"
    while not any("cancelled before the end (the client went away)" in r.getMessage() for r in caplog.records):
        assert time.time() - t0 < 15, "the request's log line does not say it was cut short"
        time.sleep(0.05)


def test_replicas_share_the_load(server):
    """--num-gpus N makes N engines; a request goes to the one with the fewest samples in flight."""
    from nanorl.engine import Engine
    from nanorl.openai_api import ServeConfig
    from scripts.chat_web import create_app

    engines = [Engine(server["model"], server["tokenizer"], batch_size=4) for _ in range(2)]
    app = create_app(engines, server["tokenizer"], ServeConfig(max_tokens=64))
    replicas = app.state.nanorl.replicas
    with serve(app) as url:

        def client(i):
            httpx.post(url + "/v1/chat/completions", json={"messages": user(), "max_tokens": 32, "seed": i}, timeout=60)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        with engines[0].step_lock, engines[1].step_lock:  # freeze both, so all 8 are in flight at once
            for t in threads:
                t.start()
            t0 = time.time()
            while sum(r.in_flight for r in replicas) < 8:
                assert time.time() - t0 < 20
                time.sleep(0.01)
            assert [r.in_flight for r in replicas] == [4, 4]
        for t in threads:
            t.join(60)
        per = httpx.get(url + "/stats").json()["replicas"]
    assert [p["requests"] for p in per] == [4, 4] and all(p["in_flight_samples"] == 0 for p in per)


def test_replicas_load_the_checkpoint_the_first_one_chose(tmp_path, monkeypatch, capsys):
    """--num-gpus 2 with two tags and no -g: the first replica takes the most recently saved tag and says so once; the
    second loads that same tag and step, even if a run saves a newer step (or tag) between the two loads."""
    import torch

    import scripts.chat_web as chat_web
    from nanorl import checkpoint, model_loading

    monkeypatch.setenv("NANORL_BASE_DIR", str(tmp_path))
    for tag in ("a", "b"):
        checkpoint.save_checkpoint(str(tmp_path / "sft_checkpoints" / tag), 1, {"w": torch.zeros(1)}, meta={"x": 1})
    loaded = []

    def load(args, device, phase):
        d = model_loading.find_checkpoint_dir(args.source, args.model_tag)
        step = args.model_step if args.model_step is not None else checkpoint.find_last_step(d)
        loaded.append((os.path.basename(d), step))
        checkpoint.save_checkpoint(str(tmp_path / "sft_checkpoints" / "a"), 2, {"w": torch.ones(1)}, meta={"x": 2})
        return None, None, {"model_tag": os.path.basename(d), "step": step}

    monkeypatch.setattr(chat_web, "load_model_from_args", load)
    monkeypatch.setattr(chat_web, "Engine", lambda *a, **kw: object())
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    chat_web.load_engines(chat_web.parse_args(["--num-gpus", "2", "--device-type", "cuda"]))
    assert loaded == [("b", 1), ("b", 1)]  # (step 2 of tag a, saved after the first load, is not the second's)
    assert capsys.readouterr().err.count("sft checkpoints have 2 tags (a, b): loading 'b'") == 1


@pytest.mark.gpu
def test_num_gpus_2_every_replica_decodes_on_its_own_gpu(monkeypatch):
    """--num-gpus 2 (bash dev/gpu_check.sh runs it where two GPUs are visible): the second engine lives on cuda:1 and
    must capture its CUDA graphs there; captured on the current device they record nothing, and it would answer
    from stale logits with no error. A rigged bigram model (identity blocks, one-hot embedding, a logit table with a
    margin of 12) answers with a fixed chain of letters whatever the precision: both replicas must give exactly it."""
    import torch

    import scripts.chat_web as chat_web
    from nanorl.engine import Request
    from nanorl.gpt import GPTConfig, build_model
    from nanorl.tokenizer import SPLIT_PATTERN, Tokenizer

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    tok = Tokenizer.from_ranks({bytes([i]): i for i in range(256)}, SPLIT_PATTERN)
    V, C = 272, 288

    def nxt(x):
        return 97 + (x * 7 + 3) % 26  # a-z

    def load(args, device, phase):
        cfg = GPTConfig(sequence_len=64, vocab_size=V, n_layer=1, n_head=4, n_kv_head=2, n_embd=C)
        model = build_model(cfg, device)
        with torch.no_grad():
            model.transformer.wte.weight.copy_(torch.eye(V, C) * C**0.5)
            model.lm_head.weight.zero_()
            for x in range(V):
                model.lm_head.weight[nxt(x), x] = 12 / C**0.5
        return model.eval(), tok, {"model_tag": "bigram"}

    monkeypatch.setattr(chat_web, "load_model_from_args", load)
    args = chat_web.parse_args(["--num-gpus", "2", "--device-type", "cuda", "--batch-size", "4"])
    engines, _, _, devices = chat_web.load_engines(args)
    assert devices == [torch.device("cuda", 0), torch.device("cuda", 1)] == [e.device for e in engines]
    assert all(e.use_cuda_graph for e in engines)  # each passed its start-up check against the eager step
    want, x = [], 10
    for _ in range(24):
        x = nxt(x)
        want.append(x)
    for e in engines:
        reqs = [Request([3, 10], max_tokens=24, temperature=0.0, stop_tokens=[], use_tools=False) for _ in range(3)]
        assert [g[0].tokens for g in e.submit_and_wait(reqs)] == [want] * 3, e.device


# --- a real browser -----------------------------------------------------------------------------


class CDP:
    """A minimal Chrome DevTools Protocol client over a stdlib websocket (text frames only)."""

    def __init__(self, ws_url):
        host_port, path = ws_url[len("ws://") :].split("/", 1)
        host, port = host_port.split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(
            (
                f"GET /{path} HTTP/1.1\r\nHost: {host_port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
            ).encode()
        )
        resp = b""
        while b"\r\n\r\n" not in resp:
            resp += self.sock.recv(1)
        assert b" 101 " in resp, resp
        self.next_id = 0

    def _recv_exact(self, n):
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("devtools closed the connection")
            buf += chunk
        return buf

    def _recv_message(self):
        data = b""
        while True:
            b0, b1 = self._recv_exact(2)
            n = b1 & 0x7F
            if n == 126:
                n = int.from_bytes(self._recv_exact(2), "big")
            elif n == 127:
                n = int.from_bytes(self._recv_exact(8), "big")
            data += self._recv_exact(n)
            if b0 & 0x80:  # FIN
                return json.loads(data)

    def call(self, method, **params):
        self.next_id += 1
        payload = json.dumps({"id": self.next_id, "method": method, "params": params}).encode()
        mask = os.urandom(4)  # client frames must be masked
        n = len(payload)
        head = bytes([0x81]) + (
            bytes([0x80 | n])
            if n < 126
            else bytes([0x80 | 126]) + n.to_bytes(2, "big")
            if n < 65536
            else bytes([0x80 | 127]) + n.to_bytes(8, "big")
        )
        self.sock.sendall(head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))
        while True:
            msg = self._recv_message()
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(msg["error"])
                return msg["result"]

    def eval(self, expr):
        return self.call("Runtime.evaluate", expression=expr, returnByValue=True)["result"].get("value")


@contextlib.contextmanager
def browser_page(url, tmp_path, model):
    """Headless Chromium on the page at url, once it has loaded and shows the model's name: a CDP client to it."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if chromium is None:
        pytest.skip("no chromium on PATH (tests/run.sh installs Debian's chromium when run as root)")
    profile = tmp_path / "profile"
    proc = subprocess.Popen(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--no-first-run",
            "--disable-dev-shm-usage",
            f"--user-data-dir={profile}",
            "--remote-debugging-port=0",
            "--window-size=420,800",
            url + "/",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        t0 = time.time()
        while (
            not (profile / "DevToolsActivePort").exists()
            or len((profile / "DevToolsActivePort").read_text().split()) < 2
        ):
            assert time.time() - t0 < 30 and proc.poll() is None, "chromium did not start"
            time.sleep(0.1)
        port = (profile / "DevToolsActivePort").read_text().split()[0]
        while True:  # the page target appears once the tab is created
            targets = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10).read())
            pages = [t for t in targets if t["type"] == "page" and t["url"].startswith(url)]
            if pages:
                break
            assert time.time() - t0 < 30, targets
            time.sleep(0.1)
        cdp = CDP(pages[0]["webSocketDebuggerUrl"])
        while cdp.eval("document.readyState") != "complete" or not cdp.eval("!!document.getElementById('send')"):
            assert time.time() - t0 < 30
            time.sleep(0.1)
        while model not in (cdp.eval("document.getElementById('model').textContent") or ""):  # the checkpoint's name
            assert time.time() - t0 < 30
            time.sleep(0.05)
        yield cdp
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def page_send(cdp, text, timeout=40):
    """Type text into the page, send it and wait until the reply has finished streaming: the reply's text."""
    n = cdp.eval("document.querySelectorAll('.msg.assistant').length")
    cdp.eval(f"document.getElementById('input').value = {json.dumps(text)}")
    cdp.eval("document.getElementById('send').click()")
    t0 = time.time()
    while cdp.eval("document.querySelectorAll('.msg.assistant').length") == n or cdp.eval(
        "!!document.querySelector('.msg.assistant.streaming')"
    ):
        assert time.time() - t0 < timeout, "the reply did not finish"
        time.sleep(0.05)
    return cdp.eval("[...document.querySelectorAll('.msg.assistant')].pop().textContent")


def test_browser_chat(server, tmp_path):
    with browser_page(server["url"], tmp_path, "tiny") as cdp:
        t0 = time.time()
        assert cdp.eval("document.getElementById('maxtokens').value") == "64"  # the server's limit (-m)
        assert cdp.eval("document.getElementById('keylabel').offsetParent") is None  # no --api-key: no key field
        cdp.eval("document.getElementById('temperature').value = '1.0'")
        cdp.eval("document.getElementById('input').value = 'Hello there'")
        cdp.eval("document.getElementById('send').click()")
        text = ""
        while time.time() - t0 < 40:
            text = cdp.eval("(document.querySelector('.msg.assistant') || {}).textContent || ''")
            done = cdp.eval(
                "!document.querySelector('.msg.assistant.streaming') && !!document.querySelector('.msg.assistant')"
            )
            if text and done:
                break
            time.sleep(0.1)
        assert cdp.eval("document.querySelector('.msg.user').textContent") == "Hello there"
        assert text, "no streamed assistant text appeared"
        assert "Error" not in text
        # Stop: freeze the engine so the reply cannot finish first, send, click Stop; the server must cancel it
        engine, stats = server["engine"], server["app"].state.nanorl.stats
        cancelled = stats.cancelled
        with engine.step_lock:
            cdp.eval("document.getElementById('input').value = 'Another one'")
            cdp.eval("document.getElementById('send').click()")
            while not engine.pending:
                assert time.time() - t0 < 40, "the second message never reached the engine"
                time.sleep(0.02)
            cdp.eval("document.getElementById('stop').click()")
            while stats.cancelled == cancelled:
                assert time.time() - t0 < 40, "Stop did not cancel the request on the server"
                time.sleep(0.02)
        assert wait_idle(engine)
        while "[stopped]" not in (cdp.eval("document.querySelectorAll('.msg.assistant')[1].textContent") or ""):
            assert time.time() - t0 < 40
            time.sleep(0.05)
        assert cdp.eval("document.getElementById('send').disabled") is False
        # a conversation that no longer fits: the server leaves out the oldest turns, the page says so and forgets them
        long_turns = json.dumps(
            [{"role": r, "content": f"{r} {i} " + "word " * 40} for i in range(4) for r in ("user", "assistant")]
        )
        cdp.eval(f"conversation = {long_turns}; bubbles = conversation.map(m => bubble(m.role, m.content))")
        cdp.eval("document.getElementById('input').value = 'And now?'")
        cdp.eval("document.getElementById('send').click()")
        while not cdp.eval(
            "!!document.querySelector('.notice') && !document.querySelector('.msg.assistant.streaming')"
        ):
            assert time.time() - t0 < 40, "no notice about the left-out turns"
            time.sleep(0.05)
        assert "no longer fit the model's 256-token context" in cdp.eval(
            "document.querySelector('.notice').textContent"
        )
        dropped = cdp.eval("document.querySelectorAll('.msg.dropped').length")
        assert dropped >= 2 and cdp.eval("conversation.length") == 8 - dropped + 2
        assert cdp.eval("conversation[conversation.length - 2].content") == "And now?"
        shot = base64.b64decode(cdp.call("Page.captureScreenshot", format="png")["data"])
        assert shot[:8] == b"\x89PNG\r\n\x1a\n"
        out = Path(os.environ.get("NANORL_SCREENSHOT_DIR", tmp_path))
        out.mkdir(parents=True, exist_ok=True)
        (out / "chat_web.png").write_bytes(shot)


def test_browser_keeps_history_on_a_small_context(server, tmp_path):
    """A server allowing replies of 512 tokens on a 256-token model (the speedrun's): the page starts at 512 and
    keeps a quarter of the context for the reply when it fits the conversation, so short turns keep their history (no
    notice, nothing greyed out); when turns really no longer fit, one notice counts all that was left out."""
    from nanorl.engine import Engine
    from nanorl.openai_api import ServeConfig
    from scripts.chat_web import create_app

    app = create_app(
        [Engine(server["model"], server["tokenizer"], batch_size=2)],
        server["tokenizer"],
        ServeConfig(max_tokens=512, model="small"),
    )
    with serve(app) as url, browser_page(url, tmp_path, "small") as cdp:
        # it starts at the server's limit, as chat_cli's -m: a reply runs on while the context has room
        assert cdp.eval("document.getElementById('maxtokens').value") == "512"
        assert cdp.eval("document.getElementById('maxtokens').max") == "512"
        # the random model never ends a reply by itself: short replies keep each turn short enough to fit
        cdp.eval("document.getElementById('maxtokens').value = '64'")
        cdp.eval("document.getElementById('temperature').value = '0'")
        for text in ("Hi", "What did I ask you first?"):
            page_send(cdp, text)
        conv = json.loads(cdp.eval("JSON.stringify(conversation)"))
        assert len(conv) == 4 and conv[0]["content"] == "Hi"  # the second request carried the first turn
        assert cdp.eval("document.querySelectorAll('.notice, .msg.dropped').length") == 0
        # (the random model's replies re-tokenise longer than they were generated: a third turn might not fit)
        assert len(server["tokenizer"].render_for_completion({"messages": conv[:3]})) + 64 <= 256
        # long turns: the oldest go, twice, and one notice counts them all
        for i in range(2):
            turns = json.dumps([{"role": r, "content": f"{r} {i} " + "word " * 40} for r in ("user", "assistant")] * 2)
            cdp.eval(f"{turns}.forEach(m => {{ conversation.push(m); bubbles.push(bubble(m.role, m.content)); }})")
            page_send(cdp, f"And now {i}?")
        dropped = cdp.eval("document.querySelectorAll('.msg.dropped').length")
        assert dropped >= 4 and cdp.eval("document.querySelectorAll('.notice').length") == 1
        assert cdp.eval("conversation.length") == 4 + 2 * 6 - dropped  # each round: 4 long, a question, a reply
        assert cdp.eval("document.querySelector('.notice').textContent").startswith(f"{dropped} earliest messages")


# --- the official openai client -------------------------------------------------------------------


def test_openai_client(server):
    """The real `openai` package against the server: everything a client of an OpenAI-compatible server uses."""
    import openai
    import torch

    client = openai.OpenAI(base_url=server["url"] + "/v1", api_key="none", max_retries=0, timeout=30)
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-4o")
    with pytest.raises(openai.NotFoundError, match="model_not_found|does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=user())
    # the trap: a base_url without /v1 gets an error, never the page's raw stream
    with pytest.raises(openai.NotFoundError, match="/v1"):
        openai.OpenAI(base_url=server["url"], api_key="none", max_retries=0).chat.completions.create(
            model="tiny", messages=user()
        )

    # n, seed, max_completion_tokens
    r = client.chat.completions.create(model="tiny", messages=user(), n=3, seed=7, max_completion_tokens=9)
    assert len(r.choices) == 3 and r.usage.completion_tokens <= 27
    for c in r.choices:
        assert c.finish_reason in ("stop", "length") and c.logprobs is None
    again = client.chat.completions.create(model="tiny", messages=user(), n=3, seed=7, max_completion_tokens=9)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    # max_completion_tokens binds: greedy, the first 3 tokens of the longer reply, ended by "length"
    short = client.chat.completions.create(
        model="tiny", messages=user(), seed=1, max_completion_tokens=3, temperature=0
    )
    long = client.chat.completions.create(model="tiny", messages=user(), seed=1, max_tokens=40, temperature=0)
    assert (
        long.usage.completion_tokens > 3
    )  # the tiny model does not stop that early (else the next lines test nothing)
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"
    assert long.choices[0].message.content.startswith(short.choices[0].message.content)

    # stop strings
    text = long.choices[0].message.content
    assert len(text) >= 6
    cut = client.chat.completions.create(model="tiny", messages=user(), max_tokens=40, temperature=0, stop=[text[3:6]])
    assert cut.choices[0].message.content == text[: text.find(text[3:6])] and cut.choices[0].finish_reason == "stop"

    # developer is OpenAI's newer name for system
    sys_msg = [{"role": "system", "content": "Be brief."}] + user()
    dev_msg = [{"role": "developer", "content": "Be brief."}] + user()
    a = client.chat.completions.create(model="tiny", messages=sys_msg, max_tokens=12, temperature=0)
    b = client.chat.completions.create(model="tiny", messages=dev_msg, max_tokens=12, temperature=0)
    assert (
        a.choices[0].message.content == b.choices[0].message.content and a.usage.prompt_tokens == b.usage.prompt_tokens
    )

    # streaming with the usage chunk: the same text as non-streaming, usage last with no choices
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=user(),
            max_tokens=40,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == long.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == long.usage.prompt_tokens and all(c.usage is None for c in chunks[:-1])
    plain = list(client.chat.completions.create(model="tiny", messages=user(), max_tokens=5, stream=True))
    assert all(c.usage is None for c in plain) and plain[-1].choices[0].finish_reason in ("stop", "length")

    # logprobs and top_logprobs against a forward of the model itself
    r = client.chat.completions.create(
        model="tiny", messages=user(), max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) >= 4
    tok, model = server["tokenizer"], server["model"]
    by_bytes = {tok.enc.decode_single_token_bytes(i): i for i in range(tok.vocab_size)}
    ids = [by_bytes[bytes(e.bytes)] for e in content]
    assert tok.decode(ids) == r.choices[0].message.content  # greedy text with no tool calls: the tokens are the text
    assert len(content) == r.usage.completion_tokens - (
        r.choices[0].finish_reason == "stop"
    )  # the stop token is not listed
    prompt = tok.render_for_completion({"messages": user()})
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt + ids]))[0, len(prompt) - 1 : -1].float(), -1)
    for t, (e, row) in enumerate(zip(content, ref)):
        assert abs(e.logprob - row[ids[t]].item()) < 1e-4
        top = row.topk(3)
        assert [by_bytes[bytes(x.bytes)] for x in e.top_logprobs] == top.indices.tolist()
        assert all(abs(x.logprob - v) < 1e-4 for x, v in zip(e.top_logprobs, top.values.tolist()))
        assert e.top_logprobs[0].token == e.token  # greedy: the sampled token is the most likely one
    # streamed: the same log-probs, with the sample's finish_reason
    streamed = [
        c
        for c in client.chat.completions.create(
            model="tiny", messages=user(), max_tokens=8, temperature=0, logprobs=True, top_logprobs=3, stream=True
        )
        if c.choices and c.choices[0].logprobs
    ]
    assert len(streamed) == 1 and streamed[0].choices[0].finish_reason == r.choices[0].finish_reason
    assert [(e.token, round(e.logprob, 5)) for e in streamed[0].choices[0].logprobs.content] == [
        (e.token, round(e.logprob, 5)) for e in content
    ]
    just = client.chat.completions.create(model="tiny", messages=user(), max_tokens=8, temperature=0, logprobs=True)
    assert [e.top_logprobs for e in just.choices[0].logprobs.content] == [[]] * len(content)

    # a field this server does not implement: 400 naming it, not silently ignored
    with pytest.raises(openai.BadRequestError, match="response_format") as e:
        client.chat.completions.create(model="tiny", messages=user(), response_format={"type": "json_object"})
    assert e.value.body["param"] == "response_format" and e.value.body["code"] == "unsupported_parameter"
    # function calling needs a chat template that renders tools: nanorl's own format has none (tests/test_agents.py
    # has a Qwen-style one)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    with pytest.raises(openai.BadRequestError, match="this model's chat format has no function calling") as e:
        client.chat.completions.create(model="tiny", messages=user(), tools=tools)
    assert e.value.body["param"] == "tools" and e.value.body["code"] == "tools_not_supported"


def test_openai_client_habits(server):
    """What OpenAI and vLLM accept, through the real `openai` client: messages[].name, consecutive messages of one
    role, content as a list of text parts, top_k -1; an image part is a 400 naming the part; a lone surrogate is a
    400, not a 500."""
    import openai

    client = openai.OpenAI(base_url=server["url"] + "/v1", api_key="none", max_retries=0, timeout=30)

    def chat(messages, **kw):
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0, **kw)
        return r.choices[0].message.content, r.usage.prompt_tokens

    plain = chat([{"role": "user", "content": "hello"}])
    # a speaker name: accepted; nanorl's chat format has no place for it, so the prompt is the same
    assert chat([{"role": "user", "content": "hello", "name": "ada"}]) == plain
    # text parts join into the text
    assert (
        chat([{"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]}]) == plain
    )
    # consecutive messages of one role become one, joined by a blank line (system and developer are one role)
    merged = chat(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "developer", "content": "Be kind."},
            {"role": "user", "content": "hi"},
            {"role": "user", "content": "there"},
        ]
    )
    assert merged == chat(
        [{"role": "system", "content": "Be brief.\n\nBe kind."}, {"role": "user", "content": "hi\n\nthere"}]
    )
    tok = server["tokenizer"]
    want = tok.render_for_completion(
        {
            "messages": [
                {"role": "system", "content": "Be brief.\n\nBe kind."},
                {"role": "user", "content": "hi\n\nthere"},
            ]
        }
    )
    assert merged[1] == len(want)
    two = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "assistant", "content": "c"},
        {"role": "user", "content": "d"},
    ]
    assert chat(two) == chat(
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b\n\nc"}, {"role": "user", "content": "d"}]
    )
    # top_k -1 is "no top-k": the same sample as sending none
    sample = lambda **kw: (
        client.chat.completions.create(model="tiny", messages=user(), max_tokens=12, temperature=1.0, seed=5, **kw)
        .choices[0]
        .message.content
    )
    assert sample(extra_body={"top_k": -1}) == sample()
    with pytest.raises(openai.BadRequestError, match="top_k") as e:
        sample(extra_body={"top_k": 0})
    assert e.value.body["code"] == "invalid_value"
    # an image part: a 400 naming the part
    with pytest.raises(openai.BadRequestError, match="part 1 has type 'image_url': this model reads text only") as e:
        client.chat.completions.create(
            model="tiny",
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this?"},
                        {"type": "image_url", "image_url": {"url": "data:,"}},
                    ],
                }
            ],
        )
    assert e.value.body["param"] == "messages" and e.value.body["code"] == "invalid_value"
    # a lone surrogate, in a content or in a key: 400 naming where (the client's own JSON encoder cannot send one)
    url = server["url"] + "/v1/chat/completions"
    for body, where in [
        ('{"messages": [{"role": "user", "content": "hi \\ud800"}]}', "'messages.0.content': character 3"),
        ('{"messages": [{"role": "user", "content": "hi"}], "\\udc00x": 1}', "'\\udc00x': character 0"),
    ]:
        r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_unicode", r.text
        assert r.json()["error"]["message"].startswith(where + " is a lone surrogate"), r.text


def greedy_ids(model, ids, n, stop):
    """The model's own greedy continuation of ids, n tokens or up to stop: the reference the engine must match."""
    import torch

    out = []
    with torch.no_grad():
        for _ in range(n):
            t = int(model(torch.tensor([ids + out]))[0, -1].argmax())
            if t == stop:
                break
            out.append(t)
    return out


def test_text_completions(server):
    """/v1/completions through the real `openai` client: a document's continuation (from <|bos|>, up to the next),
    greedy = the model's own argmax tokens; token-id prompts, streaming with usage, n, stop, legacy logprobs."""
    import openai
    import torch

    client = openai.OpenAI(base_url=server["url"] + "/v1", api_key="none", max_retries=0, timeout=30)
    tok, model = server["tokenizer"], server["model"]
    ids = tok.encode("The sky is", prepend="<|bos|>")
    ref = greedy_ids(model, ids, 10, tok.get_bos_token_id())
    from nanorl.tokenizer import SPECIAL_TOKENS

    assert len(ref) == 10 and all(t < tok.vocab_size - len(SPECIAL_TOKENS) for t in ref)  # no special tokens
    r = client.completions.create(model="tiny", prompt="The sky is", max_tokens=10, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == "tiny"
    assert r.choices[0].text == tok.decode(ref) and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 10)
    assert (
        client.completions.create(model="tiny", prompt=ids, max_tokens=10, temperature=0).choices[0].text
        == r.choices[0].text
    )  # token ids are taken as they are
    assert (
        client.completions.create(model="tiny", prompt=[ids], max_tokens=10, temperature=0).choices[0].text
        == r.choices[0].text
    )
    d = client.completions.create(model="tiny", prompt="The sky is", temperature=0)  # OpenAI's default: 16 tokens
    assert d.usage.completion_tokens == 16 and d.choices[0].text.startswith(r.choices[0].text)
    # streaming, with the usage chunk last
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt="The sky is",
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    # n samples with a seed, reproducible; a stop string
    two = client.completions.create(model="tiny", prompt="Hi", max_tokens=6, n=2, seed=3)
    assert [c.index for c in two.choices] == [0, 1]
    assert [
        c.text for c in client.completions.create(model="tiny", prompt="Hi", max_tokens=6, n=2, seed=3).choices
    ] == [c.text for c in two.choices]
    text = r.choices[0].text
    cut = client.completions.create(model="tiny", prompt="The sky is", max_tokens=10, temperature=0, stop=text[3:5])
    assert cut.choices[0].text == text[: text.find(text[3:5])] and cut.choices[0].finish_reason == "stop"
    # the legacy API's logprobs against a forward of the model
    lp = client.completions.create(model="tiny", prompt="The sky is", max_tokens=4, temperature=0, logprobs=2)
    got = lp.choices[0].logprobs
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([ids + ref[:4]]))[0, len(ids) - 1 : -1].float(), -1)
    assert "".join(got.tokens) == lp.choices[0].text and got.text_offset[0] == 0
    assert got.text_offset == [sum(len(t) for t in got.tokens[:i]) for i in range(4)]
    for t, row in enumerate(want):
        assert abs(got.token_logprobs[t] - row[ref[t]].item()) < 1e-4
        top = row.topk(2)
        assert list(got.top_logprobs[t].values()) == pytest.approx(top.values.tolist(), abs=1e-4)
    # what it refuses, each with its own error
    for kw, cls, fragment in [
        (dict(prompt=["a", "b"]), openai.BadRequestError, "one prompt per request (got 2)"),
        (dict(prompt=[1, 10**6]), openai.BadRequestError, "token 1000000 at 1 is not in"),
        (dict(prompt="hi", max_tokens=65), openai.BadRequestError, "'max_tokens' must be <= 64"),
        (dict(prompt="word " * 1500), openai.BadRequestError, "over the context of 256"),
        (dict(prompt="hi", echo=True), openai.BadRequestError, "unsupported parameter 'echo'"),
        (dict(prompt="hi", model="gpt-4o"), openai.NotFoundError, "does not exist"),
    ]:
        with pytest.raises(cls, match=re.escape(fragment)) as e:
            client.completions.create(**{"model": "tiny", **kw})
        assert e.value.body["code"]


def test_tokenize_detokenize(server):
    url, tok = server["url"], server["tokenizer"]
    ids = tok.encode("The sky is", prepend="<|bos|>")
    assert httpx.post(url + "/tokenize", json={"prompt": "The sky is"}).json() == {
        "tokens": ids,
        "count": len(ids),
        "max_model_len": 256,
    }
    assert (
        httpx.post(url + "/tokenize", json={"prompt": "The sky is", "add_special_tokens": False}).json()["tokens"]
        == ids[1:]
    )
    # messages: the prompt the chat endpoint generates from (its usage.prompt_tokens), even over the context
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    got = httpx.post(url + "/tokenize", json={"messages": conv}).json()
    assert got["tokens"] == tok.render_for_completion({"messages": conv})
    chat = httpx.post(url + "/v1/chat/completions", json={"messages": conv, "max_tokens": 2}).json()
    assert chat["usage"]["prompt_tokens"] == got["count"]
    assert httpx.post(url + "/tokenize", json={"prompt": "word " * 1500}).json()["count"] > 256
    assert httpx.post(url + "/detokenize", json={"tokens": ids[1:]}).json() == {"prompt": "The sky is"}
    for path, body, fragment in [
        ("/tokenize", {}, "either 'prompt' or 'messages'"),
        ("/tokenize", {"prompt": "a", "messages": conv}, "either 'prompt' or 'messages'"),
        ("/detokenize", {"tokens": [5, -1]}, "'tokens': token -1 at 1 is not in"),
        ("/detokenize", {"tokens": "abc"}, "'tokens'"),
    ]:
        r = httpx.post(url + path, json=body)
        assert r.status_code == 400 and fragment in r.json()["error"]["message"] and r.json()["error"]["code"], r.text


def test_metrics_version_and_a_log_line_per_request(server, caplog):
    """/metrics in Prometheus' text format (read by prometheus_client's own parser) counts what was served; every
    request logs one line with its id (the x-request-id header), status, tokens in/out and time."""
    import logging

    from prometheus_client.parser import text_string_to_metric_families

    from nanorl.engine import Engine
    from nanorl.openai_api import ServeConfig
    from scripts.chat_web import create_app

    caplog.set_level(logging.INFO, logger="nanorl.serve")
    app = create_app(
        [Engine(server["model"], server["tokenizer"], batch_size=2)],
        server["tokenizer"],
        ServeConfig(max_tokens=16, model="m"),
    )
    with serve(app) as url:
        chat = httpx.post(url + "/v1/chat/completions", json={"messages": user(), "max_tokens": 5}, timeout=30)
        body = {"messages": user("x"), "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", url + "/v1/chat/completions", timeout=30, json=body) as r:
            streamed = json.loads(sse_data(r.read().decode())[-2])["usage"]
        text = httpx.post(url + "/v1/completions", json={"prompt": "The", "max_tokens": 3}, timeout=30)
        bad = httpx.post(url + "/v1/chat/completions", json={"messages": []}, timeout=30)
        missing = httpx.get(url + "/nope")
        version = httpx.get(url + "/version").json()
        r = httpx.get(url + "/metrics")
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(r.text)
        for s in fam.samples
    }
    route = lambda path, status: ("nanorl_http_requests_total", (("route", path), ("status", status)))  # noqa: E731
    assert samples[route("/v1/chat/completions", "200")] == 2 and samples[route("/v1/chat/completions", "400")] == 1
    assert samples[route("/v1/completions", "200")] == 1 and samples[route("other", "404")] == 1
    assert samples[route("/version", "200")] == 1
    usages = [chat.json()["usage"], streamed, text.json()["usage"]]
    assert samples[("nanorl_prompt_tokens_total", ())] == sum(u["prompt_tokens"] for u in usages)
    assert samples[("nanorl_generation_tokens_total", ())] == sum(u["completion_tokens"] for u in usages)
    assert samples[("nanorl_queue_length", ())] == 0 and samples[("nanorl_samples_running", ())] == 0
    ttft = {dict(k[1])["le"]: v for k, v in samples.items() if k[0] == "nanorl_time_to_first_token_seconds_bucket"}
    assert ttft["+Inf"] == 3 == samples[("nanorl_time_to_first_token_seconds_count", ())]
    counts = list(ttft.values())
    assert counts == sorted(counts) and samples[("nanorl_time_to_first_token_seconds_sum", ())] > 0
    assert samples[("nanorl_request_duration_seconds_count", ())] == 6  # all but /metrics itself
    assert version["version"] == "0.1.0" and version["model"] == "m"
    # one log line per request: id, method, path, status, tokens in/out, time to first token, time
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "nanorl.serve"]
    assert len(lines) == 7, lines
    rid = chat.headers["x-request-id"]
    assert chat.json()["id"] == f"chatcmpl-{rid}"
    line = next(x for x in lines if x.startswith(rid))
    u = chat.json()["usage"]
    assert re.fullmatch(
        rf"{rid} POST /v1/chat/completions 200 in={u['prompt_tokens']} "
        rf"out={u['completion_tokens']} ttft=\d+\.\d{{3}}s \d+\.\d{{3}}s",
        line,
    ), line
    assert any(x.startswith(bad.headers["x-request-id"] + " POST /v1/chat/completions 400 ") for x in lines)
    assert any(x.startswith(missing.headers["x-request-id"] + " GET /nope 404 ") for x in lines)


def test_histogram_counts_by_hand():
    from nanorl.serving import Histogram

    h = Histogram([0.01, 0.1, 1])
    for x in (0.005, 0.01, 0.03, 0.3, 50):
        h.observe(x)
    # cumulative, as Prometheus' buckets are: <= 0.01: 2, <= 0.1: 3, <= 1: 4; +Inf is the count
    assert h.counts == [2, 3, 4] and h.count == 5 and h.sum == pytest.approx(50.345)


def test_api_key(server, tmp_path):
    """--api-key: the API and the page's stream need the bearer key; the page, /health, /metrics and /version
    do not. The page shows a key field and sends what is typed there."""
    import openai

    from nanorl.engine import Engine
    from nanorl.openai_api import ServeConfig
    from scripts.chat_web import create_app

    app = create_app(
        [Engine(server["model"], server["tokenizer"], batch_size=2)],
        server["tokenizer"],
        ServeConfig(max_tokens=8, model="k", api_key="sekret"),
    )
    with serve(app) as url:
        with pytest.raises(openai.AuthenticationError, match="API key") as e:
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
        client = openai.OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0, timeout=30)
        assert [m.id for m in client.models.list()] == ["k"]
        assert (
            client.chat.completions.create(model="k", messages=user(), max_tokens=2).choices[0].message.role
            == "assistant"
        )
        assert client.completions.create(model="k", prompt="a", max_tokens=2).usage.completion_tokens >= 1
        for path in ("/ui/chat", "/tokenize", "/detokenize", "/v1/chat/completions"):
            r = httpx.post(url + path, json={"messages": user()})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
        ok = httpx.post(
            url + "/ui/chat",
            json={"messages": user(), "max_tokens": 2},
            headers={"Authorization": "Bearer sekret"},
            timeout=30,
        )
        assert ok.status_code == 200 and sse_data(ok.text)[-1] == "[DONE]"
        for path in ("/", "/health", "/metrics", "/version"):
            assert httpx.get(url + path).status_code == 200, path
        assert httpx.get(url + "/ui/info").json()["api_key"] is True
        with browser_page(url, tmp_path, "k") as cdp:
            assert cdp.eval("document.getElementById('keylabel').offsetParent !== null")  # shown
            page_send(cdp, "hi")
            assert "API key" in cdp.eval("document.querySelector('.msg.assistant .error').textContent")
            cdp.eval("document.getElementById('apikey').value = 'sekret'")
            reply = page_send(cdp, "hi again")
            assert reply and "Error" not in reply and cdp.eval("conversation.length") == 2
    assert httpx.get(server["url"] + "/ui/info").json()["api_key"] is False


# --- hardening: slow clients, big conversations, a failing request --------------------------------


def _port(url):
    return int(url.rsplit(":", 1)[1])


def _read_until_closed(s, limit):
    """Everything the server sends until it closes the connection -> (bytes, seconds); fails after limit seconds."""
    s.settimeout(limit)
    t0, data = time.time(), b""
    while True:
        chunk = s.recv(4096)
        if not chunk:
            return data, time.time() - t0
        data += chunk


def test_slow_clients_are_cut_off(server):
    """A client that trickles its headers or its body gets a 408 and is disconnected at the deadline (1 s here)."""
    from nanorl.engine import Engine
    from nanorl.openai_api import ServeConfig
    from scripts.chat_web import create_app

    engine = Engine(server["model"], server["tokenizer"], batch_size=2)
    app = create_app([engine], server["tokenizer"], ServeConfig(max_tokens=8, body_timeout=1.0))
    with serve(app, header_timeout=1.0) as url:
        port = _port(url)
        idle = socket.create_connection(("127.0.0.1", port))  # connects and says nothing
        headers = socket.create_connection(("127.0.0.1", port))
        headers.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # never finishes its headers
        body = socket.create_connection(("127.0.0.1", port))
        body.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"messages"'
        )  # 11 of 100 bytes, then a byte every 0.3 s

        def trickle():
            for _ in range(20):
                time.sleep(0.3)
                try:
                    body.sendall(b" ")
                except OSError:
                    return

        threading.Thread(target=trickle, daemon=True).start()
        t0 = time.time()
        assert httpx.get(url + "/health", timeout=5).json()["status"] == "ok"  # others are served meanwhile
        for s, what in ((idle, "headers"), (headers, "headers"), (body, "body")):
            data, _ = _read_until_closed(s, 5)
            assert data.startswith(b"HTTP/1.1 408 "), data
            err = json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]
            assert f"the request {what} did not arrive within 1s" in err["message"] and err["code"] == "request_timeout"
            s.close()
        assert time.time() - t0 < 2.5, "a deadline of 1 s took longer"
        # a kept-alive connection that starts a second request and stalls is cut off too
        ka = socket.create_connection(("127.0.0.1", port))
        ka.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        ka.settimeout(5)
        first = b""
        while not first.endswith(b'"replicas":1}'):
            first += ka.recv(4096)
        assert b"200 OK" in first
        ka.sendall(b"GET /health HTTP/1.1\r\n")
        data, took = _read_until_closed(ka, 5)
        assert data.startswith(b"HTTP/1.1 408 ") and took < 2.5
        # a prompt client on a 1 s deadline is not affected
        r = httpx.post(url + "/v1/chat/completions", json={"messages": user(), "max_tokens": 4}, timeout=10)
        assert r.status_code == 200
        # nor is one the server takes longer than the deadline to answer (the deadline is off while the app has it),
        # and its kept-alive connection is timed again afterwards
        with httpx.Client(timeout=10) as c:
            with engine.step_lock:
                slow = threading.Thread(
                    target=lambda: results.append(
                        c.post(url + "/v1/chat/completions", json={"messages": user(), "max_tokens": 4})
                    )
                )
                results = []
                slow.start()
                time.sleep(1.6)
            slow.join(10)
            assert results[0].status_code == 200 and results[0].json()["choices"][0]["message"]["role"] == "assistant"
            assert c.get(url + "/health").status_code == 200  # the same connection, kept alive


class BlockingTokenizer:
    """The test tokenizer, but rendering a conversation waits until the test releases it (as a 4 MB one takes long):
    a handler that tokenised on the event loop would stall every other client until then. `entered` is set once a
    rendering is under way; `calls` counts them."""

    def __init__(self, tok):
        self.tok, self.calls = tok, 0
        self.entered, self.release = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def render_for_completion(self, conversation):
        self.calls += 1
        self.entered.set()
        assert self.release.wait(30), "the test never released the tokenizer"
        return self.tok.render_for_completion(conversation)


def test_tokenising_does_not_block_the_server(server):
    """No clock: while a conversation's tokenisation is held mid-way, /health still answers (on the event loop it
    could not until the release); and a conversation far over the context is refused without tokenising it."""
    from nanorl.engine import Engine
    from nanorl.openai_api import ServeConfig
    from scripts.chat_web import create_app

    slow = BlockingTokenizer(server["tokenizer"])
    app = create_app([Engine(server["model"], server["tokenizer"], batch_size=4)], slow, ServeConfig(max_tokens=4))
    with serve(app) as url:
        done = []
        posts = httpx.Client(timeout=60)
        threads = [
            threading.Thread(
                target=lambda: done.append(
                    posts.post(url + "/v1/chat/completions", json={"messages": user(), "max_tokens": 2}).status_code
                )
            )
            for _ in range(4)
        ]
        for t in threads:
            t.start()
        assert slow.entered.wait(30), "no conversation reached the tokenizer"
        # a tokenizer held on the event loop would hold /health too: the request would time out, not answer
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        slow.release.set()
        for t in threads:
            t.join(60)
        assert done == [200] * 4 and slow.calls == 4
        # a conversation far over the context is refused from its size alone, before the tokenizer runs
        huge = [{"role": r, "content": "x" * 8000} for _ in range(50) for r in ("user", "assistant")] + user()
        r = httpx.post(url + "/v1/chat/completions", json={"messages": huge}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert slow.calls == 4, "the tokenizer ran on a conversation that cannot fit"


def test_an_engine_failure_ends_only_its_request(server):
    """A sample the engine ends with status "error" fails that request alone (500 / an error event); the next ones
    and the one beside it are served."""
    engine, url = server["engine"], server["url"] + "/v1/chat/completions"
    results = {}

    def post(name, body):
        results[name] = httpx.post(url, json=body, timeout=30)

    def stream(name, body):
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=30) as r:
            results[name] = sse_data(r.read().decode())

    with engine.step_lock:  # frozen: both requests queue, then one of them is failed the way the engine fails one
        threads = [
            threading.Thread(target=post, args=("bad", {"messages": user("one"), "max_tokens": 8})),
            threading.Thread(target=post, args=("good", {"messages": user("two"), "max_tokens": 8, "seed": 3})),
        ]
        for t in threads:
            t.start()
            t0 = time.time()
            while len(engine.pending) < len(threads[: threads.index(t) + 1]):
                assert time.time() - t0 < 10
                time.sleep(0.01)
        engine.pending[0].handle.events.put({"sample": 0, "status": "error", "completion": None})
        ts = threading.Thread(target=stream, args=("bad_stream", {"messages": user("three"), "max_tokens": 8}))
        ts.start()
        while len(engine.pending) < 3:
            assert time.time() - t0 < 10
            time.sleep(0.01)
        engine.pending[2].handle.events.put({"sample": 0, "status": "error", "completion": None})
    for t in threads + [ts]:
        t.join(30)
    assert results["bad"].status_code == 500
    assert results["bad"].json()["error"] == {
        "message": "the engine failed while generating this request",
        "type": "server_error",
        "param": None,
        "code": "engine_error",
    }
    assert results["good"].status_code == 200 and results["good"].json()["choices"][0]["finish_reason"] in (
        "stop",
        "length",
    )
    assert (
        json.loads(results["bad_stream"][-2])["error"]["type"] == "server_error"
        and results["bad_stream"][-1] == "[DONE]"
    )
    assert json.loads(results["bad_stream"][-2])["error"]["code"] == "engine_error"
    assert wait_idle(engine)
    again = httpx.post(url, json={"messages": user("two"), "max_tokens": 8, "seed": 3}, timeout=30)
    assert again.json()["choices"] == results["good"].json()["choices"]


def test_page_drops_the_oldest_turns_to_fit(server):
    """After long replies the page's request leaves out the fewest oldest turns that make room for max_tokens."""
    tok = server["tokenizer"]
    conv = []
    for i in range(6):
        conv += [
            {"role": "user", "content": f"question {i} " + "word " * 15},
            {"role": "assistant", "content": [{"type": "text", "text": f"answer {i} " + "more " * 15}]},
        ]
    conv += user("the last question")
    length = lambda drop: len(tok.render_for_completion({"messages": conv[drop:]}))
    assert length(0) + 64 > 256 and length(len(conv) - 1) + 64 <= 256  # the test needs some, not all, to go
    want = next(d for d in range(0, len(conv), 2) if length(d) + 64 <= 256)  # the fewest pairs, by brute force
    r = httpx.post(server["url"] + "/ui/chat", json={"messages": conv, "max_tokens": 64, "temperature": 0}, timeout=30)
    first = json.loads(sse_data(r.text)[0])
    assert first == {"prompt_tokens": length(want), "dropped": want, "context": 256} and want >= 2
    # the API refuses instead: a client of the OpenAI API decides what to leave out
    r = httpx.post(
        server["url"] + "/v1/chat/completions", json={"messages": conv[:-1] * 3 + user(), "max_tokens": 64}, timeout=30
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_page_replies_run_to_the_context_and_keep_the_history_that_fits(server):
    """The page's default max tokens is the server's limit (512 on a 256-token model, as the speedrun's chat_web): the
    earlier turns that fit beside a quarter of the context stay in the prompt, and the reply runs to the context's
    end, not to a quarter of it (the random model never ends a reply by itself)."""
    from nanorl.engine import Engine
    from nanorl.openai_api import ServeConfig
    from scripts.chat_web import create_app

    tok = server["tokenizer"]
    app = create_app([Engine(server["model"], tok, batch_size=2)], tok, ServeConfig(max_tokens=512, model="small"))
    conv = [
        {"role": "user", "content": "question " + "word " * 20},
        {"role": "assistant", "content": "answer " + "more " * 20},
        *user("and then?"),
    ]
    prompt = len(tok.render_for_completion({"messages": conv}))
    assert prompt + 64 <= 256
    with serve(app) as url:
        info = httpx.get(url + "/ui/info").json()
        assert info["max_tokens"] == 512 and info["context_length"] == 256
        r = httpx.post(url + "/ui/chat", json={"messages": conv, "max_tokens": 512, "temperature": 0}, timeout=60)
    events = [json.loads(x) for x in sse_data(r.text)[:-1]]
    assert events[0] == {"prompt_tokens": prompt, "dropped": 0, "context": 256}
    text = "".join(e["token"] for e in events if "token" in e)
    assert events[-1]["finish_reason"] == "length" and len(tok.encode(text)) > 64


def test_p_is_never_the_port_and_a_bad_role_lists_the_roles_that_work(monkeypatch, capsys):
    """chat_web -p "..." (chat_cli's one-shot prompt) is one line saying where the prompt goes and what the port flag
    is; a request with role 'bot' lists the roles the server takes ('tool' among them: it answers a function call,
    and a model whose chat format has no function calling refuses it saying so)."""
    from nanorl.openai_api import BadRequest, ChatRequest, parse_body
    from scripts.chat_web import main

    monkeypatch.setattr(sys, "argv", ["chat_web", "-i", "rl", "-p", "What is 2+2?"])
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "takes no prompt (the port is --port)" in err and "python -m scripts.chat_cli -i rl -p" in err
    with pytest.raises(BadRequest) as e:
        parse_body(json.dumps({"messages": [{"role": "bot", "content": "hi"}]}).encode(), ChatRequest)
    assert str(e.value) == "'messages.0.role': Input should be 'system', 'developer', 'user', 'assistant' or 'tool'"
    # 'tool' answers a function call: a model whose chat format has none refuses it saying so (MALFORMED above)
    with pytest.raises(BadRequest, match="a tool message needs the tool_call_id of the call it answers"):
        parse_body(json.dumps({"messages": [{"role": "tool", "content": "5"}]}).encode(), ChatRequest)


def test_browser_a_refused_message_is_marked_not_sent(server, tmp_path):
    """A message the server refuses (too long) is marked "not sent" on the page, left out of the conversation, and
    its text is back in the box to shorten; the next message goes out as usual."""
    with browser_page(server["url"], tmp_path, "tiny") as cdp:
        long = "word " * 2000  # over the 8,000 characters a message may have
        cdp.eval(f"document.getElementById('input').value = {json.dumps(long)}")
        cdp.eval("document.getElementById('send').click()")
        t0 = time.time()
        while not cdp.eval("!!document.querySelector('.msg.assistant .error')"):
            assert time.time() - t0 < 30, "no error shown"
            time.sleep(0.05)
        assert "message is too long" in cdp.eval("document.querySelector('.msg.assistant .error').textContent")
        assert cdp.eval("document.querySelector('.msg.user').classList.contains('unsent')")
        assert cdp.eval("document.getElementById('input').value") == long.strip()
        assert cdp.eval("conversation.length") == 0
        page_send(cdp, "Hello")
        assert cdp.eval("conversation.length") == 2 and cdp.eval("document.querySelectorAll('.msg.unsent').length") == 1


def test_cli_flags(monkeypatch, capsys):
    """chat_web: every flag has help text and --help shows the defaults; out-of-range numbers exit 2 naming the flag."""
    from scripts.chat_web import main

    monkeypatch.setenv("COLUMNS", "300")  # one line per flag's help

    def run(*args):
        monkeypatch.setattr(sys, "argv", ["chat_web", *args])
        with pytest.raises(SystemExit) as e:
            main()
        out = capsys.readouterr()
        return e.value.code, out.out, out.err

    code, out, _ = run("--help")
    assert (
        code == 0
        and "--port PORT" in out
        and "-p " not in out
        and "(default: 8000)" in out
        and "(default: 10.0)" in out
    )
    helps = out.split("options:")[1].split("\n  -")[1:]  # one entry per flag: its names, then its help text
    assert len(helps) >= 14 and all("(default: " in h for h in helps[1:]), helps  # [0] is -h itself
    for args, flag in [
        (("--port", "99999"), "--port"),
        (("--port", "-1"), "--port"),
        (("-b", "0"), "-b/--batch-size"),
        (("-m", "0"), "-m/--max-tokens"),
        (("--header-timeout", "0"), "--header-timeout"),
        (("-n", "x"), "-n/--num-gpus"),
    ]:
        code, _, err = run(*args)
        assert code == 2 and err.splitlines()[-1].startswith(f"chat_web: error: argument {flag}:"), err


def test_port_in_use_is_one_line_and_port_0_is_reported(server):
    """chat_web binds before it loads the model: a taken port ends in one line naming it, at once; --port 0 prints
    the port the system picked, and the server answers there (with the API key $NANORL_API_KEY gave it)."""
    env = {**os.environ, "NANORL_BASE_DIR": str(server["base_dir"]), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "scripts.chat_web", "-i", "sft", "--device-type", "cpu", "-b", "2", "-m", "8"]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(cmd + ["--port", str(port)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and out.stdout == "", out
    assert out.stderr == f"port {port} is in use on 127.0.0.1: stop the server there or pick another --port\n"
    proc = subprocess.Popen(
        cmd + ["--port", "0"],
        cwd=ROOT,
        env={**env, "NANORL_API_KEY": "k3y"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        loaded = proc.stdout.readline()  # model_loading.load_model names what it loaded first
        assert loaded.startswith("loaded sft checkpoint t step 0 from "), loaded
        line = proc.stdout.readline()
        assert line.startswith("serving nanorl-sft-t on 1 replica(s) (cpu) at http://127.0.0.1:"), line
        url = line.split(" at ")[1].split()[0]
        assert not url.endswith(":0")
        t0 = time.time()
        while True:
            try:
                assert httpx.get(url + "/health", timeout=5).json()["status"] == "ok"
                break
            except httpx.ConnectError:  # printed just before uvicorn starts listening
                assert time.time() - t0 < 30 and proc.poll() is None
                time.sleep(0.1)
        assert httpx.get(url + "/v1/models", timeout=5).status_code == 401
        key = {"Authorization": "Bearer k3y"}
        assert httpx.get(url + "/v1/models", headers=key, timeout=5).json()["data"][0]["id"] == "nanorl-sft-t"
    finally:
        proc.terminate()
        proc.wait(30)


# --- chat_cli in a terminal -------------------------------------------------------------------------


def test_chat_cli_line_editing(server):
    """chat_cli in a pseudo-terminal: Ctrl-C at the prompt clears the line (and the CLI stays), the up arrow recalls
    the last message, Ctrl-D leaves, and the history is saved."""
    import pty
    import select

    env = {
        **os.environ,
        "NANORL_BASE_DIR": str(server["base_dir"]),
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "TERM": "xterm",
        "INPUTRC": "/dev/null",
    }
    history = server["base_dir"] / "chat_history"
    pid, fd = pty.fork()
    if pid == 0:  # the child: chat_cli on the terminal (exec at once: the test process has threads)
        os.chdir(ROOT)
        os.execve(
            sys.executable,
            [sys.executable, "-m", "scripts.chat_cli", "-i", "sft", "-t", "0", "-m", "4", "--device-type", "cpu"],
            env,
        )
    seen = b""

    def expect(text, count=1, timeout=60):
        nonlocal seen
        t0 = time.time()
        while seen.count(text) < count:
            assert time.time() - t0 < timeout, seen.decode(errors="replace")
            if select.select([fd], [], [], 0.5)[0]:
                try:
                    seen += os.read(fd, 4096)
                except OSError:  # the child closed the terminal
                    break
        assert seen.count(text) >= count, seen.decode(errors="replace")

    try:
        expect(b"User: ")
        os.write(fd, b"abc")
        expect(b"abc")
        time.sleep(0.5)  # let readline finish redrawing the line before the signal (a busy machine is slow to)
        os.write(fd, b"\x03")  # Ctrl-C: a fresh prompt, the CLI still running
        expect(b"User: ", 2)
        os.write(fd, b"hello\r")
        expect(b"Assistant: ")
        expect(b"User: ", 3)
        os.write(fd, b"\x1b[A")  # the up arrow brings back "hello"
        expect(b"hello", 2)
        os.write(fd, b"\r")
        expect(b"Assistant: ", 2)
        expect(b"User: ", 4)
        os.write(fd, b"\x04")  # Ctrl-D leaves
        t0 = time.time()
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            assert time.time() - t0 < 20, "Ctrl-D did not end chat_cli"
            expect(b"", 0, timeout=1)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
        os.close(fd)
    lines = [line for line in history.read_text().splitlines() if not line.startswith("_HiStOrY")]
    assert lines == ["hello"], lines  # "abc" was cleared, never sent (readline keeps one of two equal lines in a row)
