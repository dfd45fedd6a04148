import threading
import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from nanorl.decode import SamplerSettings, sample_tokens
from nanorl.engine import Engine, Request
from nanorl.gpt import GPTConfig, build_model
from nanorl.tokenizer import SPLIT_PATTERN, Tokenizer
from nanorl.toolcalls import assistant_parts, calculator

# a byte-level tokenizer needs no training: 256 byte tokens + the 9 special tokens
TOK = Tokenizer.from_ranks({bytes([i]): i for i in range(256)}, SPLIT_PATTERN)
SP = TOK.encode_special
BOS, A_END = TOK.get_bos_token_id(), SP("<|assistant_end|>")
PY_START, PY_END, OUT_START, OUT_END = (
    SP(f"<|{n}|>") for n in ("python_start", "python_end", "output_start", "output_end")
)
VOCAB = 272  # > the tokenizer's 265: the model's vocab may be padded


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # tiny models: threads only add sync overhead, and they crawl when the machine's cores are busy
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny(n_kv_head=2, seq=64, seed=0):
    torch.manual_seed(seed)
    cfg = GPTConfig(sequence_len=seq, vocab_size=VOCAB, n_layer=2, n_head=4, n_kv_head=n_kv_head, n_embd=64)
    model = build_model(cfg, "cpu")
    with torch.no_grad():  # perturb: init zeroes the output projections, and the lm_head is near zero
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
        model.lm_head.weight.mul_(20)  # logits that matter: greedy has clear winners
    return model.eval()


def bigram(next_of, default=122):  # 122: "z"
    """A rigged GPT whose next token depends only on the current one: blocks are the identity (zero output
    projections), the embedding is one-hot, and the lm_head holds a logit table. Deterministic at T=0."""
    C = 288
    cfg = GPTConfig(sequence_len=64, vocab_size=VOCAB, n_layer=1, n_head=4, n_kv_head=2, n_embd=C)
    model = build_model(cfg, "cpu")
    with torch.no_grad():
        model.transformer.wte.weight.copy_(torch.eye(VOCAB, C) * C**0.5)  # norm() keeps it as is
        model.lm_head.weight.zero_()
        for x in range(VOCAB):
            model.lm_head.weight[next_of.get(x, default), x] = 12 / C**0.5
    return model.eval()


def greedy_reference(model, prompt, n):
    """Greedy decoding by repeated full forwards, no cache."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt) :]


def prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.fp32("calls the model outside autocast, as an fp32 reference (CUDA's layout runs it under autocast only)")
@pytest.mark.parametrize("n_kv_head", [4, 1])
def test_greedy_with_cache_equals_full_forwards(n_kv_head):
    model = tiny(n_kv_head)
    engine = Engine(model, TOK, batch_size=4)
    ps = prompts([5, 12, 1, 30])
    out = engine.submit_and_wait(
        [
            Request(p, num_samples=1 + (i == 1) * 2, max_tokens=12, temperature=0, stop_tokens=[])
            for i, p in enumerate(ps)
        ]
    )
    for p, cs in zip(ps, out):
        for c in cs:  # the 3 samples of prompt 1 share its prefill (copied rows)
            assert c.tokens == greedy_reference(model, p, 12)
            assert c.status == "truncated" and c.mask == [1] * 12 and c.prompt_len == len(p)


def trainer_logprobs(model, prompt, tokens, temperature):
    """The trainer's log-probs of tokens after prompt (GPT.token_logprobs at the rollout temperature), fp32."""
    seq = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        return model.token_logprobs(seq[:, :-1], seq[:, 1:], temperature=temperature)[0, len(prompt) - 1 :]


def check_invariants(engine):
    """The engine's invariants after any step: every sample in a slot knows its slot and is running, the busy slots are
    exactly 0..n-1, no queued sample holds a slot, and each busy row's cache holds its sample's tokens but
    the last one, which is the row's next input."""
    n = engine.n_busy
    assert not engine.holes and sum(s is not None for s in engine.slots) == n, "holes left after a step"
    assert all(s is not None for s in engine.slots[:n]), f"busy slots are not a prefix: {engine.slots}"
    assert all(s.slot == i and s.out.status == "running" for i, s in enumerate(engine.slots[:n]))
    assert len({id(s) for s in engine.slots[:n]}) == n, "a sample sits in two slots"
    assert all(s.slot is None and s.out.status == "running" for s in engine.pending)
    assert engine.cache.pos[:n].tolist() == (engine.records.prompt_len[:n] + engine.records.n_gen[:n] - 1).tolist(), (
        "a row's cache is out of step"
    )
    last = engine.records.out[np.arange(n), engine.records.n_gen[:n] - 1, 0].astype(np.int64)
    assert engine.input_ids[:n].tolist() == last.tolist(), "a row's next input is wrong"
    assert engine.cache.rows == slice(None)


def run_checked(engine, requests):
    """engine.submit_and_wait, checking the engine's slot invariants after every step."""
    handles = [engine.submit(r) for r in requests]
    while engine.step():
        check_invariants(engine)
    check_invariants(engine)
    return [h.completions for h in handles]


@pytest.mark.fp32("calls the model outside autocast, as an fp32 reference (CUDA's layout runs it under autocast only)")
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_logprobs_are_the_trainers_at_the_sampling_temperature(temperature):
    # the engine records log_softmax(logits / T), before top-k/top-p: what the trainer computes at the rollout
    # temperature, so on-policy TIS weights exp(trainer - rollout) are 1. (Log-probs at T = 1 fail at T = 0.7.)
    model = tiny()
    with torch.no_grad():
        model.lm_head.weight.mul_(0.2)  # a spread distribution: the temperature matters for every token
    engine = Engine(model, TOK, batch_size=3)
    reqs = [
        Request(p, num_samples=2, max_tokens=15, temperature=temperature, seed=i, stop_tokens=[])
        for i, p in enumerate(prompts([4, 9, 17]))
    ]
    reqs.append(
        Request(
            prompts([5])[0],
            num_samples=2,
            max_tokens=15,
            temperature=temperature,
            top_k=50,
            top_p=0.9,
            seed=9,
            stop_tokens=[],
        )
    )  # top-k/top-p change what is drawn, not the recorded log-probs (off-policy)
    for req, cs in zip(reqs, run_checked(engine, reqs)):
        for c in cs:
            lp = trainer_logprobs(model, req.prompt_ids, c.tokens, temperature)
            torch.testing.assert_close(torch.tensor(c.logprobs), lp, atol=1e-5, rtol=0)
            assert torch.exp(lp - torch.tensor(c.logprobs)).sub(1).abs().max() < 1e-5  # TIS weights are 1
            assert lp.std() > 0.1  # a real comparison, not the same number everywhere


@pytest.mark.fp32("calls the model outside autocast, as an fp32 reference (CUDA's layout runs it under autocast only)")
def test_greedy_logprobs_are_at_temperature_one():
    model = tiny()
    p = prompts([6])[0]
    ((c,),) = Engine(model, TOK, batch_size=2).submit_and_wait(
        [Request(p, max_tokens=10, temperature=0, stop_tokens=[])]
    )
    torch.testing.assert_close(torch.tensor(c.logprobs), trainer_logprobs(model, p, c.tokens, 1.0), atol=1e-5, rtol=0)


def test_seeds_reproducible_and_samples_differ_from_first_token():
    model = tiny()
    with torch.no_grad():
        model.lm_head.weight.mul_(0.01)  # a spread first-token distribution
    p = prompts([6])[0]
    req = Request(p, num_samples=8, max_tokens=10, temperature=1.0, seed=123, stop_tokens=[])
    a = Engine(model, TOK, batch_size=8).submit_and_wait([req])[0]
    firsts = [c.tokens[0] for c in a]
    assert len(set(firsts)) >= 6, firsts  # independent draws from the first token on, not 8 copies
    assert len({tuple(c.tokens) for c in a}) == 8
    # same seed -> same samples, whatever the batch size and whatever else shares the batch
    others = [Request(q, num_samples=3, max_tokens=7, seed=9, stop_tokens=[]) for q in prompts([3, 20], seed=5)]
    b = Engine(model, TOK, batch_size=3).submit_and_wait(others + [req])[-1]
    assert [c.tokens for c in a] == [c.tokens for c in b]
    c = Engine(model, TOK, batch_size=8).submit_and_wait(
        [Request(p, num_samples=8, max_tokens=10, seed=124, stop_tokens=[])]
    )[0]
    assert [x.tokens for x in c] != [x.tokens for x in a]


@pytest.mark.fp32("tokens compared across batchings: bf16 rounding differs with the batch's shape, so draws differ")
def test_mixed_lengths_and_continuous_batching_equal_one_at_a_time():
    model = tiny()
    ps = prompts([3, 25, 8, 1, 14, 6, 40])
    reqs = [
        Request(p, num_samples=1 + i % 2, max_tokens=4 + 3 * i, temperature=0, stop_tokens=[]) for i, p in enumerate(ps)
    ]
    alone = [Engine(model, TOK, batch_size=2).submit_and_wait([r])[0] for r in reqs]
    batched = Engine(model, TOK, batch_size=3, prefill_tokens=64).submit_and_wait(reqs)  # 10 samples through 3 slots
    for r, a, b in zip(reqs, alone, batched):
        assert [c.tokens for c in a] == [c.tokens for c in b]
        assert all(len(c.tokens) == r.max_tokens for c in b)


def test_context_limit_truncates():
    model = tiny(seq=32)
    engine = Engine(model, TOK, batch_size=2, max_len=20)
    ((c,),) = engine.submit_and_wait([Request(prompts([15])[0], max_tokens=100, temperature=0, stop_tokens=[])])
    assert c.status == "truncated" and c.prompt_len + len(c.tokens) == 20


def test_stop_tokens():
    model = bigram({BOS: ord("a"), ord("a"): ord("b"), ord("b"): A_END})
    engine = Engine(model, TOK, batch_size=2)
    ((c,),) = engine.submit_and_wait([Request([BOS], max_tokens=10, temperature=0)])
    assert c.tokens == [ord("a"), ord("b"), A_END] and c.status == "completed"
    ((c,),) = engine.submit_and_wait([Request([BOS], max_tokens=10, temperature=0, stop_tokens=[ord("b")])])
    assert c.tokens == [ord("a"), ord("b")] and c.status == "completed"
    ((c,),) = engine.submit_and_wait([Request([BOS], max_tokens=2, temperature=0)])
    assert c.tokens == [ord("a"), ord("b")] and c.status == "truncated"


@pytest.mark.fp32("calls the model outside autocast, as an fp32 reference (CUDA's layout runs it under autocast only)")
def test_tool_call_forces_output_with_mask_zero():
    script = {
        BOS: PY_START,
        PY_START: ord("2"),
        ord("2"): ord("+"),
        ord("+"): ord("3"),
        ord("3"): PY_END,
        OUT_END: A_END,
    }
    model = bigram(script)
    engine = Engine(model, TOK, batch_size=2)
    ((c,),) = engine.submit_and_wait([Request([BOS], max_tokens=20, temperature=0)])
    assert c.tokens == [PY_START, ord("2"), ord("+"), ord("3"), PY_END, OUT_START, ord("5"), OUT_END, A_END]
    assert c.mask == [1, 1, 1, 1, 1, 0, 0, 0, 1] and c.status == "completed"
    # forced tokens carry their real log-prob under the model (low here: it wanted "z")
    with torch.no_grad():
        seq = torch.tensor([[BOS] + c.tokens])
        lp = model.token_logprobs(seq[:, :-1], seq[:, 1:])[0]
    torch.testing.assert_close(torch.tensor(c.logprobs), lp, atol=1e-4, rtol=0)
    assert max(c.logprobs[5:8]) < -5 < -0.05 < min(c.logprobs[:5])
    assert assistant_parts(TOK, c.tokens) == [{"type": "python", "text": "2+3"}, {"type": "python_output", "text": "5"}]
    # at T = 0.7 every token, forced ones included, has the trainer's log-prob at 0.7
    ((c7,),) = Engine(model, TOK, batch_size=2).submit_and_wait(
        [Request([BOS], max_tokens=20, temperature=0.7, seed=3)]
    )
    assert c7.mask == c.mask
    torch.testing.assert_close(
        torch.tensor(c7.logprobs), trainer_logprobs(model, [BOS], c7.tokens, 0.7), atol=1e-5, rtol=0
    )
    # the context ends inside the tool's output: the sample is cut there, "truncated" like any other
    short = Engine(model, TOK, batch_size=2, max_len=7)
    ((c,),) = short.submit_and_wait([Request([BOS], max_tokens=20, temperature=0)])
    assert c.tokens == [PY_START, ord("2"), ord("+"), ord("3"), PY_END, OUT_START] and c.mask == [1] * 5 + [0]
    assert c.status == "truncated"
    # without tools the same model just goes on writing
    ((c,),) = engine.submit_and_wait([Request([BOS], max_tokens=8, temperature=0, use_tools=False)])
    assert c.mask == [1] * 8 and OUT_START not in c.tokens


def test_tool_errors_are_contained_and_timeout_enforced():
    model = bigram(
        {BOS: PY_START, PY_START: ord("1"), ord("1"): ord("/"), ord("/"): ord("0"), ord("0"): PY_END, OUT_END: A_END}
    )
    ((c,),) = Engine(model, TOK, batch_size=1, tool=calculator).submit_and_wait(
        [Request([BOS], max_tokens=80, temperature=0)]
    )
    out = assistant_parts(TOK, c.tokens)[1]
    assert out["type"] == "python_output" and out["text"] == "Error: division by zero"
    assert c.status == "completed" and c.tokens[-1] == A_END

    def slow(expr):
        time.sleep(3)
        return "late"

    engine = Engine(model, TOK, batch_size=1, tool=slow, tool_timeout=0.2)
    t0 = time.time()
    ((c,),) = engine.submit_and_wait([Request([BOS], max_tokens=80, temperature=0)])
    assert time.time() - t0 < 2
    assert assistant_parts(TOK, c.tokens)[1] == {"type": "python_output", "text": "Error: timed out after 0.2s"}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(prompt_ids=[]), "empty prompt"),
        (dict(prompt_ids=[1] * 64), "too long"),
        (dict(prompt_ids=[1, VOCAB]), "unknown token"),
        (dict(prompt_ids=[1, -1]), "unknown token"),
        (dict(prompt_ids=[1], max_tokens=0), "max_tokens"),
        (dict(prompt_ids=[1], temperature=-0.1), "temperature"),
        (dict(prompt_ids=[1], top_p=0.0), "top_p"),
        (dict(prompt_ids=[1], top_p=1.5), "top_p"),
        (dict(prompt_ids=[1], top_k=0), "top_k"),
        (dict(prompt_ids=[1], num_samples=0), "num_samples"),
        (dict(prompt_ids=[1], stop_tokens=[VOCAB]), "stop_tokens"),
    ],
)
def test_bad_requests_are_clear_errors(kwargs, match):
    engine = Engine(tiny(), TOK, batch_size=2)
    good = Request([1, 2], max_tokens=2)
    with pytest.raises(ValueError, match=match):
        engine.submit_and_wait([good, Request(**kwargs)])
    assert not engine.pending  # nothing was queued: a batch is checked before any of it runs


def test_bad_engine_settings():
    model = tiny()
    with pytest.raises(MemoryError, match="smaller batch_size"):
        Engine(model, TOK, batch_size=10**9)
    with pytest.raises(ValueError, match="max_len"):
        Engine(model, TOK, max_len=65)
    with pytest.raises(ValueError, match="batch_size"):
        Engine(model, TOK, batch_size=0)
    with pytest.raises(ValueError, match="num_samples"):
        Engine(model, TOK).stream(Request([1], num_samples=2))


def test_abort_returns_partial_sequences():
    model = tiny()
    engine = Engine(model, TOK, batch_size=2)
    reqs = [Request(p, num_samples=2, max_tokens=50, seed=i, stop_tokens=[]) for i, p in enumerate(prompts([4, 7]))]
    handles = [engine.submit(r) for r in reqs]
    for _ in range(5):
        engine.step()
    engine.abort()
    engine.step()
    running = handles[0].completions  # in the two slots after 5 steps: 6 tokens each (1 at prefill + 5 decodes)
    assert [c.status for c in running] == ["aborted", "aborted"] and [len(c.tokens) for c in running] == [6, 6]
    assert all(len(c.logprobs) == len(c.mask) == 6 for c in running)
    assert [(c.status, c.tokens) for c in handles[1].completions] == [("aborted", [])] * 2  # still queued
    assert all(s is None for s in engine.slots) and not engine.pending
    # the engine keeps working, and an abort from another thread stops a running submit_and_wait()
    many = [Request([1, 2, 3], max_tokens=50, stop_tokens=[]) for _ in range(200)]  # seconds of work
    threading.Timer(0.3, engine.abort).start()
    t0 = time.time()
    out = engine.submit_and_wait(many)
    assert time.time() - t0 < 3
    statuses = [c.status for (c,) in out]
    assert statuses[-1] == "aborted" and set(statuses) <= {"truncated", "aborted"}


def test_cancel_frees_the_slot():
    engine = Engine(tiny(), TOK, batch_size=1)
    h1 = engine.submit(Request([1, 2], max_tokens=40, stop_tokens=[]))
    h2 = engine.submit(Request([3], max_tokens=3, stop_tokens=[]))
    engine.step()
    h1.cancel()
    assert h2.result()[0].status == "truncated" and len(h2.completions[0].tokens) == 3
    assert h1.done and h1.completions[0].status == "aborted" and len(h1.completions[0].tokens) == 2


def test_stream_yields_the_same_as_submit_and_wait():
    model = tiny()
    engine = Engine(model, TOK, batch_size=4)
    req = Request(prompts([9])[0], max_tokens=12, temperature=1.0, top_k=20, seed=7, stop_tokens=[])
    ((want,),) = engine.submit_and_wait([req])
    events = list(engine.stream(req))
    assert [e["token"] for e in events[:-1]] == want.tokens
    assert [e["logprob"] for e in events[:-1]] == want.logprobs and [e["mask"] for e in events[:-1]] == want.mask
    assert events[-1]["status"] == "truncated" and events[-1]["completion"].tokens == want.tokens
    # closing a stream early cancels its request and frees its slot
    gen = engine.stream(Request([1, 2], max_tokens=100, stop_tokens=[]))
    next(gen)
    gen.close()
    engine.step()
    assert all(s is None for s in engine.slots) and not engine.live


def test_serve_forever_batches_concurrent_users():
    model = tiny()
    engine = Engine(model, TOK, batch_size=3)
    reqs = [
        Request(p, max_tokens=5 + i, temperature=0.9, seed=i, stop_tokens=[])
        for i, p in enumerate(prompts([3, 8, 5, 12, 2]))
    ]
    want = [c[0].tokens for c in Engine(model, TOK, batch_size=5).submit_and_wait(reqs)]
    server = threading.Thread(target=engine.serve_forever, daemon=True)
    server.start()
    got = [None] * len(reqs)

    def user(i):
        got[i] = [e["token"] for e in engine.stream(reqs[i]) if "token" in e]

    users = [threading.Thread(target=user, args=(i,)) for i in range(len(reqs))]
    for u in users:
        u.start()
    for u in users:
        u.join(timeout=30)
    assert got == want
    assert [c[0].tokens for c in engine.submit_and_wait(reqs[:2])] == want[:2]  # generate() also works while serving
    engine.shutdown()
    server.join(timeout=5)
    assert not server.is_alive()


def test_chat_cli_turn_streams_tool_use_and_renders_back():
    import io

    from scripts.chat_cli import chat_turn

    a_start = SP("<|assistant_start|>")
    model = bigram(
        {
            a_start: PY_START,
            PY_START: ord("2"),
            ord("2"): ord("*"),
            ord("*"): ord("3"),
            ord("3"): PY_END,
            OUT_END: ord("!"),
            ord("!"): A_END,
        }
    )
    engine = Engine(model, TOK, batch_size=1)
    conv = {"messages": [{"role": "user", "content": "2*3?"}]}
    out = io.StringIO()
    reply = chat_turn(engine, TOK, conv, temperature=0, out=out)
    assert out.getvalue() == "<<2*3=6>>!\n"
    assert reply["content"] == [
        {"type": "python", "text": "2*3"},
        {"type": "python_output", "text": "6"},
        {"type": "text", "text": "!"},
    ]
    conv["messages"] += [reply, {"role": "user", "content": "again"}]
    ids = TOK.render_for_completion(conv)  # the reply renders back into the next prompt
    assert ids.count(PY_START) == 1 and ids.count(OUT_START) == 1


@pytest.mark.fp32("equal to fp32 rounding by design; bf16 rounds ~3e-3 relative")
def test_static_shape_decode_equals_eager():
    # what each CUDA graph records, run eagerly here: the batch is a ladder size, every row reads a fixed
    # attention-length bucket (with stale KV past its position masked out), idle rows decode garbage at position 0
    model = tiny(seq=256)
    reqs = [
        Request(
            p, num_samples=2 if i < 4 else 1, max_tokens=70 + 10 * (i == 4), temperature=0.7, seed=i, stop_tokens=[]
        )
        for i, p in enumerate(prompts([3, 50, 100, 20, 9]))
    ]
    want = Engine(model, TOK, batch_size=3, max_len=200).submit_and_wait(reqs)
    engine = Engine(model, TOK, batch_size=3, max_len=200)
    assert engine.buckets == [64, 128, 200] and engine.sizes == [1, 2, 3]
    seen, sizes = set(), set()

    def static_step(size):
        n = engine.n_busy
        L = engine._bucket(int((engine.records.prompt_len[:n] + engine.records.n_gen[:n]).max()))
        seen.add(L)
        sizes.add(size)
        engine.cache.static, engine.cache.attend_len = True, L
        try:
            return engine._forward_step(size)
        finally:
            engine.cache.static = False

    engine._decode_logits = static_step
    got = engine.submit_and_wait(reqs)
    assert seen == {64, 128, 200} and {1, 3} <= sizes  # every bucket, the full batch and the smallest rung
    for a, b in zip(want, got):
        assert [c.tokens for c in a] == [c.tokens for c in b]
        for ca, cb in zip(a, b):
            torch.testing.assert_close(torch.tensor(ca.logprobs), torch.tensor(cb.logprobs), atol=1e-5, rtol=0)


class RecordedGraph:
    """A CUDA graph stand-in on the CPU: replay() reruns the recorded step into its static logits, as a real graph
    does; stale=True records nothing, what a capture on another device's stream gives (PyTorch only warns), so
    every replay returns the logits of the capture run."""

    def __init__(self, step, size, stale):
        self.step, self.size, self.stale = step, size, stale
        self.logits = step(size).clone()

    def replay(self):
        if not self.stale:
            self.logits.copy_(self.step(self.size))


@pytest.mark.parametrize("stale", [False, True])
def test_a_graph_that_does_not_reproduce_the_eager_step_is_dropped_with_one_warning(monkeypatch, capfd, stale):
    import nanorl.decode as decode

    def capture(forward_step, cache, sizes, buckets, device):
        # what capture_decode_graphs returns, with the capture's static shapes and an empty cache
        graphs = {}
        cache.static = True
        for size in sizes:
            for L in buckets:
                cache.attend_len = L
                cache.pos.zero_()
                g = RecordedGraph(forward_step, size, stale)
                graphs[size, L] = (g, g.logits)
        cache.static, cache.attend_len = False, None
        cache.pos.zero_()
        return graphs

    monkeypatch.setattr(decode, "capture_decode_graphs", capture)
    model = tiny(seq=160)
    reqs = [Request(p, max_tokens=24, seed=i, stop_tokens=[]) for i, p in enumerate(prompts([3, 70, 9]))]
    want = Engine(model, TOK, batch_size=4, max_len=150).submit_and_wait(reqs)
    capfd.readouterr()
    engine = Engine(model, TOK, batch_size=4, max_len=150, cuda_graph=True)
    err = capfd.readouterr().err
    assert engine.use_cuda_graph is not stale and bool(engine.graphs) is not stale
    if stale:  # one line, naming the first graph checked (batch 1, the shortest bucket); then eager decoding
        assert err == (
            "warning: the CUDA graph of decode batch 1, attention length 64 on cpu does not reproduce the eager step: "
            "this engine decodes eagerly (same tokens, slower)\n"
        )
    else:
        assert err == ""
    assert not engine.cache.pos.any() and not engine.input_ids.any()  # the check leaves the engine as it found it
    got = engine.submit_and_wait(reqs)
    for a, b in zip(want, got):
        assert [c.tokens for c in a] == [c.tokens for c in b]
        for ca, cb in zip(a, b):
            torch.testing.assert_close(torch.tensor(ca.logprobs), torch.tensor(cb.logprobs), atol=1e-5, rtol=0)


@pytest.mark.fp32("tokens compared across batchings: bf16 rounding differs with the batch's shape, so draws differ")
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_aborted_sample_continues_into_the_uninterrupted_sequence(temperature):
    # partial rollouts: a sample aborted mid-way and resubmitted with its tokens, its index and its token count
    # (first_sample, start_counter) draws the same random stream, so it finishes exactly as if never interrupted,
    # with the trainer's log-probs at the rollout temperature; the slots stay consistent through abort + resubmit
    from nanorl.rollout import Sample, extend_sample

    model = tiny(seq=64)
    prompt = [BOS, 65, 66, 67]
    req = dict(max_tokens=40, temperature=temperature, seed=7, stop_tokens=[], use_tools=False)
    full = Engine(model, TOK, batch_size=4).submit_and_wait([Request(prompt, num_samples=3, **req)])[0]
    eng = Engine(model, TOK, batch_size=4)
    h = eng.submit(Request(prompt, num_samples=3, **req))
    eng.submit(
        Request([BOS, 70], num_samples=2, max_tokens=30, seed=1, stop_tokens=[])
    )  # queued behind it, aborted too
    for _ in range(9):
        eng.step()
        check_invariants(eng)
    eng.abort()
    while eng.step():
        check_invariants(eng)
    assert all(s is None for s in eng.slots) and not eng.pending
    parts = [extend_sample(Sample(tokens=list(prompt)), c) for c in h.completions]
    assert all(s.status == "aborted" and 0 < s.response_length < 40 for s in parts)
    other = eng.submit(Request([BOS, 71], num_samples=2, max_tokens=12, seed=2, stop_tokens=[]))  # shares the batch
    cont = run_checked(
        eng,
        [
            Request(
                list(s.tokens),
                max_tokens=40 - s.response_length,
                first_sample=i,
                start_counter=s.response_length,
                **{k: v for k, v in req.items() if k != "max_tokens"},
            )
            for i, s in enumerate(parts)
        ],
    )
    assert [c.status for c in other.completions] == ["truncated"] * 2
    for s, c, ref in zip(parts, cont, full):
        extend_sample(s, c[0])
        assert s.tokens[len(prompt) :] == ref.tokens and s.status == ref.status == "truncated"
        torch.testing.assert_close(torch.tensor(s.rollout_log_probs), torch.tensor(ref.logprobs), atol=1e-5, rtol=0)
        lp = trainer_logprobs(model, prompt, s.tokens[len(prompt) :], temperature)
        torch.testing.assert_close(torch.tensor(s.rollout_log_probs), lp, atol=1e-5, rtol=0)


def test_aborted_sample_inside_a_tool_call_is_cut_before_the_call():
    from nanorl.engine import Completion
    from nanorl.rollout import Sample, extend_sample

    resp = [65, PY_START, 49, 43, 49, PY_END, OUT_START, 50]  # aborted while the output was being forced in
    s = extend_sample(
        Sample(tokens=[BOS]), Completion(resp, [-1.0] * 8, [1, 1, 1, 1, 1, 1, 0, 0], "aborted", 1), PY_START, OUT_END
    )
    assert s.tokens == [BOS, 65] and s.loss_mask == [1] and s.rollout_log_probs == [-1.0] and s.response_length == 1
    done = resp[:7] + [50, OUT_END, 66]  # a finished call is kept
    s = extend_sample(Sample(tokens=[BOS]), Completion(done, [0.0] * 10, [1] * 10, "aborted", 1), PY_START, OUT_END)
    assert s.response_length == 10


def test_request_after_a_cancel_equals_it_on_an_idle_engine():
    # cancelling frees a slot that the next admitted request reuses in the same step; that request must decode
    # exactly as on an idle engine (it used to be reset to position 0 at every later step)
    model = tiny()
    req = Request(prompts([7])[0], max_tokens=20, temperature=0.8, seed=5, stop_tokens=[])
    ((want,),) = Engine(model, TOK, batch_size=2).submit_and_wait([req])
    engine = Engine(model, TOK, batch_size=2)
    running = [engine.submit(Request(p, max_tokens=40, seed=i, stop_tokens=[])) for i, p in enumerate(prompts([3, 5]))]
    for _ in range(3):
        engine.step()
        check_invariants(engine)
    running[0].cancel()
    ((got,),) = run_checked(engine, [req])
    assert got.tokens == want.tokens and got.status == "truncated"
    torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=0)
    assert running[0].completions[0].status == "aborted" and running[1].completions[0].status == "truncated"


def test_one_request_on_a_big_engine_equals_a_batch_one_engine():
    # decode runs only the smallest ladder batch holding the busy rows (1, 2, 4, ... 64): a lone request on a
    # batch-64 engine decodes a batch of 1, and gets exactly what a batch-1 engine gives
    model = tiny()
    reqs = [Request(p, max_tokens=12, temperature=0.9, seed=i, stop_tokens=[]) for i, p in enumerate(prompts([5, 9]))]
    small = [Engine(model, TOK, batch_size=1).submit_and_wait([r])[0][0] for r in reqs]
    big = Engine(model, TOK, batch_size=64)
    assert big.sizes == [1, 2, 4, 8, 16, 32, 64]
    sizes = []
    decode = big._decode_logits
    big._decode_logits = lambda size: sizes.append(size) or decode(size)
    for r, want in zip(reqs, small):
        ((got,),) = run_checked(big, [r])
        assert got.tokens == want.tokens
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=0)
    assert set(sizes) == {1}


@pytest.mark.fp32("tokens compared across batchings: bf16 rounding differs with the batch's shape, so draws differ")
def test_compaction_moves_rows_without_changing_any_sample():
    # requests of different lengths end at different steps: the last busy rows move into the holes and the
    # batch shrinks down the ladder (5 busy -> 8 rows, 2 -> 2 ...); each sample equals itself alone on a batch-1 engine
    model = tiny()
    reqs = [
        Request(
            p,
            num_samples=1 + i % 2,
            max_tokens=3 + 4 * i,
            temperature=0.8,
            top_k=40 if i == 2 else None,
            seed=i,
            stop_tokens=[],
        )
        for i, p in enumerate(prompts([4, 11, 2, 7, 5]))
    ]
    alone = [
        [
            Engine(model, TOK, batch_size=1).submit_and_wait([replace(r, num_samples=1, first_sample=j)])[0][0]
            for j in range(r.num_samples)
        ]
        for r in reqs
    ]
    engine = Engine(model, TOK, batch_size=8)
    sizes = []
    decode = engine._decode_logits
    engine._decode_logits = lambda size: sizes.append(size) or decode(size)
    for a, b in zip(alone, run_checked(engine, reqs)):
        assert [c.tokens for c in a] == [c.tokens for c in b]
        for ca, cb in zip(a, b):
            torch.testing.assert_close(torch.tensor(ca.logprobs), torch.tensor(cb.logprobs), atol=1e-5, rtol=0)
    assert sizes[0] == 8 and sizes[-1] == 1 and sizes == sorted(sizes, reverse=True) and 4 in sizes


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(top_p=1e-50),
        dict(top_p=1e-46),
        dict(temperature=1e-40),
        dict(top_k=1, top_p=1e-45),
        dict(temperature=1e-40, top_p=1e-50),
    ],
)
def test_extreme_sampling_settings_are_greedy_and_fail_nothing_else(kwargs):
    # top_p 1e-50 is 0 in float32 and 1e-40 a denormal temperature: the sampler still keeps the top token (greedy),
    # and other requests sharing the batch are untouched
    model = tiny()
    p, q = prompts([6, 9])
    ((greedy,),) = Engine(model, TOK, batch_size=1).submit_and_wait(
        [Request(p, max_tokens=8, temperature=0, stop_tokens=[])]
    )
    other = Request(q, max_tokens=8, temperature=1.0, seed=4, stop_tokens=[])
    ((want,),) = Engine(model, TOK, batch_size=1).submit_and_wait([other])
    [(c,), (o,)] = run_checked(
        Engine(model, TOK, batch_size=2), [Request(p, max_tokens=8, seed=1, stop_tokens=[], **kwargs), other]
    )
    assert c.status == "truncated" and c.tokens == greedy.tokens and o.tokens == want.tokens
    assert all(lp <= 0 and lp == lp for lp in c.logprobs)
    V = 50
    logits = torch.randn(4, V)
    for u in (0.0, 0.5, 1 - 2**-53):
        settings = SamplerSettings(
            torch.full((4,), kwargs.get("temperature", 1.0)),
            torch.full((4,), kwargs.get("top_k", V)),
            torch.full((4,), kwargs.get("top_p", 1.0)),
        )
        t = sample_tokens(logits, settings, torch.full((4,), u, dtype=torch.float64))
        assert t.tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("top_p", float("nan")),
        ("top_p", float("inf")),
        ("top_k", float("inf")),
        ("temperature", "0.5"),
        ("temperature", None),
        ("top_k", True),
    ],
)
def test_non_finite_sampling_values_are_refused_naming_the_field(field, value):
    engine = Engine(tiny(), TOK, batch_size=1)
    with pytest.raises(ValueError, match=field):
        engine.submit(Request([1, 2], **{field: value}))
    assert not engine.pending


@pytest.mark.fp32("tokens compared across batchings: bf16 rounding differs with the batch's shape, so draws differ")
def test_a_failing_request_ends_alone():
    # a failure that belongs to one request (here its prefill, then its tool call) ends it with "error";
    # the requests sharing the engine carry on and get exactly what they get alone
    model = tiny()
    good = [
        Request(p, num_samples=2, max_tokens=10, temperature=0.8, seed=i, stop_tokens=[])
        for i, p in enumerate(prompts([4, 8]))
    ]
    want = Engine(model, TOK, batch_size=4).submit_and_wait(good)
    BAD = VOCAB - 1  # no byte: the good prompts never hold it
    engine = Engine(model, TOK, batch_size=4)
    forward = engine.model.hidden_states

    def hidden_states(idx, **kw):
        if idx.size(1) > 1 and (idx == BAD).any():  # prefill only
            raise RuntimeError("this prompt breaks the model")
        return forward(idx, **kw)

    engine.model.hidden_states = hidden_states
    bad = engine.submit(Request([1, BAD], num_samples=3, max_tokens=10))
    got = run_checked(engine, [good[0]] + [good[1]])  # prefilled in one forward with the bad prompt, then alone
    assert [c.status for c in bad.completions] == ["error"] * 3 and "breaks the model" in bad.error
    assert [[c.tokens for c in cs] for cs in got] == [[c.tokens for c in cs] for cs in want]
    again = engine.submit(Request([1, BAD], num_samples=3, max_tokens=10))  # in the slots the good samples used
    assert [(c.status, c.tokens) for c in again.result()] == [("error", [])] * 3  # none of their tokens
    # a tool whose output cannot be tokenized fails its own request only
    script = {
        BOS: PY_START,
        PY_START: ord("2"),
        ord("2"): ord("+"),
        ord("+"): ord("3"),
        ord("3"): PY_END,
        OUT_END: A_END,
    }
    engine = Engine(bigram(script), TOK, batch_size=4, tool=lambda expr: "5")
    engine.markup.tokenizer = type(
        "Tok", (), {"encode": lambda self, text: 1 / 0, "decode": lambda self, ids: TOK.decode(ids)}
    )()
    calls = engine.submit(Request([BOS], max_tokens=20, temperature=0))
    plain = run_checked(engine, [Request([BOS], max_tokens=8, temperature=0, use_tools=False)])
    assert calls.completions[0].status == "error" and "ZeroDivisionError" in calls.error
    assert plain[0][0].status == "truncated" and len(plain[0][0].tokens) == 8


@pytest.mark.fp32("checks the engine's fp32 CPU copy itself")
def test_inference_copy_and_load_weights():
    # the engine samples from its own copy of the weights (fp32 on the CPU: the same numbers), one flat buffer;
    # the trainer's updates reach it by load_weights(), and share_weights=True samples from the model itself
    model = tiny()
    req = Request(prompts([5])[0], max_tokens=10, temperature=0.9, seed=3, stop_tokens=[])
    engine = Engine(model, TOK, batch_size=2)
    shared = Engine(model, TOK, batch_size=2, share_weights=True)
    assert engine.model is not model and shared.model is model
    assert engine.flat_weights.numel() == model.num_params() and engine.flat_weights.dtype == torch.float32
    assert all(
        p.untyped_storage().data_ptr() == engine.flat_weights.untyped_storage().data_ptr()
        for p in engine.model.parameters()
    )
    before = engine.submit_and_wait([req])[0][0]
    assert before.tokens == shared.submit_and_wait([req])[0][0].tokens
    with torch.no_grad():
        for p in model.parameters():  # an "optimizer step"
            p.add_(0.05 * torch.randn_like(p))
    assert engine.submit_and_wait([req])[0][0].tokens == before.tokens  # still the old weights
    engine.load_weights(model)
    after = engine.submit_and_wait([req])[0][0]
    assert after.tokens == shared.submit_and_wait([req])[0][0].tokens != before.tokens
    torch.testing.assert_close(
        torch.tensor(after.logprobs), trainer_logprobs(model, req.prompt_ids, after.tokens, 0.9), atol=1e-5, rtol=0
    )
    bf16 = Engine(model, TOK, batch_size=2, dtype=torch.bfloat16)
    assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="share_weights"):
        Engine(model, TOK, share_weights=True, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="do not match"):
        engine.load_weights(tiny(n_kv_head=4))
    tied = tiny()
    tied.lm_head.weight = tied.transformer.wte.weight  # tied weights stay one tensor in the copy
    copy = Engine(tied, TOK, batch_size=1).model
    assert copy.lm_head.weight is copy.transformer.wte.weight and torch.equal(copy.lm_head.weight, tied.lm_head.weight)


@pytest.mark.fp32("calls the model outside autocast, as an fp32 reference (CUDA's layout runs it under autocast only)")
def test_a_step_runs_in_inference_mode_and_leaves_no_inference_tensor_behind(monkeypatch):
    # Engine.step runs under torch.inference_mode (~5% off a batch-1 CPU step: no version counters, no view
    # tracking); nothing the engine keeps between steps may become an inference tensor, which a later in-place
    # load_weights or a training step on shared weights could not use
    model = tiny()
    engine = Engine(model, TOK, batch_size=2, share_weights=True)
    modes = []
    forward_step = engine._forward_step
    monkeypatch.setattr(
        engine, "_forward_step", lambda size: modes.append(torch.is_inference_mode_enabled()) or forward_step(size)
    )
    engine.submit_and_wait(
        [Request(prompts([5])[0], num_samples=2, max_tokens=6, temperature=1.0, seed=1, stop_tokens=[])]
    )
    assert modes and all(modes)
    kept = [engine.cache.k, engine.cache.v, engine.cache.pos, engine.input_ids, *model.parameters(), *model.buffers()]
    assert not any(t.is_inference() for t in kept)
    x = torch.tensor([prompts([9])[0]])
    model(x, targets=x).backward()  # the shared weights still train
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.fp32("checks the engine's fp32 CPU copy itself")
@pytest.mark.parametrize("n_kv_head", [4, 2])
def test_fused_qkv_copy_samples_as_the_model_and_follows_load_weights(n_kv_head):
    # the engine's copy reads q, k, v with one matmul of a view of its flat buffer (CausalSelfAttention.fuse_qkv):
    # the same tokens and log-probs as the unfused model sampled with share_weights (to float32 rounding: on CPU the
    # copy's weights are column-major, another GEMM path), before and after a load_weights() refresh (the view sees
    # it); a model with q/k/v biases is left unfused
    model = tiny(n_kv_head=n_kv_head)
    engine, shared = Engine(model, TOK, batch_size=4), Engine(model, TOK, batch_size=4, share_weights=True)
    attn = engine.model.transformer.h[0].attn
    assert attn.qkv is not None and model.transformer.h[0].attn.qkv is None
    assert attn.qkv.untyped_storage().data_ptr() == engine.flat_weights.untyped_storage().data_ptr()
    reqs = [
        Request(p, num_samples=2, max_tokens=12, temperature=1.0, seed=i, stop_tokens=[])
        for i, p in enumerate(prompts([3, 11]))
    ]
    for _ in range(2):
        a, b = engine.submit_and_wait(reqs), shared.submit_and_wait(reqs)
        assert [[c.tokens for c in cs] for cs in a] == [[c.tokens for c in cs] for cs in b]
        got, want = ([lp for cs in x for c in cs for lp in c.logprobs] for x in (a, b))
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=0)
        m = model.transformer.h[0].attn
        assert torch.equal(attn.qkv, torch.cat([m.c_q.weight, m.c_k.weight, m.c_v.weight]))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        engine.load_weights(model)
    biased = build_model(replace(model.config, attn_bias=True), "cpu")
    assert Engine(biased, TOK, batch_size=1).model.transformer.h[0].attn.qkv is None


@pytest.mark.fp32("checks the engine's fp32 CPU copy itself")
def test_the_cpu_copy_keeps_linear_weights_column_major():
    # F.linear on an (out, in) weight stored as the transpose of a contiguous (in, out) block runs MKL's plain GEMM,
    # 2-3x faster than the transposed-B path at 8 rows: every untied Linear of the engine's CPU copy is laid out so,
    # q, k and v side by side in one block (fuse_qkv's view), with the model's values; a tied head stays row-major
    # (the embedding reads rows of it)
    model = tiny()
    engine = Engine(model, TOK, batch_size=2)
    block = engine.model.transformer.h[0]
    for lin in (block.attn.c_q, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj, engine.model.lm_head):
        assert lin.weight.stride()[0] == 1
    assert block.attn.qkv.t().is_contiguous() and block.attn.qkv.stride() == (1, block.attn.qkv.size(0))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), engine.model.parameters()))
    tied = build_model(replace(model.config, tie_embeddings=True), "cpu")
    assert Engine(tied, TOK, batch_size=1).model.lm_head.weight.is_contiguous()


def test_rows_at_one_position_decode_through_the_lockstep_step():
    # batch 1 and rows at one position decode through decode.LockstepDecode, rows at different positions through the
    # cached forward. The samples of one prompt (one prefill) read its KV once (shared = the prompt's length, 7);
    # so do the samples of equally long prompts side by side, a group per prompt (group = its samples); prompts
    # with one sample each share nothing. Either way the tokens are an engine's without the lean step, and the
    # log-probs too: bit for bit where nothing is shared, to float rounding where a prompt is read once.
    # A shared model (maybe sharded, maybe with adapters) never takes the lean step
    model = tiny()
    engine, plain = Engine(model, TOK, batch_size=4), Engine(model, TOK, batch_size=4)
    plain.lockstep = None
    calls, lean = [], engine.lockstep
    engine.lockstep = lambda idx, pos, shared, group: (
        calls.append((len(idx), pos, shared, group)) or lean(idx, pos, shared, group)
    )
    req = lambda p, n, seed: Request(p, num_samples=n, max_tokens=4, temperature=1.0, seed=seed, stop_tokens=[])  # noqa: E731
    one = [req(prompts([7])[0], 4, 3)]
    same_length = [req(p, 2, i) for i, p in enumerate(prompts([6, 6], seed=4))]
    one_sample_each = [req(p, 1, i) for i, p in enumerate(prompts([6, 6], seed=4))]
    single = [req(prompts([9])[0], 1, 1)]
    mixed = [req(p, 1, 5) for p in prompts([5, 9], seed=2)]
    cases = [
        (one, [(4, 7, 7, 4), (4, 8, 7, 4), (4, 9, 7, 4)]),
        (same_length, [(4, 6, 6, 2), (4, 7, 6, 2), (4, 8, 6, 2)]),
        (one_sample_each, [(2, 6, 0, None), (2, 7, 0, None), (2, 8, 0, None)]),
        (single, [(1, 9, 0, None), (1, 10, 0, None), (1, 11, 0, None)]),
        (mixed, []),
    ]
    for reqs, want in cases:
        a, b = engine.submit_and_wait(reqs), plain.submit_and_wait(reqs)
        assert calls == want
        assert [[c.tokens for c in cs] for cs in a] == [[c.tokens for c in cs] for cs in b]
        got, ref = (torch.tensor([c.logprobs for cs in x for c in cs]) for x in (a, b))
        if any(shared for *_, shared, group in want):
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
        else:
            assert torch.equal(got, ref)
        calls.clear()
    assert Engine(model, TOK, batch_size=2, share_weights=True).lockstep is None


@pytest.mark.fp32("tokens compared across batchings: bf16 rounding differs with the batch's shape, so draws differ")
def test_random_traffic_keeps_the_invariants_and_every_sample():
    # requests arriving, ending at their first token, stopping, cancelled mid-way, through 4 slots: the slot
    # invariants hold after every step, and each sample that was not cancelled equals itself on an idle engine
    model = tiny()
    g = torch.Generator().manual_seed(3)
    rnd = lambda n: int(torch.randint(0, n, (), generator=g))  # noqa: E731
    reqs = [
        Request(
            prompts([1 + rnd(20)], seed=i)[0],
            num_samples=1 + rnd(3),
            max_tokens=1 + rnd(12),
            temperature=rnd(2) * 0.9,
            seed=i,
            stop_tokens=[rnd(256)] if rnd(2) else [],
        )
        for i in range(14)
    ]
    engine = Engine(model, TOK, batch_size=4)
    handles, cancelled = [], set()
    for i, r in enumerate(reqs):
        handles.append(engine.submit(r))
        if i % 5 == 4:
            handles[i - 1].cancel()
            cancelled.add(i - 1)
        engine.step()
        check_invariants(engine)
    while engine.step():
        check_invariants(engine)
    for i, (r, h) in enumerate(zip(reqs, handles)):
        if i in cancelled:
            assert all(c.status in ("aborted", "completed", "truncated") for c in h.completions)
            continue
        want = Engine(model, TOK, batch_size=1).submit_and_wait([r])[0]
        assert [(c.tokens, c.status) for c in h.completions] == [(c.tokens, c.status) for c in want]


def test_prefill_and_decode_attention_kernels_are_pinned(monkeypatch):
    # prefill is pinned like decode, never left to SDPA's dispatcher (on an H100 with torch 2.13 that would be a
    # cuDNN kernel no test exercises): every forward of the engine runs inside sdpa_kernel with the expected list
    import contextlib

    from torch.nn.attention import SDPBackend

    import nanorl.engine as engine_module
    from nanorl.decode import attention_backends

    active, seen = [], []
    real = engine_module.sdpa_kernel

    @contextlib.contextmanager
    def recording(backends):
        active.append(list(backends))
        try:
            with real(backends):
                yield
        finally:
            active.pop()

    monkeypatch.setattr(engine_module, "sdpa_kernel", recording)
    engine = Engine(tiny(), TOK, batch_size=2)
    forward = engine.model.hidden_states

    def hidden_states(idx, **kw):
        seen.append((idx.size(1), active[-1] if active else None))
        return forward(idx, **kw)

    engine.model.hidden_states = hidden_states
    lockstep = engine.lockstep  # batch 1 decodes through the lean step (decode.LockstepDecode), not hidden_states

    def lean(idx, pos, shared, group):
        seen.append((1, active[-1] if active else None))
        return lockstep(idx, pos, shared, group)

    engine.lockstep = lean
    engine.submit_and_wait([Request([1, 2, 3, 4, 5], max_tokens=3, stop_tokens=[])])
    cpu_prefill = cpu_decode = [SDPBackend.FLASH_ATTENTION]
    assert seen == [(5, cpu_prefill), (1, cpu_decode), (1, cpu_decode)]
    assert (
        engine.attention_kernels()
        == "engine attention: prefill = SDPA flash (CPU), decode = SDPA flash (CPU) (both pinned)"
    )
    # what a CUDA engine picks (no GPU needed)
    engine.attention, engine.use_cuda_graph = attention_backends(torch.device("cuda")), True
    assert engine.attention == [SDPBackend.EFFICIENT_ATTENTION]
    assert engine.attention_kernels() == (
        "engine attention: prefill = SDPA memory-efficient, decode = SDPA memory-efficient, CUDA graphs (both pinned)"
    )


def test_decode_touches_in_python_only_the_rows_that_need_it():
    # a decode step's host work does not grow with the batch: stops, budgets and tool calls are found with array
    # ops, and only rows where something happens reach Python (_record). 32 samples that run to their budget reach
    # it once each (when they end), not once per token; a streamed one reaches it for every token
    engine = Engine(tiny(), TOK, batch_size=32)
    calls = []
    record = engine._record
    engine._record = lambda s, *a: calls.append(s.handle) or record(s, *a)
    req = dict(max_tokens=20, seed=0, stop_tokens=[], use_tools=False)  # with tools a sampled <|python_end|> is watched
    h = engine.submit(Request([1, 2, 3], num_samples=32, **req))
    out = h.result()
    assert [len(c.tokens) for c in out] == [20] * 32 and len(calls) == 32
    calls.clear()
    events = list(engine.stream(Request([1, 2, 3], **req)))
    assert len(calls) == 20 and [e["token"] for e in events[:-1]] == out[0].tokens  # sample 0 of the same seed
