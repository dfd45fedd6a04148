"""Hugging Face import/export: tiny random Llama / Qwen2 / Qwen3 / NanoChat models built with transformers."""

import json
import os
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

import warm_python  # noqa: E402 (pytest puts tests/ on sys.path)

from nanorl.engine import Engine, Request  # noqa: E402
from nanorl.hf import export_hf, load_hf_model  # noqa: E402
from nanorl.tokenizer import HFTokenizer  # noqa: E402

VOCAB = 320  # > the tiny tokenizer's size, as Qwen's embedding has spare rows past its tokenizer

# Qwen2.5's template, shortened: a default system message, <|im_start|>role\n...<|im_end|>\n turns
QWEN_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CORPUS = [
    "What is 12 plus 30? The answer is 42.",
    "Hello there, how are you today?",
    "I am fine, thanks.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
] * 20


def tiny_tokenizer(directory, family="qwen"):
    """A byte-level BPE trained with `tokenizers` on a few sentences, saved as tokenizer.json + template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = (
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        if family == "qwen"
        else ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(
            vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": QWEN_TEMPLATE,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
    }
    if family == "llama":  # the template in chat_template.jinja, where newer transformers save it
        config.update(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
        del config["chat_template"]
        with open(os.path.join(directory, "chat_template.jinja"), "w") as f:
            f.write(LLAMA_TEMPLATE)
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return tok.get_vocab_size()


CONVERSATION = {
    "messages": [
        {"role": "user", "content": "What is 12 plus 30?"},
        {"role": "assistant", "content": "The answer is 42."},
        {"role": "user", "content": "Hello there, how are you today?"},
        {"role": "assistant", "content": "I am fine, thanks."},
    ]
}


def tiny_hf(kind, directory, seed=0, vocab=VOCAB, context=128):
    """A tiny random HF model saved to `directory`; norms and biases randomised too (their init is trivial)."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
    )
    if kind == "llama":
        cfg = transformers.LlamaConfig(
            **common,
            rms_norm_eps=1e-5,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        )
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=32)  # wider heads than hidden/heads, as Qwen3
        model = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(directory)
    return model.eval()


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.fp32("equal to fp32 rounding by design; bf16 rounds ~3e-3 relative")
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_import_logits_match_transformers(kind, tmp_path):
    ref = tiny_hf(kind, tmp_path)
    model, _ = load_hf_model(str(tmp_path))
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(ids)
        theirs = ref(ids).logits.float()
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() < 1e-4
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.fp32("equal to fp32 rounding by design; bf16 rounds ~3e-3 relative")
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_engine_greedy_and_logprobs_match_transformers(kind, tmp_path):
    """nanorl's engine generates what transformers' generate does (greedy), with log-probs equal to the trainer's."""
    ref = tiny_hf(kind, tmp_path)
    tiny_tokenizer(tmp_path, "llama" if kind == "llama" else "qwen")
    model, _ = load_hf_model(str(tmp_path))
    tok = HFTokenizer.load(str(tmp_path))
    prompt = tok.render_for_completion({"messages": [{"role": "user", "content": "What is 12 plus 30?"}]})
    with torch.no_grad():
        # an explicit attention mask: else generate masks out every prompt token equal to pad_token_id
        x = torch.tensor([prompt])
        want = ref.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=16,
            do_sample=False,
            min_new_tokens=16,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    ((c,),) = Engine(model, tok, batch_size=2).submit_and_wait(
        [Request(prompt, max_tokens=16, temperature=0, stop_tokens=[])]
    )
    assert c.tokens == want
    seq = torch.tensor([prompt + c.tokens])
    with torch.no_grad():
        lp = model.token_logprobs(seq[:, :-1], seq[:, 1:])[0, len(prompt) - 1 :]
    torch.testing.assert_close(torch.tensor(c.logprobs), lp, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["qwen", "llama"])
def test_chat_template_ids_and_mask(family, tmp_path):
    """render_conversation gives exactly apply_chat_template's ids; the mask covers each reply and its end token."""
    tiny_tokenizer(tmp_path, family)
    tok = HFTokenizer.load(str(tmp_path))
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ids, mask = tok.render_conversation(CONVERSATION)
    want = ref.apply_chat_template(CONVERSATION["messages"], tokenize=True, return_dict=False)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert ids == list(want)
    end = "<|im_end|>" if family == "qwen" else "<|eot_id|>"
    trained = [i for i, m in zip(ids, mask) if m]
    assert tok.decode(trained) == "The answer is 42." + end + "I am fine, thanks." + end
    prompt = tok.render_for_completion(CONVERSATION)  # the last reply dropped, a new assistant turn opened
    want = ref.apply_chat_template(
        CONVERSATION["messages"][:3], tokenize=True, add_generation_prompt=True, return_dict=False
    )
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert prompt == list(want)
    assert tok.encode_special("<|assistant_end|>") == ref.convert_tokens_to_ids(end)
    assert tok.encode_special("<|python_start|>") is None  # no tool tokens: no tool calls
    assert (
        tok.encode("a <|im_end|> b")
        == ref("a <|im_end|> b", add_special_tokens=False, split_special_tokens=True)["input_ids"]
    )
    assert tok.decode(tok.encode("Hello there, 42!")) == "Hello there, 42!"
    ids = tok.encode("Natalia sold clips – half as many ✓")
    assert b"".join(tok.decode_token_bytes(i) for i in ids) == "Natalia sold clips – half as many ✓".encode()
    assert tok.decode_token_bytes(tok.encode_special("<|assistant_end|>")) == end.encode()


def test_chat_template_that_rewrites_history_is_refused(tmp_path):
    """A template that renders an earlier reply differently once another follows (Qwen3 drops old <think>
    blocks) cannot give a loss mask by prefixes: a clear error, while single replies still render."""
    tiny_tokenizer(tmp_path)
    cfg_path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' and loop.last %}"
        "<think>\n\n</think>\n\n{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    cfg_path.write_text(json.dumps(cfg))
    tok = HFTokenizer.load(str(tmp_path))
    ids, mask = tok.render_conversation({"messages": CONVERSATION["messages"][:2]})
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "<think>\n\n</think>\n\nThe answer is 42.<|im_end|>"
    with pytest.raises(ValueError, match="renders an earlier reply differently"):
        tok.render_conversation(CONVERSATION)


@pytest.mark.fp32("equal to fp32 rounding by design; bf16 rounds ~3e-3 relative")
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_export_round_trip(kind, tmp_path):
    """import -> export -> transformers load gives the same logits; -> import again gives the same tensors."""
    src, out = tmp_path / "src", tmp_path / "out"
    ref = tiny_hf(kind, src)
    tiny_tokenizer(src)
    model, cfg = load_hf_model(str(src))
    export_hf(model, HFTokenizer.load(str(src)), str(out))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(back) is type(ref)
    ids = torch.randint(0, VOCAB, (1, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, ref(ids).logits)
    again, _ = load_hf_model(str(out))
    a, b = model.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert HFTokenizer.load(str(out)).render_conversation(CONVERSATION) == HFTokenizer.load(
        str(src)
    ).render_conversation(CONVERSATION)


@pytest.mark.fp32("calls the model outside autocast, as an fp32 reference (CUDA's layout runs it under autocast only)")
def test_export_nanorl_arch_as_nanochat(tmp_path):
    """A nanorl-architecture GPT exports as NanoChatForCausalLM with equal logits (rotary sign convention
    converted), its tokenizer as a real tokenizers file, and imports back to the same tensors."""
    from nanorl.gpt import GPTConfig, build_model
    from nanorl.tokenizer import Tokenizer

    tok = Tokenizer.train(iter(CORPUS), 300)
    torch.manual_seed(0)
    model = build_model(
        GPTConfig(sequence_len=64, vocab_size=tok.vocab_size, n_layer=2, n_head=4, n_kv_head=2, n_embd=64), "cpu"
    )
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))  # the zero-init output projections would hide attention/rotary
    model.eval()
    export_hf(model, tok, str(tmp_path))
    with open(tmp_path / "config.json") as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["NanoChatForCausalLM"] and cfg["max_position_embeddings"] == 64
    with open(tmp_path / "generation_config.json") as f:  # a reply ends at <|assistant_end|>, which also pads
        assert json.load(f) == {
            "bos_token_id": tok.get_bos_token_id(),
            "pad_token_id": tok.encode_special("<|assistant_end|>"),
            "eos_token_id": tok.encode_special("<|assistant_end|>"),
        }
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    ids = torch.randint(0, tok.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours, theirs = model(ids), back(ids).logits.float()
    assert (ours - theirs).abs().max().item() < 1e-4
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()
    again, _ = load_hf_model(str(tmp_path))
    a, b = model.state_dict(), again.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a) and a.keys() == b.keys()
    # plain greedy generate, no attention mask (as a user calls it): the engine's tokens. With <|bos|> as the pad id,
    # generate masked out the prompt's first token and wrote others
    prompt = tok.render_for_completion({"messages": CONVERSATION["messages"][:1]})
    engine = Engine(model, tok, batch_size=1)
    want = engine.submit_and_wait([Request(prompt, max_tokens=24, temperature=0.0)])[0][0].tokens
    plain = back.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24)[0, len(prompt) :].tolist()
    assert plain == want and len(want) == 24
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    text = "Natalia sold 48 clips, then half as many."
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
    conv = {"messages": CONVERSATION["messages"][:2]}
    want = hf_tok.apply_chat_template(conv["messages"], tokenize=True, return_dict=False)
    assert list(want["input_ids"] if hasattr(want, "keys") else want) == tok.render_conversation(conv)[0]


def test_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such directory"):
        load_hf_model(str(tmp_path / "nope"))
    tiny_hf("qwen2", tmp_path)
    cfg_path = tmp_path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, "architectures": ["MixtralForCausalLM"]}))
    with pytest.raises(ValueError, match=r"config.json: architecture MixtralForCausalLM is not supported"):
        load_hf_model(str(tmp_path))
    cfg_path.write_text(json.dumps({**cfg, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}))
    with pytest.raises(ValueError, match=r"config.json: Qwen2ForCausalLM with rope_type yarn is not supported"):
        load_hf_model(str(tmp_path))  # refused, never silently approximated
    cfg_path.write_text(json.dumps(cfg))
    # a sharded checkpoint whose index names a tensor its shard does not have
    os.rename(tmp_path / "model.safetensors", tmp_path / "model-00001-of-00001.safetensors")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model-00001-of-00001.safetensors"), "pt") as f:
        weight_map = {k: "model-00001-of-00001.safetensors" for k in f.keys()}
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(
        json.dumps(
            {"weight_map": {**weight_map, "model.layers.9.mlp.up_proj.weight": "model-00001-of-00001.safetensors"}}
        )
    )
    with pytest.raises(
        ValueError, match="model-00001-of-00001.safetensors does not match model.safetensors.index.json"
    ):
        load_hf_model(str(tmp_path))
    index.write_text(json.dumps({"weight_map": {**weight_map, "lm_head.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="lists shard model-00002-of-00002.safetensors"):
        load_hf_model(str(tmp_path))
    index.write_text(json.dumps({"weight_map": weight_map}))
    load_hf_model(str(tmp_path))  # the consistent index loads
    with pytest.raises(FileNotFoundError, match="tokenizer.json is missing"):
        HFTokenizer.load(str(tmp_path))


def test_architecture_from_architectures_or_model_type(tmp_path):
    """Either key names the architecture; a contradiction between them, neither, or an unknown one is one line
    naming config.json; a truncated weights file is one line naming it."""
    tiny_hf("qwen2", tmp_path)
    cfg_path = tmp_path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    bare = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    cfg_path.write_text(json.dumps({**bare, "model_type": "qwen2"}))
    model, got = load_hf_model(str(tmp_path))
    assert got["architectures"] == ["Qwen2ForCausalLM"] and model.config.attn_bias  # Qwen2's q/k/v biases
    cases = [
        (
            {**cfg, "model_type": "llama"},
            f"{cfg_path}: architectures[0] Qwen2ForCausalLM contradicts model_type "
            "'llama' (a Qwen2ForCausalLM has model_type 'qwen2')",
        ),
        (bare, f"{cfg_path} names no architecture (neither 'architectures' nor 'model_type')"),
        (
            {**bare, "model_type": "gpt2"},
            f"{cfg_path}: model_type 'gpt2' is not supported (supported: llama, qwen2, qwen3, nanochat)",
        ),
    ]
    for bad, message in cases:
        cfg_path.write_text(json.dumps(bad))
        with pytest.raises(ValueError) as e:
            load_hf_model(str(tmp_path))
        assert str(e.value) == message
    cfg_path.write_text(json.dumps(cfg))
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: len(weights.read_bytes()) // 2])
    with pytest.raises(RuntimeError, match=f"^{weights} is corrupt or truncated \\(SafetensorError: "):
        load_hf_model(str(tmp_path))


@pytest.mark.fp32("calls the model outside autocast, as an fp32 reference (CUDA's layout runs it under autocast only)")
def test_export_keeps_the_declared_context_every_eos_id_pad_and_generation_config(tmp_path, monkeypatch):
    """A Llama-3.1-style model (128k context, two end tokens, a pad token, sampling defaults) imported, saved as a
    checkpoint and exported by scripts.export_hf: transformers reads back the source's values, not the import's."""
    import runpy
    import sys

    from nanorl.checkpoint import save_checkpoint
    from nanorl.model_loading import load_model

    src, base, out = tmp_path / "src", tmp_path / "base", tmp_path / "out"
    tiny_hf("llama", src)
    tiny_tokenizer(src, "llama")  # <|begin_of_text|> 0 ... <|eot_id|> 3
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(
        json.dumps({**cfg, "max_position_embeddings": 131072, "eos_token_id": [0, 3], "pad_token_id": 2})
    )
    generation = {
        "bos_token_id": 0,
        "eos_token_id": [0, 3],
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.9,
        "transformers_version": "5",
    }
    (src / "generation_config.json").write_text(json.dumps(generation))
    monkeypatch.setenv("NANORL_BASE_DIR", str(base))
    model, _, meta = load_model("sft", "cpu", hf_model=str(src))
    assert model.config.sequence_len == 8192  # the rotary tables the import builds: capped
    save_checkpoint(str(base / "rl_checkpoints" / "llama"), 1, model.state_dict(), meta={**meta, "step": 1})
    monkeypatch.setattr(sys, "argv", ["export_hf.py", "-i", "rl", "-o", str(out)])
    runpy.run_module("scripts.export_hf", run_name="__main__")
    back = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert back.config.max_position_embeddings == 131072
    assert back.config.eos_token_id == [0, 3] and back.config.pad_token_id == 2
    assert back.config.bos_token_id == cfg["bos_token_id"]  # (LlamaConfig's default, 1: the source's word is kept)
    gen = back.generation_config
    assert (gen.eos_token_id, gen.pad_token_id, gen.do_sample, gen.temperature, gen.top_p) == (
        [0, 3],
        2,
        True,
        0.6,
        0.9,
    )
    ids = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (back(ids).logits - model(ids)).abs().max().item() < 1e-4


@pytest.mark.slow
def test_load_model_hf_checkpoint_and_export_script(tmp_path, monkeypatch):
    """load_model(hf_model=DIR) -> an optimizer step -> a checkpoint that reloads with the model's own tokenizer
    -> scripts.export_hf writes it back in its architecture (Qwen2, tied embeddings) with equal logits."""
    import sys

    from nanorl.checkpoint import save_checkpoint
    from nanorl.model_loading import load_model
    from nanorl.optim import build_optimizer

    src, base = tmp_path / "qwen", tmp_path / "base"
    tiny_hf("qwen2", src)
    tiny_tokenizer(src)
    monkeypatch.setenv("NANORL_BASE_DIR", str(base))
    model, tok, meta = load_model("sft", "cpu", phase="train", hf_model=str(src))
    assert model.training and isinstance(tok, HFTokenizer) and meta["tokenizer_dir"] == str(src)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied, as Qwen2.5's small sizes
    opt = build_optimizer(model)
    ids = torch.tensor([tok.render_conversation(CONVERSATION)[0]])
    model(ids[:, :-1], ids[:, 1:]).backward()
    opt.step()
    assert model.lm_head.weight is model.transformer.wte.weight  # still one tensor after the update
    save_checkpoint(str(base / "rl_checkpoints" / "qwen"), 1, model.state_dict(), meta={**meta, "step": 1})
    again, tok2, _ = load_model("rl", "cpu")
    assert isinstance(tok2, HFTokenizer) and tok2.vocab_size == tok.vocab_size
    with torch.no_grad():
        want = model(ids)
        assert torch.equal(again(ids), want)
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "NANORL_BASE_DIR": str(base)}
    warm_python.run(
        [sys.executable, "-m", "scripts.export_hf", "-i", "rl", "-o", str(tmp_path / "out")], env=env, check=True
    )
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    assert type(back).__name__ == "Qwen2ForCausalLM" and back.config.tie_word_embeddings
    with torch.no_grad():
        assert (back(ids).logits - want).abs().max().item() < 1e-4


def test_chat_web_serves_an_open_model(tmp_path):
    """chat_web's app on a --hf-model load answers a chat request with what transformers' greedy generate
    writes for the same chat, cut at the model's end-of-turn token."""
    from fastapi.testclient import TestClient

    from nanorl.model_loading import load_model
    from nanorl.openai_api import ServeConfig
    from scripts.chat_web import create_app

    # no spare embedding rows here: a random model would otherwise write tokens that decode to nothing
    ref = tiny_hf("qwen2", tmp_path, vocab=tiny_tokenizer(tmp_path))
    model, tok, meta = load_model("sft", "cpu", hf_model=str(tmp_path))
    messages = [{"role": "user", "content": "What is 12 plus 30?"}]
    x = torch.tensor([tok.render_for_completion({"messages": messages})])
    end = tok.encode_special("<|assistant_end|>")
    with torch.no_grad():
        out = ref.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False, eos_token_id=end, pad_token_id=end
        )[0, x.size(1) :].tolist()
    want = tok.decode([t for t in out if t != end])
    assert len(want) > 5  # a real reply to compare, not an immediate end of turn
    app = create_app([Engine(model, tok, batch_size=2)], tok, ServeConfig(max_tokens=64, model=meta["model_tag"]))
    try:
        with TestClient(app) as client:
            r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 12, "temperature": 0})
    finally:
        app.state.shutdown()
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == want


@pytest.mark.slow
def test_chat_rl_on_an_open_model(tmp_path):
    """chat_rl --hf-model: 3 GRPO steps on a tiny random Qwen2 directory with the offline curriculum, rendered with
    Qwen's chat template; sampler and trainer agree on-policy, the RL checkpoint keeps the model's tokenizer and
    exports back to a Qwen2 directory that transformers loads."""
    import sys

    src, base = tmp_path / "qwen", tmp_path / "base"
    tiny_hf("qwen2", src, vocab=tiny_tokenizer(src), context=1024)  # offline prompts + Qwen's system turn: ~310 tokens
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "NANORL_BASE_DIR": str(base), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "scripts.chat_rl",
        "--hf-model",
        str(src),
        "--levels",
        "1",
        "--num-rollouts",
        "3",
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "4",
        "--max-new-tokens",
        "8",
        "--eval-max-problems",
        "2",
        "--n-samples-per-eval-prompt",
        "2",
        "--pass-k",
        "1",
        "--engine-batch-size",
        "8",
        "--output-tag",
        "qwen",
        "--rm-type",
        "format",
        "--device-type",
        "cpu",
        "--lr-scale",
        "0.01",
    ]
    out = warm_python.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    hist = json.loads((base / "report" / "rl_history.json").read_text())
    assert [h["step"] for h in hist["train"]] == [1, 2, 3]
    assert all(h["train/train_rollout_logprob_abs_diff"] < 1e-4 for h in hist["train"])
    meta = json.loads(next((base / "rl_checkpoints" / "qwen").glob("meta_*.json")).read_text())
    assert meta["tokenizer_dir"] == str(src)
    warm_python.run(
        [sys.executable, "-m", "scripts.export_hf", "-i", "rl", "-o", str(tmp_path / "out")], env=env, check=True
    )
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert type(back).__name__ == "Qwen2ForCausalLM"


@pytest.mark.slow
@pytest.mark.fp32("calls the model outside autocast, as an fp32 reference (CUDA's layout runs it under autocast only)")
def test_the_docs_tool_loop_gives_chat_clis_answer(tmp_path):
    """docs/open_models.md's transformers loop, run as written on an exported model that calls the calculator: its
    greedy answer is chat_cli's (chat_turn on the engine, -t 0), character for character; plain `generate`, which
    runs no tool, is not (it guesses past <|python_end|>). The model is a 1-layer GPT that learned one tool-using
    reply, the tool's output masked out of the loss as in SFT, so only a caller that runs the tool gets it right."""
    import io
    import re

    from nanorl.gpt import GPTConfig, build_model
    from nanorl.tokenizer import SPLIT_PATTERN, Tokenizer
    from scripts.chat_cli import chat_turn

    tok = Tokenizer.from_ranks({bytes([i]): i for i in range(256)}, SPLIT_PATTERN)
    question = "What is 17 * 23?"
    reply = [
        {"type": "text", "text": "17 * 23 = "},
        {"type": "python", "text": "17 * 23"},
        {"type": "python_output", "text": "391"},
        {"type": "text", "text": "391.\n#### 391"},
    ]
    ids, mask = tok.render_conversation(
        {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]}
    )
    torch.manual_seed(0)
    model = build_model(
        GPTConfig(sequence_len=128, vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_kv_head=2, n_embd=64), "cpu"
    )
    x, y = torch.tensor([ids[:-1]]), torch.tensor([[t if m else -1 for t, m in zip(ids[1:], mask[1:])]])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(200):
        opt.zero_grad()
        model(x, y).backward()
        opt.step()
    model.eval()
    out = io.StringIO()
    chat_turn(
        Engine(model, tok, batch_size=1),
        tok,
        {"messages": [{"role": "user", "content": question}]},
        temperature=0.0,
        max_tokens=64,
        out=out,
    )
    assert out.getvalue() == "17 * 23 = <<17 * 23=391>>391.\n#### 391\n"  # it learned the reply, tool call included

    export_hf(model, tok, str(tmp_path / "model"))
    doc = (Path(__file__).resolve().parents[1] / "docs" / "open_models.md").read_text()
    code = re.search(r"## The calculator outside nanorl\n.*?```python\n(.*?)```", doc, re.S).group(1)
    code = code.replace('directory = "out/my-model"', f"directory = {str(tmp_path / 'model')!r}")
    code = code.replace('print(chat("What is 17 * 23?"))', "")
    space = {}
    exec(code, space)
    assert space["chat"](question, max_tokens=64) + "\n" == out.getvalue()
    hf, hf_tok = space["model"], space["tok"]
    prompt = hf_tok.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_dict=False
    )
    plain = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=64)[0, len(prompt) :]
    assert "<|python_end|><|output_start|>391" not in hf_tok.decode(plain)  # no tool ran: 391 is not what follows
