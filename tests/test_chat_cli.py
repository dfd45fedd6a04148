"""scripts/chat_cli.py: leaving out the oldest turns, messages that cannot fit, the /commands, the banner, and a
long session in a pseudo-terminal on a tiny model."""

import os
import select
import sys
import time
from pathlib import Path

import pytest
import warm_python  # pytest puts tests/ on sys.path

from scripts.chat_cli import TooLong, chat_turn, command, fit_prompt, turns_to_drop

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A trained tokenizer and a 1-layer sft checkpoint 't' at step 7, context 256, in a fresh base dir."""
    d = tmp_path_factory.mktemp("cli")
    env = {**os.environ, "NANORL_BASE_DIR": str(d), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    warm_python.run(
        [sys.executable, "-m", "scripts.tok_train", "--vocab-size", "600", "--max-chars", "300000"],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
    )
    import torch

    from nanorl.checkpoint import save_checkpoint
    from nanorl.gpt import GPTConfig, build_model
    from nanorl.model_loading import checkpoint_root
    from nanorl.tokenizer import get_tokenizer

    old = os.environ.get("NANORL_BASE_DIR")
    os.environ["NANORL_BASE_DIR"] = str(d)
    try:
        tok = get_tokenizer()
        torch.manual_seed(0)
        cfg = GPTConfig(sequence_len=256, vocab_size=tok.vocab_size, n_layer=1, n_head=1, n_kv_head=1, n_embd=32)
        m = build_model(cfg, "cpu")
        with torch.no_grad():
            m.lm_head.weight.normal_(0, 0.2)
        save_checkpoint(checkpoint_root("sft") + "/t", 7, m.state_dict(), meta={"model_config": cfg.to_dict()})
    finally:
        if old is None:
            del os.environ["NANORL_BASE_DIR"]
        else:
            os.environ["NANORL_BASE_DIR"] = old
    return dict(env=env, tokenizer=tok, base_dir=d)


def words(msgs):
    return sum(len(m["content"].split()) for m in msgs)


def test_turns_to_drop_keeps_the_newest_turns_that_fit():
    msgs = [
        {"role": "user", "content": "a b c"},
        {"role": "assistant", "content": "a b c d e"},
        {"role": "user", "content": "a b"},
        {"role": "assistant", "content": "a b c d"},
        {"role": "user", "content": "a b c d e f"},
    ]  # 3 + 5 + 2 + 4 + 6 = 20 words
    assert turns_to_drop(msgs, words, 20) == 0
    assert turns_to_drop(msgs, words, 19) == 1  # the first pair goes: 12 left
    assert turns_to_drop(msgs, words, 12) == 1
    assert turns_to_drop(msgs, words, 11) == 2  # only the last message: 6
    assert turns_to_drop(msgs, words, 6) == 2
    assert turns_to_drop(msgs, words, 5) is None  # the last message alone is over budget
    assert turns_to_drop(msgs[-1:], words, 6) == 0


def test_fit_prompt_leaves_out_pairs_and_names_a_message_too_long(tiny):
    tok = tiny["tokenizer"]
    msgs = [
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "hi, how are you"},
        {"role": "user", "content": "fine thanks"},
        {"role": "assistant", "content": "good"},
        {"role": "user", "content": "what did I say first?"},
    ]
    full = len(tok.render_for_completion({"messages": msgs}))
    two = len(tok.render_for_completion({"messages": msgs[2:]}))
    last = len(tok.render_for_completion({"messages": msgs[4:]}))
    assert full > two > last
    assert fit_prompt(tok, msgs, full + 10, 10)[1] == 0
    ids, pairs = fit_prompt(tok, msgs, full + 9, 10)
    assert pairs == 1 and len(ids) == two
    assert fit_prompt(tok, msgs, two + 9, 10)[1] == 2
    ids, pairs = fit_prompt(tok, msgs, last + 1, 10)  # under the reserve but one token of room: it still goes
    assert pairs == 2 and len(ids) == last
    with pytest.raises(TooLong, match=rf"^this message alone is {last} tokens \(context {last}\)"):
        fit_prompt(tok, msgs, last, 10)


class SpyEngine:
    """Records the request chat_turn makes and answers nothing."""

    max_len = 256

    def __init__(self):
        self.requests = []

    def stream(self, req):
        self.requests.append(req)
        yield from ()


def test_temperature_command_changes_the_sampling_temperature(tiny):
    settings = dict(base=False, temperature=0.6, top_k=50, max_tokens=16, seed=None)
    assert command("/temperature", settings) == "temperature is 0.6"
    assert command("/temperature 1.25", settings) == "temperature is now 1.25"
    assert command("/temperature 3", settings) == "/temperature takes a number from 0 to 2, got '3'"
    assert command("/temperature hot", settings) == "/temperature takes a number from 0 to 2, got 'hot'"
    assert settings["temperature"] == 1.25
    engine = SpyEngine()
    chat_turn(
        engine,
        tiny["tokenizer"],
        {"messages": [{"role": "user", "content": "hi"}]},
        out=open(os.devnull, "w"),
        **settings,
    )
    assert engine.requests[0].temperature == 1.25 and engine.requests[0].max_tokens == 16
    assert command("/clear", settings) == command("clear", settings) == "clear"
    assert command("quit", settings) == command("/quit", settings) == command("exit", settings) == "quit"
    assert command("/frobnicate", settings) == "unknown command /frobnicate: /help lists the commands"
    assert command("what is 2+2?", settings) is None


def test_one_shot_with_an_overlong_prompt_is_one_line_and_fails(tiny):
    prompt = "the cat sat on the mat " * 100
    n = len(tiny["tokenizer"].render_for_completion({"messages": [{"role": "user", "content": prompt}]}))
    assert n > 256
    r = warm_python.run(
        [sys.executable, "-m", "scripts.chat_cli", "-p", prompt, "--device-type", "cpu"],
        cwd=ROOT,
        env=tiny["env"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        f"chat_cli.py: error: this message alone is {n} tokens (context 256): shorten it"
    )


def test_eight_turns_help_and_temperature_in_a_terminal(tiny):
    """chat_cli in a pseudo-terminal on the 256-token model: 8 turns of 40-token replies overflow the context, the
    oldest turns are left out with one notice and no turn is refused; /help and /temperature answer locally."""
    import pty

    env = {**tiny["env"], "TERM": "xterm", "INPUTRC": "/dev/null"}
    pid, fd = pty.fork()
    if pid == 0:  # the child: chat_cli on the terminal (exec at once)
        os.chdir(ROOT)
        os.execve(
            sys.executable,
            [sys.executable, "-m", "scripts.chat_cli", "-i", "sft", "-t", "0", "-m", "40", "--device-type", "cpu"],
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
        assert b"nanorl chat: sft checkpoint 't', step 7 (context 256 tokens)." in seen
        os.write(fd, b"/help\r")
        for name in (b"/help", b"/clear", b"/temperature X", b"/quit"):
            expect(b"  " + name)
        expect(b"User: ", 2)
        for turn in range(8):
            os.write(fd, f"tell me a short story number {turn}\r".encode())
            expect(b"Assistant: ", turn + 1)
            expect(b"User: ", turn + 3)
        os.write(fd, b"/temperature 0.9\r")
        expect(b"temperature is now 0.9")
        os.write(fd, b"/temperature\r")
        expect(b"temperature is 0.9")
        expect(b"User: ", 12)
        os.write(fd, b"\x04")  # Ctrl-D leaves
        t0 = time.time()
        while not os.waitpid(pid, os.WNOHANG)[0]:
            assert time.time() - t0 < 20, "Ctrl-D did not end chat_cli"
            expect(b"", 0, timeout=1)
    finally:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
        os.close(fd)
    text = seen.decode(errors="replace")
    assert text.count("earliest turn") == 1, text  # said once, when the first turn had to go
    assert "alone is" not in text and "type 'clear'" not in text, text  # no turn refused
    assert text.count("Assistant: ") == 8


def test_banner_names_a_hugging_face_directory():
    from argparse import Namespace

    from scripts.chat_cli import loaded_what

    args = Namespace(hf_model="/models/Qwen2.5-0.5B", source="sft", model_step=None)
    assert loaded_what(args, {"model_tag": "Qwen2.5-0.5B"}) == "Hugging Face model /models/Qwen2.5-0.5B"


def test_one_shot_writes_only_the_answer_on_stdout(tiny, monkeypatch):
    """chat_cli -p: stdout is the answer alone (what chat_turn writes for it, greedy), so it can be piped; the
    status lines (which checkpoint, which attention kernels) go to stderr."""
    import io

    from nanorl.engine import Engine
    from nanorl.model_loading import load_model

    r = warm_python.run(
        [sys.executable, "-m", "scripts.chat_cli", "-p", "What is 2+2?", "-t", "0", "-m", "12", "--device-type", "cpu"],
        cwd=ROOT,
        env=tiny["env"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "loaded sft checkpoint t step 7" in r.stderr and "engine attention" in r.stderr
    monkeypatch.setenv("NANORL_BASE_DIR", str(tiny["base_dir"]))
    model, tok, _ = load_model("sft", "cpu")
    out = io.StringIO()
    conv = {"messages": [{"role": "user", "content": "What is 2+2?"}]}
    chat_turn(Engine(model, tok, batch_size=1), tok, conv, temperature=0.0, max_tokens=12, out=out)
    assert r.stdout == out.getvalue() and r.stdout.count("\n") == 1
