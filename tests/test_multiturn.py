"""Multi-turn tool rollouts (nanorl/multiturn.py) on rigged models that call a tool."""

import threading

import pytest
import torch
from rl_fixture_tools import tool_user_model

from nanorl.engine import Engine, Request
from nanorl.gpt import GPTConfig, build_model
from nanorl.multiturn import make_tool, multi_turn_generate, python_tool
from nanorl.tokenizer import SPLIT_PATTERN, Tokenizer

# a byte-level tokenizer needs no training, and "print(2+3)" is all different bytes
TOK = Tokenizer.from_ranks({bytes([i]): i for i in range(256)}, SPLIT_PATTERN)
SP = TOK.encode_special
A_END, PY_START, PY_END = SP("<|assistant_end|>"), SP("<|python_start|>"), SP("<|python_end|>")
OUT_START, OUT_END = SP("<|output_start|>"), SP("<|output_end|>")
VOCAB = 272
PROMPT = TOK.render_for_completion({"messages": [{"role": "user", "content": "hello"}]})


def output_span(text):
    return [OUT_START, *TOK.encode(text), OUT_END]


@pytest.mark.fp32("calls the model outside autocast, as an fp32 reference (CUDA's layout runs it under autocast only)")
@pytest.mark.parametrize("tool,code", [("calculator", "2+3"), ("python", "print(2+3)")])
def test_tool_episode_masks_exactly_the_model_tokens(tool, code):
    model = tool_user_model(TOK, code, A_END, VOCAB, strength=8.0, noise=0.02)
    engine = Engine(model, TOK, batch_size=4)
    [[c, c2]] = multi_turn_generate(
        engine, [Request(PROMPT, num_samples=2, max_tokens=40, temperature=0)], 3, make_tool(tool)
    )
    call = [PY_START, *TOK.encode(code), PY_END]
    assert c.tokens == call + output_span("5") + [A_END] and c.tokens == c2.tokens
    assert c.mask == [1] * len(call) + [0] * 3 + [1]  # the tool's tokens are not the model's
    assert (c.status, c.tool_calls, c.tool_errors, c.max_turns_hit) == ("completed", 1, 0, False)
    assert all(lp == 0.0 for lp, m in zip(c.logprobs, c.mask) if m == 0)
    # the engine's log-probs (first turn decoded from the cache, second re-prefilled) are the trainer's
    seq = torch.tensor([PROMPT + c.tokens])
    with torch.no_grad():
        lp = model.token_logprobs(seq[:, :-1], seq[:, 1:])[0, len(PROMPT) - 1 :]
    mask = torch.tensor(c.mask, dtype=torch.bool)
    assert torch.allclose(lp[mask], torch.tensor(c.logprobs)[mask], atol=1e-5)
    assert lp[mask].std() > 0.01  # the noise makes it a real comparison, not all the same number


def test_max_turns_ends_the_response():
    model = tool_user_model(TOK, "2+3", PY_START, VOCAB)  # after every output it calls again
    engine = Engine(model, TOK, batch_size=2)
    [[c]] = multi_turn_generate(engine, [Request(PROMPT, max_tokens=60, temperature=0)], 2, make_tool("calculator"))
    call = [PY_START, *TOK.encode("2+3"), PY_END]
    assert c.tokens == (call + output_span("5")) * 2 + call  # the third call is not run
    assert (c.status, c.tool_calls, c.max_turns_hit) == ("truncated", 2, True)


def test_calls_of_one_step_run_at_once():
    # each call waits until all 8 have started: run one after another, the first would wait forever (the barrier's
    # timeout breaks it, and every call then raises); no clock is read, so a loaded machine cannot fail it
    barrier = threading.Barrier(8, timeout=60)

    def waiting_tool(src):
        barrier.wait()
        return "5"

    engine = Engine(tool_user_model(TOK, "2+3", A_END, VOCAB), TOK, batch_size=8)
    [res] = multi_turn_generate(engine, [Request(PROMPT, num_samples=8, max_tokens=40, temperature=0)], 1, waiting_tool)
    assert all(c.tool_calls == 1 and c.tool_errors == 0 and c.status == "completed" for c in res)
    assert not barrier.broken


def test_tool_errors_and_the_length_budget():
    model = tool_user_model(TOK, "2/0", A_END, VOCAB)
    engine = Engine(model, TOK, batch_size=2)
    [[c]] = multi_turn_generate(engine, [Request(PROMPT, max_tokens=40, temperature=0)], 1, make_tool("calculator"))
    assert c.tool_errors == 1 and TOK.decode(c.tokens[5:-1]).startswith("<|output_start|>Error: division by zero")
    # a tool output that does not fit in max_tokens is cut, and the response ends truncated
    [[c]] = multi_turn_generate(engine, [Request(PROMPT, max_tokens=8, temperature=0)], 1, make_tool("calculator"))
    assert len(c.tokens) == 8 and c.mask == [1] * 5 + [0] * 3 and c.status == "truncated"
    # so does one that reaches the engine's context
    small = Engine(model, TOK, batch_size=2, max_len=len(PROMPT) + 7)
    [[c]] = multi_turn_generate(small, [Request(PROMPT, max_tokens=40, temperature=0)], 1, make_tool("calculator"))
    assert len(c.tokens) == 7 and c.status == "truncated"


def test_without_tool_calls_it_is_engine_generate():
    torch.manual_seed(0)
    model = build_model(
        GPTConfig(sequence_len=64, vocab_size=VOCAB, n_layer=1, n_head=2, n_kv_head=1, n_embd=32), "cpu"
    ).eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.2)
    engine = Engine(model, TOK, batch_size=8)
    reqs = [Request(PROMPT, num_samples=4, max_tokens=16, temperature=1.0, seed=s) for s in range(3)]
    plain = engine.submit_and_wait(reqs)
    multi = multi_turn_generate(engine, reqs, 2, make_tool("calculator"))
    pairs = [(a, b) for ga, gb in zip(plain, multi) for a, b in zip(ga, gb) if PY_END not in a.tokens]
    assert len(pairs) >= 8
    for a, b in pairs:
        assert (a.tokens, a.logprobs, a.mask, a.status) == (
            b.tokens,
            b.logprobs,
            b.mask,
            b.status,
        ) and b.tool_calls == 0


def test_bad_arguments():
    engine = Engine(tool_user_model(TOK, "1", A_END, VOCAB), TOK, batch_size=1)
    with pytest.raises(ValueError, match="max_turns"):
        multi_turn_generate(engine, [Request(PROMPT)], 0, make_tool("calculator"))
    with pytest.raises(ValueError, match="unknown tool"):
        make_tool("shell")
    assert python_tool("print(6*7)") == "42" and python_tool("1/0").startswith("Error: ZeroDivisionError")


@pytest.mark.fp32("calls the model outside autocast, as an fp32 reference (CUDA's layout runs it under autocast only)")
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_every_turn_records_the_trainers_logprobs_at_the_rollout_temperature(temperature):
    # the model's tokens of every turn (the first decoded from the shared prefill, later ones re-prefilled after a
    # forced tool output) carry log_softmax(logits / T): the trainer's log-probs at T, so TIS weights are 1
    model = tool_user_model(TOK, "2+3", A_END, VOCAB, strength=10.0, noise=0.02)
    engine = Engine(model, TOK, batch_size=4)
    [cs] = multi_turn_generate(
        engine,
        [Request(PROMPT, num_samples=4, max_tokens=40, temperature=temperature, seed=3)],
        2,
        make_tool("calculator"),
    )
    assert sum(c.tool_calls for c in cs) >= 2  # responses with a forced tool output and a second turn
    for c in cs:
        seq = torch.tensor([PROMPT + c.tokens])
        with torch.no_grad():
            lp = model.token_logprobs(seq[:, :-1], seq[:, 1:], temperature=temperature)[0, len(PROMPT) - 1 :]
        mask = torch.tensor(c.mask, dtype=torch.bool)
        torch.testing.assert_close(torch.tensor(c.logprobs)[mask], lp[mask], atol=1e-5, rtol=0)
        assert torch.exp(lp[mask] - torch.tensor(c.logprobs)[mask]).sub(1).abs().max() < 1e-5
