"""LoRA (nanorl/lora.py): the adapted forward against the dense W + (alpha/r) B A, exact step 0, frozen base,
the engine sampling through the live adapters, merge and the checkpoint/PEFT formats."""

import copy
import os

import pytest
import torch
import warm_python  # pytest puts tests/ on sys.path

from nanorl.engine import Engine, Request
from nanorl.gpt import GPTConfig, build_model
from nanorl.lora import (
    LoraConfig,
    Reference,
    adapter_params,
    apply_lora,
    base_state_dict,
    build_lora_optimizer,
    is_lora,
    load_lora_state_dict,
    lora_layers,
    lora_state_dict,
    merge_lora,
    peft_state_dict,
)
from nanorl.tokenizer import SPLIT_PATTERN, Tokenizer

TOK = Tokenizer.from_ranks({bytes([i]): i for i in range(256)}, SPLIT_PATTERN)
VOCAB = 272
SWIGLU = dict(mlp="swiglu", mlp_hidden=96, norm_weight=True, attn_bias=True, qk_norm=False, softcap=0.0)  # Qwen2-like


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = GPTConfig(sequence_len=64, vocab_size=VOCAB, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, **kw)
    model = build_model(cfg, "cpu")
    with torch.no_grad():  # init zeroes the output projections and shrinks the head: perturb, so every layer matters
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
        model.lm_head.weight.mul_(20)
    return model


def randomize_adapters(model, scale=0.05):
    with torch.no_grad():
        for p in adapter_params(model):
            p.copy_(scale * torch.randn_like(p))


def batch(seed=1, B=3, T=20):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (B, T + 1), generator=g)


@pytest.mark.fp32("calls the model outside autocast, as an fp32 reference (CUDA's layout runs it under autocast only)")
@pytest.mark.parametrize("arch", [{}, SWIGLU])
def test_forward_equals_dense_weights_with_the_update_materialised(arch):
    # the reference: a plain GPT whose target weights are W + (alpha/r) B A, computed here by hand
    base = tiny(**arch)
    model = apply_lora(copy.deepcopy(base), LoraConfig(rank=4, alpha=12, targets="qkv,o,mlp"))
    randomize_adapters(model)
    dense = copy.deepcopy(base)
    wrapped = dict(lora_layers(model))
    assert len(wrapped) == 2 * (4 + 3 if arch else 4 + 2)  # c_q,c_k,c_v,c_proj + the MLP's (c_gate only in SwiGLU)
    with torch.no_grad():
        for name, m in wrapped.items():
            w = dense.get_submodule(name).weight
            w.add_((3.0 * m.lora_B.weight) @ m.lora_A.weight)  # alpha / r = 12 / 4
    x = batch()[:, :-1]
    with torch.no_grad():
        got, want = model(x), dense(x)
    assert not torch.allclose(got, base(x))  # the adapters do change the output
    assert (got - want).abs().max() <= 1e-6 * want.abs().max()


def test_targets_select_the_layers_and_bad_config_is_refused():
    model = apply_lora(tiny(**SWIGLU), LoraConfig(rank=2, alpha=2, targets=("o",)))
    assert [n for n, _ in lora_layers(model)] == ["transformer.h.0.attn.c_proj", "transformer.h.1.attn.c_proj"]
    with pytest.raises(ValueError, match="unknown LoRA targets attn"):
        LoraConfig(targets="qkv,attn")
    with pytest.raises(ValueError, match="rank must be >= 1"):
        LoraConfig(rank=0)
    with pytest.raises(ValueError, match="already has LoRA"):
        apply_lora(model, LoraConfig())


@pytest.mark.fp32("calls the model outside autocast, as an fp32 reference (CUDA's layout runs it under autocast only)")
def test_step_zero_is_the_base_model_bit_for_bit():
    base = tiny(**SWIGLU)
    model = apply_lora(copy.deepcopy(base), LoraConfig(rank=8, alpha=16))
    x = batch()
    with torch.no_grad():
        assert torch.equal(model(x), base(x))
        assert torch.equal(model.token_logprobs(x[:, :-1], x[:, 1:]), base.token_logprobs(x[:, :-1], x[:, 1:]))
    assert all(not p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 on the CPU, base and adapters


def policy_step(model, optimizer, x):
    """One step of a policy-gradient-shaped loss through GPT.token_logprobs (the RL trainer's path)."""
    logp = model.token_logprobs(x[:, :-1], x[:, 1:])
    loss = -(logp * torch.linspace(-1, 1, x.size(0))[:, None]).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_only_adapters_change_and_the_base_is_bit_identical():
    model = apply_lora(tiny(), LoraConfig(rank=4, alpha=8))
    base_before = {k: v.clone() for k, v in base_state_dict(model).items()}
    lora_before = {k: v.clone() for k, v in lora_state_dict(model).items()}
    optimizer = build_lora_optimizer(model, lr=1e-2)
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(lora_before)
    for s in range(2):  # B = 0 makes A's first gradient zero: A moves from the second step on
        policy_step(model, optimizer, batch(seed=s))
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base_before.items())
    assert all(not torch.equal(after[k], v) for k, v in lora_before.items())
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.fp32("calls the model outside autocast, as an fp32 reference (CUDA's layout runs it under autocast only)")
def test_reference_is_the_base_with_adapters_off():
    # the KL reference of a LoRA run: the trained model with its adapters skipped gives the base's log-probs exactly
    base = tiny(**SWIGLU)
    model = apply_lora(copy.deepcopy(base), LoraConfig(rank=4, alpha=8))
    randomize_adapters(model)
    x = batch()
    ref = Reference(model).token_logprobs(x[:, :-1], x[:, 1:])
    with torch.no_grad():
        assert torch.equal(ref, base.token_logprobs(x[:, :-1], x[:, 1:]))
        assert not torch.equal(model.token_logprobs(x[:, :-1], x[:, 1:]), ref)  # and the adapters are back on
    assert not ref.requires_grad


def trainer_logprobs(model, prompt, tokens, temperature):
    seq = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        return model.token_logprobs(seq[:, :-1], seq[:, 1:], temperature=temperature)[0, len(prompt) - 1 :]


@pytest.mark.fp32("equal to fp32 rounding by design; bf16 rounds ~3e-3 relative")
def test_engine_samples_through_the_live_adapters():
    # the engine shares the trainer's wrapped model: after each optimizer step it samples from the new adapters
    # with no sync, and its log-probs equal the trainer's (fp32, 1e-5)
    model = apply_lora(tiny(**SWIGLU), LoraConfig(rank=4, alpha=8, dropout=0.1)).train()
    engine = Engine(model, TOK, batch_size=4, share_weights=True)
    optimizer = build_lora_optimizer(model, lr=3e-2)
    req = Request(list(range(40, 52)), num_samples=3, max_tokens=16, temperature=0.9, seed=5, stop_tokens=[])
    seen = []
    for step in range(4):
        outs = engine.submit_and_wait([req])[0]
        for out in outs:
            lp = trainer_logprobs(model, req.prompt_ids, out.tokens, 0.9)
            torch.testing.assert_close(torch.tensor(out.logprobs), lp, atol=1e-5, rtol=0)
        seen.append([o.tokens for o in outs])
        policy_step(model, optimizer, batch(seed=step))
    assert seen[0] != seen[-1]  # the updates reached the sampler


@pytest.mark.fp32("equal to fp32 rounding by design; bf16 rounds ~3e-3 relative")
def test_merge_gives_a_plain_model_with_the_same_outputs():
    model = apply_lora(tiny(**SWIGLU), LoraConfig(rank=4, alpha=8))
    randomize_adapters(model)
    x = batch()[:, :-1]
    with torch.no_grad():
        want = model(x)
        merged = merge_lora(copy.deepcopy(model))
        got = merged(x)
    assert not is_lora(merged) and set(merged.state_dict()) == set(base_state_dict(model))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    engine = Engine(merged, TOK, batch_size=2)  # a merged model is an ordinary GPT: the engine's own copy works
    out = engine.submit_and_wait([Request([1, 2, 3], max_tokens=5, temperature=0.9, seed=1, stop_tokens=[])])[0][0]
    torch.testing.assert_close(
        torch.tensor(out.logprobs), trainer_logprobs(model, [1, 2, 3], out.tokens, 0.9), atol=1e-5, rtol=0
    )


def test_adapter_state_round_trips_and_a_wrong_rank_is_named():
    model = apply_lora(tiny(), LoraConfig(rank=4, alpha=8))
    randomize_adapters(model)
    state = lora_state_dict(model)
    assert set(state) == {f"{n}.lora_{ab}.weight" for n, _ in lora_layers(model) for ab in "AB"}
    other = apply_lora(tiny(), LoraConfig(rank=4, alpha=8))
    load_lora_state_dict(other, state)
    assert all(torch.equal(other.state_dict()[k], v) for k, v in state.items())
    with pytest.raises(ValueError, match="adapters.pt does not fit.*--lora-rank"):
        load_lora_state_dict(apply_lora(tiny(), LoraConfig(rank=2, alpha=8)), state, "adapters.pt")


def test_peft_key_names():
    # PEFT stores the adapters of a Hugging Face model as base_model.model.<module path>.lora_{A,B}.weight
    model = apply_lora(tiny(**SWIGLU), LoraConfig(rank=4, alpha=8, targets="qkv,mlp"))
    state = peft_state_dict(model)
    assert len(state) == 2 * 2 * 6
    a = state["base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight"]
    assert torch.equal(a, model.transformer.h[1].attn.c_k.lora_A.weight)
    assert state["base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight"].shape == (96, 4)
    assert "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight" in state


# -----------------------------------------------------------------------------------------------
# end to end: chat_rl --lora-rank (the tiny fixture of tests/test_chat_rl.py), checkpoints, resume, export

from test_chat_rl import RM, base_dir, final_weights, run_rl  # noqa: E402,F401  (base_dir: a module fixture)


@pytest.mark.slow
def test_chat_rl_lora_trains_and_saves_only_adapters(base_dir):  # noqa: F811
    """(Killed and resumed in tests/test_resume.py.)"""
    import json

    # with a KL loss: its reference is the policy with the adapters off
    flags = ["--lora-rank", "4", "--lora-lr", "3e-2", "--temperature", "0.7", "--use-kl-loss", "--kl-loss-coef", "0.1"]
    full, _ = run_rl(base_dir, "--num-rollouts", "4", "--save-every", "2", "--output-tag", "lora_full", *flags)
    first = full["train"][0]
    assert first["train/first_step_ppo_kl"] == 0.0 and first["time/weight_sync"] < 1e-3  # nothing to sync
    assert first["train/kl_loss"] == 0.0 and full["train"][-1]["train/kl_loss"] > 0  # step 0 is the reference
    for h in full["train"]:  # the engine samples through the live adapters: its log-probs are the trainer's
        assert h["train/train_rollout_logprob_abs_diff"] < 1e-4
    fw = final_weights(base_dir, "lora_full")
    assert all(".lora_" in k for k in fw)
    assert any(v.abs().sum() > 0 for k, v in fw.items() if ".lora_B." in k)  # the adapters trained
    with open(base_dir / "rl_checkpoints" / "lora_full" / "meta_000004.json") as f:
        meta = json.load(f)["lora"]
    assert meta["config"]["rank"] == 4 and meta["base"]["source"] == "sft" and meta["base"]["model_tag"] == "t"


@pytest.mark.slow
@pytest.mark.fp32("equal to fp32 rounding by design; bf16 rounds ~3e-3 relative")
def test_lora_checkpoint_loads_merged_and_exports(base_dir, monkeypatch):  # noqa: F811
    # load_model("rl") of a LoRA run = its base + (alpha/r) B A, a plain GPT; export_hf writes that model
    import sys

    from nanorl.model_loading import load_model

    monkeypatch.setenv("NANORL_BASE_DIR", str(base_dir))
    if not (base_dir / "rl_checkpoints" / "lora_full").exists():
        run_rl(base_dir, "--num-rollouts", "2", "--output-tag", "lora_full", "--lora-rank", "4", "--lora-lr", "3e-2")
    merged, tok, meta = load_model("rl", "cpu", model_tag="lora_full")
    base, _, _ = load_model("sft", "cpu", model_tag="t")
    want = apply_lora(base, LoraConfig(rank=4, alpha=8))
    load_lora_state_dict(want, final_weights(base_dir, "lora_full"))
    assert not is_lora(merged) and "lora" not in meta
    ids = torch.tensor([tok.encode("the cat sat on the mat")])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids), want(ids), atol=1e-5, rtol=1e-5)
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "NANORL_BASE_DIR": str(base_dir)}
    out = base_dir / "lora_export"
    warm_python.run(
        [sys.executable, "-m", "scripts.export_hf", "-i", "rl", "-g", "lora_full", "-o", str(out)],
        env=env,
        check=True,
        capture_output=True,
    )
    from safetensors.torch import load_file

    assert len(load_file(out / "model.safetensors")) == len(merged.state_dict())
    peft = warm_python.run(
        [
            sys.executable,
            "-m",
            "scripts.export_hf",
            "-i",
            "rl",
            "-g",
            "lora_full",
            "--peft",
            "-o",
            str(base_dir / "peft"),
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    assert peft.returncode != 0 and "not a Hugging Face model: export merged" in peft.stderr


@pytest.mark.slow
def test_lora_with_fsdp_is_refused_in_one_line(base_dir):  # noqa: F811
    out = run_rl(base_dir, "--lora-rank", "4", "--fsdp", check=False)
    assert out.returncode != 0 and "--lora-rank does not work with --fsdp" in out.stderr.strip().splitlines()[-1]
    out = run_rl(base_dir, "--lora-rank", "4", "--lora-targets", "qkv,ffn", check=False)
    assert out.returncode != 0 and "unknown LoRA targets ffn" in out.stderr


@pytest.mark.slow
def test_chat_rl_lora_on_an_open_model_exports_merged_and_peft(tmp_path):
    # chat_rl --hf-model --lora-rank on a tiny random Qwen2; the merged export loads in transformers and the PEFT
    # adapter directory loads with peft onto the original model, both with the logits of base + adapters
    import sys

    transformers = pytest.importorskip("transformers")
    from test_hf import CONVERSATION, tiny_hf, tiny_tokenizer

    src, base = tmp_path / "qwen", tmp_path / "base"
    tiny_hf("qwen2", src, vocab=tiny_tokenizer(src), context=1024)
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
        "1",
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
        "--custom-rm-path",
        RM,
        "--device-type",
        "cpu",
        "--lora-rank",
        "4",
        "--lora-targets",
        "qkv,o,mlp",
    ]
    out = warm_python.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    from nanorl.checkpoint import load_checkpoint
    from nanorl.model_loading import load_hf

    adapters = load_checkpoint(str(base / "rl_checkpoints" / "qwen"))[0]
    ours, tok, _ = load_hf(str(src), "cpu")
    apply_lora(ours, LoraConfig(rank=4, alpha=8))
    load_lora_state_dict(ours, adapters)
    assert any(v.abs().sum() > 0 for k, v in adapters.items() if ".lora_B." in k)
    ids = torch.tensor([tok.render_conversation(CONVERSATION)[0]])
    with torch.no_grad():
        want = ours(ids)
    for how in ("merged", "peft"):
        warm_python.run(
            [
                sys.executable,
                "-m",
                "scripts.export_hf",
                "-i",
                "rl",
                "-o",
                str(tmp_path / how),
                *(["--peft"] if how == "peft" else []),
            ],
            env=env,
            check=True,
            capture_output=True,
        )
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    with torch.no_grad():
        assert (merged(ids).logits - want).abs().max().item() < 1e-4
    peft = pytest.importorskip("peft")
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(src))
    adapted = peft.PeftModel.from_pretrained(plain, str(tmp_path / "peft")).eval()
    with torch.no_grad():
        assert (adapted(ids).logits - want).abs().max().item() < 1e-4


@pytest.mark.slow
def test_chat_sft_lora_trains_adapters_and_resumes_bit_for_bit(base_dir):  # noqa: F811
    import sys

    from test_chat_rl import ROOT

    def sft(tag, *extra):
        env = {**os.environ, "NANORL_BASE_DIR": str(base_dir), "OMP_NUM_THREADS": "1"}
        cmd = [
            sys.executable,
            "-m",
            "scripts.chat_sft",
            "--source",
            "sft",
            "--model-tag",
            "t",
            "--levels",
            "1",
            "--num-examples",
            "200",
            "--num-iterations",
            "4",
            "--save-every",
            "2",
            "--keep-last",
            "5",
            "--device-batch-size",
            "2",
            "--max-seq-len",
            "128",
            "--eval-every",
            "100",
            "--eval-tokens",
            "256",
            "--device-type",
            "cpu",
            "--output-tag",
            tag,
            "--lora-rank",
            "4",
            "--lora-lr",
            "1e-2",
            *extra,
        ]
        out = warm_python.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        return out.stdout

    import shutil

    from nanorl.checkpoint import load_checkpoint

    sft("lora_sft_full")
    d = base_dir / "sft_checkpoints"
    shutil.copytree(d / "lora_sft_full", d / "lora_sft_resumed")  # "killed" after step 2: step 4's files dropped
    for f in (d / "lora_sft_resumed").glob("*000004*"):
        f.unlink()
    assert "resumed from" in sft("lora_sft_resumed", "--resume")
    fw, _, meta, _ = load_checkpoint(str(d / "lora_sft_full"), 4)
    rw = load_checkpoint(str(d / "lora_sft_resumed"), 4)[0]
    assert meta["lora"]["base"]["model_tag"] == "t" and all(".lora_" in k for k in fw)
    assert any(v.abs().sum() > 0 for k, v in fw.items() if ".lora_B." in k)
    assert fw.keys() == rw.keys() and all(torch.equal(fw[k], rw[k]) for k in fw)


@pytest.mark.slow
@pytest.mark.fp32("tokens compared across batchings: bf16 rounding differs with the batch's shape, so draws differ")
def test_bench_hf_with_lora_cpu():
    # bench hf --lora-rank: step 0 is the base model (greedy tokens exactly transformers'), the GRPO step trains the
    # adapters through the engine that shares the model; the parameter count is the base's
    from test_bench import bench

    _, r = bench(
        "hf",
        "--arch",
        "qwen2",
        "--size",
        "tiny",
        "--batches",
        "2",
        "--prompt-len",
        "6",
        "--new-tokens",
        "5",
        "--rl-prompts",
        "2",
        "--rl-samples",
        "3",
        "--rl-prompt-len",
        "5",
        "--rl-new-tokens",
        "4",
        "--device-type",
        "cpu",
        "--threads",
        "1",
        "--lora-rank",
        "4",
    )
    h, kv, mlp = 64, 2 * 16, 96
    layer = (h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * mlp + 2 * h
    assert r["lora_rank"] == 4 and r["params"] == 512 * h + 2 * layer + h
    assert r["decode"][0]["same_token_frac"] == 1.0 and r["rl_grad_norm"] > 0
