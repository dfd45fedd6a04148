"""nanorl/agents.py and function calling (nanorl/function_calls.py) through the official openai client: episodes on a
tiny engine (CPU), their calls merged into Samples, the drift case, tool calls in and out (streamed too), each fault
of an agent, and chat_rl --agent with 2 ranks and with --async."""

import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

openai = pytest.importorskip("openai")

import warm_python  # noqa: E402 (pytest puts tests/ on sys.path)
from tiny_checkpoints import save_random_sft, train_tokenizer  # noqa: E402

from nanorl import agents, function_calls  # noqa: E402
from nanorl.engine import Engine  # noqa: E402
from nanorl.gpt import GPTConfig, build_model  # noqa: E402
from nanorl.rl_config import GroupSpec, RolloutConfig, TrainerConfig  # noqa: E402
from nanorl.rl_trainer import collate_packed  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("agents")
    env = {**os.environ, "NANORL_BASE_DIR": str(d), "OMP_NUM_THREADS": "1"}
    train_tokenizer(env)
    save_random_sft(env, sequence_len=512)
    return d


@pytest.fixture(scope="module")
def tok(base_dir):
    from nanorl.tokenizer import Tokenizer

    return Tokenizer.load(str(base_dir / "tokenizer"))


@pytest.fixture(scope="module")
def random_model(base_dir):
    from nanorl.checkpoint import load_checkpoint

    weights, _, meta = load_checkpoint(str(base_dir / "sft_checkpoints" / "t"))[:3]
    model = build_model(GPTConfig(**meta["model_config"]), "cpu")
    model.load_state_dict(weights)
    return model.eval()


def bigram_model(next_of, vocab_size, strength=15.0, n_embd=64):
    """A GPT that writes next_of[t] after token t (the blocks' output projections start at zero, so each position
    sees only its own token, whose one-hot embedding picks a row of the lm_head), and anything after other tokens."""
    torch.manual_seed(0)
    cfg = GPTConfig(sequence_len=2048, vocab_size=vocab_size, n_layer=1, n_head=1, n_kv_head=1, n_embd=n_embd)
    model = build_model(cfg, "cpu")
    with torch.no_grad():
        model.transformer.wte.weight.zero_()
        model.lm_head.weight.zero_()
        for i, (a, b) in enumerate(next_of.items()):
            model.transformer.wte.weight[a, i] = 1.0
            model.lm_head.weight[b, i] = strength / n_embd**0.5
    return model.eval()


def endpoint(model, tokenizer, max_response_len=64, seed=7):
    engine = Engine(model, tokenizer, batch_size=8)
    return agents.Endpoint(engine, tokenizer, agents.EpisodeSettings(1.0, None, None, max_response_len, seed))


def trainer_logprobs_agree(model, sample, tol=1e-5, temperature=1.0):
    """The trainer's log-probs (log_softmax of its forward at the rollout's temperature, 1 in these tests) at the
    trained positions equal the ones the engine recorded."""
    batch = collate_packed([sample], [[0]])
    with torch.no_grad():
        logp = model.token_logprobs(batch["packed_inputs"], batch["packed_targets"], temperature=temperature)
    mask = batch["loss_mask"] > 0
    assert mask.sum() > 0
    diff = (logp[mask] - batch["rollout_logp"][mask]).abs().max().item()
    assert diff < tol, diff
    return diff


USER = [{"role": "user", "content": "What is 2 + 3?"}]
RETRY = {"role": "user", "content": "wrong, try again"}


# --- the merge of an episode's calls ----------------------------------------------------------------------------------


def test_two_turns_merge_into_one_sample_with_a_loss_mask_on_sampled_tokens(tok):
    """A reply sent back, then a new user message: one Sample, the hand-built one: prompt, reply, the user turn
    (mask 0), the second reply; log-probs at the trained positions as the trainer computes them."""
    sp = tok.encode_special
    reply = tok.encode(" 5")  # the bigram writes " 5" and ends its turn
    assert tok.encode(tok.decode(reply)) == reply  # no drift here
    chain = [sp("<|assistant_start|>"), *reply, sp("<|assistant_end|>")]
    model = bigram_model(dict(zip(chain, chain[1:])), tok.vocab_size)
    ep = endpoint(model, tok)
    client = agents.client(ep)
    first = client.chat.completions.create(model="any", messages=USER)
    assert first.choices[0].message.content == " 5" and first.choices[0].finish_reason == "stop"
    messages = USER + [first.choices[0].message, RETRY]  # the client's own message object, sent back as it came
    chunks = list(client.chat.completions.create(model="any", messages=messages, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == " 5"
    assert chunks[-1].choices[0].finish_reason == "stop"

    prompt = tok.render_for_completion({"messages": USER})
    user_turn = [sp("<|user_start|>"), *tok.encode("wrong, try again"), sp("<|user_end|>"), sp("<|assistant_start|>")]
    want = prompt + reply + [sp("<|assistant_end|>")] + user_turn + reply + [sp("<|assistant_end|>")]
    want_mask = [1] * (len(reply) + 1) + [0] * len(user_turn) + [1] * (len(reply) + 1)
    assert len(ep.chains) == 1 and ep.calls == 2
    c = ep.chains[0]
    assert c.tokens == want and c.prompt_len == len(prompt) and c.mask == want_mask
    assert c.logprobs[len(reply) + 1 : len(reply) + 1 + len(user_turn)] == [0.0] * len(user_turn)
    # the re-rendered history is the same here: the merge did not need the recorded ids
    full = tok.render_for_completion({"messages": USER + [{"role": "assistant", "content": " 5"}, RETRY]})
    assert want[: len(full)] == full


def test_drift_keeps_the_sampled_ids(tok, random_model):
    """The model writes a word as two tokens that re-encode as one, and its first reply is cut by max_tokens: the
    second call's prompt is the first prompt + the ids sampled + the end of turn (forced, mask 0) + the new message,
    never the re-tokenized history; the trainer's log-probs on that sequence are the engine's."""
    sp = tok.encode_special

    def split(t):  # a token whose text is two other tokens: (a, b), else None
        text = tok.decode([t])
        a, b = tok.encode(text[:1]), tok.encode(text[1:])
        ok = text.isascii() and len(text) >= 2 and tok.encode(text) == [t] and len(a) == len(b) == 1 and a != b
        return (a, b) if ok else None

    merged = next(t for t in range(256, tok.vocab_size - 9) if split(t))
    (a, b), text = split(merged), tok.decode([merged])
    chain = [sp("<|assistant_start|>"), a[0], b[0], sp("<|assistant_end|>")]
    ep = endpoint(bigram_model(dict(zip(chain, chain[1:])), tok.vocab_size), tok)
    client = agents.client(ep)
    first = client.chat.completions.create(model="any", messages=USER, max_tokens=2)
    assert first.choices[0].message.content == text and first.choices[0].finish_reason == "length"
    second = client.chat.completions.create(model="any", messages=USER + [first.choices[0].message, RETRY])
    assert second.choices[0].message.content == text

    rendered = tok.render_for_completion({"messages": USER + [{"role": "assistant", "content": text}, RETRY]})
    assert merged in rendered  # what re-rendering would have given
    prompt = tok.render_for_completion({"messages": USER})
    user_turn = [sp("<|user_start|>"), *tok.encode("wrong, try again"), sp("<|user_end|>"), sp("<|assistant_start|>")]
    c = ep.chains[0]
    assert c.tokens == prompt + a + b + [sp("<|assistant_end|>")] + user_turn + a + b + [sp("<|assistant_end|>")]
    assert c.mask == [1, 1, 0] + [0] * len(user_turn) + [1, 1, 1]  # the forced end of the cut reply is not trained

    # on a random model: every call of a multi-turn episode has the trainer's log-probs at its sampled tokens
    ep = endpoint(random_model, tok, max_response_len=120)
    client = agents.client(ep)
    messages, plain = list(USER), list(USER)
    for _ in range(3):
        r = client.chat.completions.create(model="any", messages=messages, max_tokens=12)
        messages += [r.choices[0].message, RETRY]
        plain += [{"role": "assistant", "content": r.choices[0].message.content}, RETRY]
    assert len(ep.chains) == 1 and ep.chains[0].calls == 3
    [sample] = agents.group([episode_of(ep, 1.0)], [0, 0])
    rerendered = tok.render_for_completion({"messages": plain})
    assert sample.tokens[: len(rerendered)] != rerendered  # the random model's replies do not re-encode as sampled
    trainer_logprobs_agree(random_model, sample)


def episode_of(ep, score, index=0):
    e = agents.Episode(ep, {"conversation": {"messages": USER}, "label": "5", "metadata": {"row": 0}}, 11, index)
    e.result = (score, None)
    return e


def test_a_call_that_continues_nothing_is_a_sample_of_its_own_and_groups_are_layered(tok, random_model):
    """An episode with a second, unrelated conversation gives two Samples; beside an episode of one, the group is laid
    out in layers of one Sample per episode (a filler that is never trained on where an episode has none), so every
    run of n Samples carries the episodes' rewards and GRPO gives each Sample its episode's advantage."""
    from nanorl import rl

    two, one = endpoint(random_model, tok, seed=1), endpoint(random_model, tok, seed=2)
    for ep, talks in ((two, [USER, [{"role": "user", "content": "hello"}]]), (one, [USER])):
        for messages in talks:
            agents.client(ep).chat.completions.create(model="any", messages=messages, max_tokens=6)
    assert len(two.chains) == 2 and len(one.chains) == 1
    group = agents.group([episode_of(two, 1.0, 0), episode_of(one, 0.0, 1)], [0, 0])
    assert len(group) == 4 and [s.reward for s in group] == [1.0, 0.0, 1.0, 0.0]
    assert group[3].metadata.get("filler") and group[3].loss_mask == [0] and len(group[3].tokens) == 2
    assert group[2].tokens[: group[2].prompt_length] == tok.render_for_completion(
        {"messages": [{"role": "user", "content": "hello"}]}
    )
    adv = rl.grpo_advantages(torch.tensor([s.reward for s in group]), torch.ones(4, 1), 2).squeeze(1)
    assert adv[0] == adv[2] > 0 > adv[1] == adv[3]


def test_the_example_agent(tok):
    """examples/retry_agent.py, sync and async, on a model that always answers "####5": right at once (1.0, one
    call), or wrong twice (0.0, two calls merged into one sample)."""
    from examples.retry_agent import agent, async_agent

    sp = tok.encode_special
    reply = tok.encode("####5")
    assert len(set(reply)) == len(reply)
    chain = [sp("<|assistant_start|>"), *reply, sp("<|assistant_end|>")]
    engine = Engine(bigram_model(dict(zip(chain, chain[1:])), tok.vocab_size), tok, batch_size=8)
    items = prompts_of(5)[3:]  # labels "4" and "5"
    cfg = RolloutConfig(group=GroupSpec(n_samples_per_prompt=2, max_response_len=64))
    for fn in (agent, async_agent):
        wrong, right = agents.AgentRollout(fn, timeout=60)(cfg, engine, tok, items, [1, 2])
        assert [s.reward for s in right] == [1.0, 1.0] and [s.metadata["calls"] for s in right] == [1, 1]
        assert [s.reward for s in wrong] == [0.0, 0.0] and [s.metadata["calls"] for s in wrong] == [2, 2]
        assert tok.decode(wrong[0].tokens[wrong[0].prompt_length :]).count("wrong, try again") == 1


def test_a_layered_rollout_is_trained_whole_in_minibatches_of_whole_groups(tok, random_model):
    """With --num-steps-per-rollout 2, a rollout of 3 groups of n = 3 (9 Samples, as layers make) is cut into
    mini-batches of whole groups that cover all of it (the cut once took len // steps Samples each, and dropped the
    last one)."""
    from nanorl import rl_trainer
    from nanorl.logger import Timer
    from nanorl.optim import build_optimizer

    ep = endpoint(random_model, tok)
    agents.client(ep).chat.completions.create(model="any", messages=USER, max_tokens=4)
    samples = [s for e in range(9) for s in agents.group([episode_of(ep, float(e % 2), e)], [0, 0])]
    cfg = TrainerConfig(group=GroupSpec(n_samples_per_prompt=3, max_response_len=64), num_steps_per_rollout=2)
    trainer = rl_trainer.Trainer(cfg, random_model, build_optimizer(random_model), torch.device("cpu"))
    seen = []
    trainer.train_minibatch = lambda batch, *a, **k: seen.append(len(batch)) or {"pg_loss": 0.0}
    trainer.train_step(0, samples, Timer())
    assert seen == [3, 6]


# --- the rollout: groups, sync and async agents, faults ---------------------------------------------------------------


def prompts_of(n):
    return [
        {
            "conversation": {"messages": [{"role": "user", "content": f"What is {i} + 1?"}]},
            "label": str(i + 1),
            "metadata": {"task": "t", "split": "train", "row": i},
        }
        for i in range(n)
    ]


def two_turns(client, item):
    messages = list(item["messages"])
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=8)
    messages += [r.choices[0].message, {"role": "user", "content": "wrong, try again"}]
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=8)
    return {"total": len(r.choices[0].message.content) % 3 / 2, "length": float(len(r.choices[0].message.content))}


async def two_turns_async(client, item):
    messages = list(item["messages"])
    r = await client.chat.completions.create(model="m", messages=messages, max_tokens=8)
    messages += [r.choices[0].message, {"role": "user", "content": "wrong, try again"}]
    r = await client.chat.completions.create(model="m", messages=messages, max_tokens=8)
    return {"total": len(r.choices[0].message.content) % 3 / 2, "length": float(len(r.choices[0].message.content))}


def test_agent_rollout_groups_and_the_async_variant_agree(tok, random_model):
    """Each prompt's n episodes are its group, one Sample each (two turns merged), scored by the agent; the async agent
    on openai.AsyncOpenAI samples exactly the same tokens (the calls' seeds come from the rollout's)."""
    cfg = RolloutConfig(group=GroupSpec(n_samples_per_prompt=3, max_response_len=64))
    engine = Engine(random_model, tok, batch_size=8)
    groups = agents.AgentRollout(two_turns, timeout=60)(cfg, engine, tok, prompts_of(2), [5, 6])
    again = agents.AgentRollout(two_turns_async, timeout=60)(cfg, engine, tok, prompts_of(2), [5, 6])
    assert [len(g) for g in groups] == [3, 3]
    for g, h in zip(groups, again):
        for s, t in zip(g, h):
            assert s.tokens == t.tokens and s.loss_mask == t.loss_mask  # log-probs: up to the batch's float noise
            assert max(abs(x - y) for x, y in zip(s.rollout_log_probs, t.rollout_log_probs)) < 1e-5
            assert s.reward == t.reward and s.metadata["calls"] == 2
            assert set(s.reward) == {"total", "length"}  # the agent's own score, components and all
            trainer_logprobs_agree(random_model, s)
    assert len({tuple(s.tokens) for g in groups for s in g}) == 6  # every episode its own random stream


def faulty(client, item, release, counts, lock):
    """The first episode of each prompt fails in its own way (by row); the others run two turns."""
    row = item["metadata"]["row"]
    with lock:
        first, counts[row] = row not in counts, True
    if first and row == 0:
        raise RuntimeError("the tool crashed\nwhile parsing")
    if first and row == 1:
        release.wait(60)  # hangs past the timeout
    if first and row == 2:
        client.chat.completions.create(model="m", messages=item["messages"], max_tokens=4)
        return "three"
    if first and row == 3:
        client.chat.completions.create(model="m", messages=item["messages"], temperature=0.3)
    if first and row == 4:
        client.chat.completions.create(model="m", messages=item["messages"], max_tokens=4)
        raise SystemExit(3)
    return two_turns(client, item)


def test_each_fault_loses_its_episode_only(tok, random_model, capsys):
    """An agent that raises, hangs past the timeout, returns a non-number, makes a bad request or calls exit() loses
    that episode alone: one line each, with the exception's last line; its Samples stay in the group, never trained
    on (loss mask 0), at the group's mean reward; the rollout returns soon after the timeout; a hung agent's later
    calls are refused."""
    release, counts, lock = threading.Event(), {}, threading.Lock()
    rollout = agents.AgentRollout(lambda c, i: faulty(c, i, release, counts, lock), timeout=3)
    cfg = RolloutConfig(group=GroupSpec(n_samples_per_prompt=2, max_response_len=64))
    engine = Engine(random_model, tok, batch_size=8)
    t0 = time.time()
    try:
        groups = rollout(cfg, engine, tok, prompts_of(5), [1, 2, 3, 4, 5])
    finally:
        release.set()
    assert time.time() - t0 < 15
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("agent: lost an episode")]
    assert len(lines) == 5, lines
    for line, why in zip(
        sorted(lines),
        [
            "RuntimeError: the tool crashed",
            "ran past --agent-timeout 3s",
            "returned reward is not a finite number: 'three'",
            "BadRequestError: Error code: 400",
            "SystemExit: 3",
        ],
    ):
        assert why in line, (line, why)
    assert "'temperature' 0.3: an episode samples at the rollout's temperature 1" in sorted(lines)[3]
    for g in groups:
        lost, kept = sorted(g, key=lambda s: "agent_error" not in s.metadata)
        assert "agent_error" in lost.metadata and "agent_error" not in kept.metadata
        assert sum(lost.loss_mask) == 0 and lost.scalar_reward() == kept.scalar_reward()
        assert sum(kept.loss_mask) > 0 and kept.metadata["calls"] == 2
    m = rollout.metrics([s for g in groups for s in g])
    assert m["rollout/agent_lost_frac"] == 0.5
    time.sleep(0.2)  # the hung agent, released, now calls its closed endpoint: refused, and the engine is left alone
    assert not engine.pending and all(s is None for s in engine.slots)


# --- function calling: a Qwen-style template ----------------------------------------------------------------------


# Qwen2.5's tool format (shortened): tools in the system turn, calls as <tool_call> blocks, results as user turns
QWEN_TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}You are a helpful assistant."
    "{%- endif %}{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + tool_call.name + \'", "arguments": \' + tool_call.arguments | tojson'
    " + '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CALL = '\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'  # one added token of the fixture: a bigram can write it
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
        },
    }
]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """A Qwen-style tokenizer (byte-level BPE, <|im_start|>/<|im_end|>, <tool_call> added tokens) with the tool
    template, and a bigram GPT that answers every assistant turn with one call: add(a=1, b=2)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    from nanorl.tokenizer import HFTokenizer

    d = tmp_path_factory.mktemp("qwen")
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    corpus = ["What is 2 + 3? You are a helpful assistant. The answer is 5.", "wrong, try again"] * 20
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    t.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=specials, initial_alphabet=alphabet)
    )
    t.add_tokens([AddedToken(x, normalized=False) for x in ("<tool_call>", "</tool_call>", CALL)])
    t.save(str(d / "tokenizer.json"))
    config = {"chat_template": QWEN_TOOLS_TEMPLATE, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    (d / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "PreTrainedTokenizerFast"}))
    tok = HFTokenizer.load(str(d))
    gen = tok.render_messages(USER, TOOLS)[-1]  # the last token of every generation prompt
    ids = [tok.encode_special(x) for x in ("<tool_call>", CALL, "</tool_call>", "<|im_end|>")]
    model = bigram_model(dict(zip([gen, *ids], ids)), tok.vocab_size)
    return dict(dir=d, tok=tok, model=model, call_ids=ids)


def test_the_qwen_fixture_renders_tools_as_transformers_does(qwen):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(qwen["dir"]))
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    messages = USER + [{"role": "assistant", "content": None, "tool_calls": [call]}]
    messages += [{"role": "tool", "tool_call_id": "c1", "content": "3"}]
    want = ref.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert qwen["tok"].render_messages(messages, TOOLS) == list(want)
    assert function_calls.tool_format(qwen["tok"]) == "hermes"


def tool_round_trip(client, stream):
    """A call with tools -> add(a=1, b=2), then its result sent back -> the model calls again. Returns both replies'
    (content, tool_calls as dicts, finish_reason)."""

    def ask(messages):
        r = client.chat.completions.create(model="any", messages=messages, tools=TOOLS, stream=stream)
        if not stream:
            m = r.choices[0].message
            return m.content, [c.model_dump() for c in m.tool_calls or []], r.choices[0].finish_reason
        content, calls, finish = "", {}, None
        for chunk in r:
            for c in chunk.choices:
                content += c.delta.content or ""
                for tc in c.delta.tool_calls or []:  # as a client accumulates them
                    calls.setdefault(
                        tc.index, {"id": tc.id, "type": tc.type, "function": {"name": "", "arguments": ""}}
                    )
                    calls[tc.index]["function"]["name"] += tc.function.name or ""
                    calls[tc.index]["function"]["arguments"] += tc.function.arguments or ""
                finish = c.finish_reason or finish
        return content or None, [calls[k] for k in sorted(calls)], finish

    content, calls, finish = ask(USER)
    assert content is None and finish == "tool_calls" and len(calls) == 1
    assert calls[0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    messages = USER + [{"role": "assistant", "content": None, "tool_calls": calls}]
    messages += [{"role": "tool", "tool_call_id": calls[0]["id"], "content": "3"}]
    again = ask(messages)
    assert again[2] == "tool_calls" and again[1][0]["function"] == calls[0]["function"]
    return messages


@pytest.mark.parametrize("stream", [False, True])
def test_function_calling_round_trip_in_an_episode(qwen, stream):
    """tools in, tool_calls out (streamed too), the tool's result in as role "tool": one Sample, the hand-built one
    (the template's rendering of the whole exchange), trained on the two calls only."""
    tok = qwen["tok"]
    ep = endpoint(qwen["model"], tok)
    messages = tool_round_trip(agents.client(ep), stream)
    call = {"id": "x", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    full = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]}, messages[-1]]
    prompt = tok.render_messages(USER, TOOLS)
    want = tok.render_messages(full, TOOLS) + qwen["call_ids"]
    [chain] = ep.chains
    assert chain.tokens == want and chain.prompt_len == len(prompt)
    between = len(want) - len(prompt) - 8  # the tool's result as the template renders it
    assert chain.mask == [1] * 4 + [0] * between + [1] * 4
    assert tok.decode(want[len(prompt) + 4 : len(want) - 4]) == (
        "\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("stream", [False, True])
def test_function_calling_in_chat_web(qwen, stream):
    """The same round trip against chat_web's API over HTTP."""
    from test_chat_web import serve

    from nanorl.openai_api import ServeConfig
    from scripts.chat_web import create_app

    engines = [Engine(qwen["model"], qwen["tok"], batch_size=4)]
    app = create_app(engines, qwen["tok"], ServeConfig(max_tokens=16, model="any"))
    with serve(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
        tool_round_trip(client, stream)
        # tool_choice "none": no tools shown and the reply read as text
        r = client.chat.completions.create(model="any", messages=USER, tools=TOOLS, tool_choice="none", max_tokens=4)
        assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")


def test_tool_choice_forces_the_start_of_a_call_and_templates_without_tools_are_refused(qwen, tok):
    from nanorl.openai_api import BadRequest, ServeConfig, prepare

    def ids(tokenizer, **body):
        raw = json.dumps({"messages": USER, "tools": TOOLS, **body}).encode()
        return prepare(raw, tokenizer, ServeConfig(), 2048)[1]

    plain = qwen["tok"].render_messages(USER, TOOLS)
    named = ids(qwen["tok"], tool_choice={"type": "function", "function": {"name": "add"}})
    assert named == qwen["tok"].render_messages(USER, TOOLS, reply_prefix='<tool_call>\n{"name": "add", "arguments": ')
    assert named[: len(plain)] == plain and len(named) > len(plain)
    assert ids(qwen["tok"], tool_choice="required")[len(plain)] == qwen["tok"].encode_special("<tool_call>")
    with pytest.raises(BadRequest, match="names 'sub', which is not one of the tools"):
        ids(qwen["tok"], tool_choice={"type": "function", "function": {"name": "sub"}})
    with pytest.raises(BadRequest, match="nanorl's own format"):
        ids(tok)
    no_tools = type(qwen["tok"])(qwen["tok"].tok, "{{ messages[0]['content'] }}", qwen["tok"].special_map)
    with pytest.raises(BadRequest, match="does not render tools"):
        ids(no_tools)


def test_calls_are_read_back_as_the_model_cards_write_them():
    """hermes (Qwen): text, then <tool_call> blocks; llama3_json (Llama 3.x): the reply is the JSON call(s); a call
    that does not parse is text. Streamed, text that may become a call is held back until the reply ends."""
    parse = function_calls.parse_calls
    one = '{"name": "add", "arguments": {"a": 1}}'
    assert parse(f"Let me add.\n<tool_call>\n{one}\n</tool_call>", "hermes") == (
        "Let me add.\n",
        [{"name": "add", "arguments": '{"a": 1}'}],
    )
    two = parse(f"<tool_call>{one}</tool_call>\n<tool_call>\n{one}\n</tool_call>", "hermes")
    assert two[0] is None and len(two[1]) == 2
    assert parse("<tool_call>\n{not json}\n</tool_call>", "hermes") == ("<tool_call>\n{not json}\n</tool_call>", [])
    assert parse('<tool_call>\n{"arguments": {}}\n</tool_call>', "hermes")[1] == []  # no name
    llama = '{"name": "add", "parameters": {"a": 1}}'
    assert parse(llama, "llama3_json") == (None, [{"name": "add", "arguments": '{"a": 1}'}])
    assert len(parse(f"<|python_tag|>{llama}; {llama}", "llama3_json")[1]) == 2
    assert parse("The sum is {a}.", "llama3_json") == ("The sum is {a}.", [])

    plan = function_calls.ToolPlan("hermes")
    s = function_calls.ReplyStream(0, plan)
    out = s.push("Sure.\n<tool") + s.push("_call>\n" + one) + s.push("\n</tool_call>")
    assert [d["delta"] for d in out] == [{"content": "Sure.\n"}]
    end = s.end("stop")
    assert end[-1]["finish_reason"] == "tool_calls" and end[-1]["delta"]["tool_calls"][0]["function"]["name"] == "add"
    s = function_calls.ReplyStream(0, function_calls.ToolPlan("llama3_json"))
    assert s.push(" {") == [] and s.end("stop")[0]["delta"] == {"content": " {"}  # not a call after all: text
    t = function_calls.ToolPlan("hermes")
    assert (
        function_calls.tool_format(type("T", (), {"chat_template": "{{ tools }}<|start_header_id|>"})) == "llama3_json"
    )
    assert function_calls.chat_choice(0, function_calls.reply_message("hi", t), "length")["finish_reason"] == "length"


# --- chat_rl --agent ------------------------------------------------------------------------------------------------


def run_agent_rl(base_dir, *extra, nproc=1, agent="tests/rl_fixture_agent.py:vowel_agent"):
    env = {**os.environ, "NANORL_BASE_DIR": str(base_dir), "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd = (launch if nproc > 1 else [sys.executable]) + [
        "-m",
        "scripts.chat_rl",
        *("--source sft --model-tag t --levels 1 --rollout-batch-size 2 --n-samples-per-prompt 4").split(),
        *("--max-new-tokens 40 --eval-max-problems 2 --n-samples-per-eval-prompt 2 --pass-k 1,2").split(),
        *("--lr-scale 1.0 --engine-batch-size 16 --device-type cpu --agent-timeout 120").split(),
        "--agent",
        agent,
        *extra,
    ]
    out = warm_python.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads((base_dir / "report" / "rl_history.json").read_text()), out.stdout


@pytest.mark.parametrize(
    "flags,msg",
    [
        (["--agent", "no_such_mod:fn"], "--agent 'no_such_mod:fn': could not import 'no_such_mod'"),
        (["--agent", "examples/retry_agent.py:nope"], "has no function 'nope'; expected nope(client, item)"),
        (["--agent-timeout", "5"], "--agent-timeout is only used with --agent"),
        (["--agent", "examples/retry_agent.py:agent", "--multi-turn"], "--agent and --multi-turn cannot be combined"),
        (["--agent", "builtins:print", "--custom-generate-function-path", "builtins:print"], "cannot be combined"),
        (["--agent", "examples/retry_agent.py:agent", "--rm-type", "math"], "--agent scores its own episodes"),
        (["--agent", "examples/retry_agent.py:agent", "--agent-timeout", "-1"], "argument --agent-timeout"),
    ],
)
def test_agent_flags_are_refused_in_one_line(base_dir, flags, msg, monkeypatch):
    from test_chat_rl import refused_before_setup

    code, stdout, stderr = refused_before_setup(base_dir, ["--source", "sft", "--model-tag", "t", *flags], monkeypatch)
    assert code == 2 and msg in stderr and "Traceback" not in stderr, stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["2 ranks", "async"])
def test_chat_rl_agent(base_dir, mode):
    """--agent on a random model: two steps on 2 ranks, and with --async (rank 0 samples, rank 1 trains); on-policy the
    recorded log-probs are the trainer's across the episodes' turns."""
    extra = ["--async", "--use-tis"] if mode == "async" else []
    hist, log = run_agent_rl(base_dir, "--num-rollouts", "2", "--output-tag", mode.replace(" ", "_"), *extra, nproc=2)
    assert [h["step"] for h in hist["train"]] == [1, 2]
    for h in hist["train"]:
        assert h["rollout/agent_lost_frac"] == 0 and h["rollout/agent_calls_mean"] == 2
        assert h["train/grad_norm"] > 0
    assert "| agent lost 0/8 calls " in log
    if mode != "async":  # --async samples rollout 2 with the weights before step 1's update
        assert all(h["train/train_rollout_logprob_abs_diff"] < 1e-5 for h in hist["train"])
    assert "step 00000 | eval on 2 prompts x 2 samples" in log
