"""
GPU readiness. Tests marked `gpu` need a CUDA GPU and are skipped without one; `bash dev/gpu_check.sh OUT.md` runs
them and puts the figures they print (lines starting "gpu_check ") in its table. The others run on the CPU: the
tensor devices of the collectives (nanorl.common.strict_collective_device) and the CPU mode of dev/gpu_check.sh.
"""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanorl import gpt, rl, rl_trainer
from nanorl.common import strict_collective_device
from nanorl.gpt import GPT, GPTConfig, build_model, config_from_depth
from nanorl.optim import build_optimizer
from nanorl.precision import autocast_ctx
from nanorl.rl_config import GroupSpec, TrainerConfig
from nanorl.rl_trainer import collate_packed
from nanorl.rollout import Sample

REPO = Path(__file__).resolve().parents[1]


def gpu(fn):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(fn))


def report(check, **figures):
    # one line per figure for dev/gpu_check.sh's table (pytest -s shows it)
    print("gpu_check " + json.dumps({"check": check, **figures}), flush=True)


# -----------------------------------------------------------------------------
# collectives: every tensor on the compute device (NCCL refuses CPU tensors; gloo does not)


def _whiten_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 6, generator=g) * 3 + 1
    m = (torch.rand(5, 6, generator=g) > 0.3).float()
    return x, m


def _rollout(rank):
    # two groups of two samples, responses of different lengths, rewards 0/1: a rank's share of a GRPO rollout
    return [
        Sample(
            tokens=[5, 6, 7] + [8 + k] * (k + 1 + rank),
            response_length=k + 1 + rank,
            loss_mask=[1] * (k + 1 + rank),
            reward=float(k % 2),
            group_index=k // 2,
            index=k % 2,
        )
        for k in range(4)
    ]


def _advantages(samples, device):
    """The shape of chat_rl's compute_advantages with --normalize-advantages: rollout tensors on `device`, GRPO
    advantages, then whitened over every rank's tokens (an all-reduce). device "cpu" is what chat_rl does today."""
    batch = collate_packed(samples, [[i] for i in range(len(samples))], device)  # one sample per row: padded
    rewards = torch.tensor([s.reward for s in samples], device=device)
    adv = rl.grpo_advantages(rewards, batch["loss_mask"], 2)
    return rl.masked_whiten(adv, batch["loss_mask"], distributed=True)


# the estimators whose advantages are all-reduced (whitened over every training rank)
WHITENED = [("grpo", {"normalize_advantages": True}), ("reinforce_plus_plus", {}), ("reinforce_plus_plus_baseline", {})]


def _trainer_advantages(rank, device, est, options):
    """chat_rl's own advantage code, rl_trainer.Trainer.compute_advantages, with a KL penalty in the reward."""
    group = GroupSpec(n_samples_per_prompt=2, max_response_len=8)
    cfg = TrainerConfig(group=group, advantage_estimator=est, kl_coef=0.1, **options)
    trainer = rl_trainer.Trainer(
        cfg, None, None, torch.device(device), data_parallel=rl_trainer.DataParallel(distributed=True)
    )
    samples = _rollout(rank)
    lp = torch.zeros(len(samples), max(len(s.tokens) for s in samples) - 1, device=device)  # old/ref log-probs
    return trainer.compute_advantages(samples, lp, lp, None)


def _outcome(fn):
    try:
        fn()
        return "ok"
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"


def _collective_checks(rank, world, device):
    """What the training and RL steps all-reduce, with tensors on `device`; and the same advantages built on the
    host (chat_rl's pattern), which must fail wherever the compute device is not the host."""
    out = {}
    x, m = _whiten_data()
    rows = slice(0, 3) if rank == 0 else slice(3, 5)  # uneven: 3 rows and 2 rows
    w = rl.masked_whiten(x[rows].to(device), m[rows].to(device), distributed=True)
    out["whiten"] = None if device == "meta" else w.cpu()
    out["advantages_on_device"] = _outcome(lambda: _advantages(_rollout(rank), device))
    out["advantages_on_host"] = _outcome(lambda: _advantages(_rollout(rank), "cpu"))
    for est, flags in WHITENED:
        out[f"trainer {est}"] = _outcome(lambda: _trainer_advantages(rank, device, est, flags))
    # the optimizer's gradient average: rank r's gradients are all r + 1, so the mean is (world + 1) / 2
    cfg = GPTConfig(sequence_len=8, vocab_size=16, n_layer=1, n_head=2, n_kv_head=1, n_embd=16)
    if device == "meta":
        with torch.device("meta"):
            model = GPT(cfg)
    else:
        model = build_model(cfg, device)
    for p in model.parameters():
        p.grad = torch.full_like(p, rank + 1.0)
    build_optimizer(model).average_gradients()
    out["grads"] = (
        None if device == "meta" else sorted({v for p in model.parameters() for v in p.grad.unique().tolist()})
    )
    return out


def _collective_worker(rank, world, init_file, out_dir, backend, devices):
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results = {}
        for device in devices:
            dev = f"cuda:{rank}" if device == "cuda" else device
            restore = strict_collective_device(dev)
            try:
                results[device] = _collective_checks(rank, world, dev)
            finally:
                restore()
        if backend == "nccl":  # what strict_collective_device imitates: NCCL itself refuses a host tensor
            results["nccl_host_tensor"] = _outcome(lambda: dist.all_reduce(torch.ones(2)))
        torch.save(results, f"{out_dir}/collectives{rank}.pt")
    finally:
        dist.destroy_process_group()


def _run_two_ranks(tmp_path, backend, devices):
    # fork (where available and CUDA is not in use) skips re-importing torch in the children: ~0.1 s, not ~7 s
    method = "fork" if backend == "gloo" and "fork" in mp.get_all_start_methods() else "spawn"
    mp.start_processes(
        _collective_worker,
        args=(2, str(tmp_path / "init"), str(tmp_path), backend, devices),
        nprocs=2,
        join=True,
        start_method=method,
    )
    return [torch.load(tmp_path / f"collectives{r}.pt") for r in range(2)]


def _check_real_exchange(r, device):
    x, m = _whiten_data()
    got = torch.cat([r[0][device]["whiten"], r[1][device]["whiten"]])
    torch.testing.assert_close(got, rl.masked_whiten(x, m), atol=1e-5, rtol=1e-5)  # the whole batch's statistics
    assert r[0][device]["grads"] == r[1][device]["grads"] == [1.5]  # (1 + 2) / 2 on every parameter
    assert r[0][device]["advantages_on_device"] == "ok"
    assert all(r[k][device][f"trainer {est}"] == "ok" for k in (0, 1) for est, _ in WHITENED), r[0][device]


def test_collectives_on_compute_device_two_ranks(tmp_path):
    r = _run_two_ranks(tmp_path, "gloo", ["cpu", "meta"])
    # compute device cpu (gloo, as the CPU suite runs): real exchanges, right values, host tensors are fine
    _check_real_exchange(r, "cpu")
    assert r[0]["cpu"]["advantages_on_host"] == "ok"
    # compute device meta stands in for a GPU: tensors that follow the model's device pass the check, and
    # advantages built on the host fail as NCCL would (chat_rl's --normalize-advantages crash, caught on CPU)
    for rank in (0, 1):
        assert r[rank]["meta"]["advantages_on_device"] == "ok"
        assert all(r[rank]["meta"][f"trainer {est}"] == "ok" for est, _ in WHITENED), r[rank]["meta"]  # chat_rl's path
        assert "dist.all_reduce got a tensor on cpu" in r[rank]["meta"]["advantages_on_host"]
        assert "No backend type associated with device type cpu" in r[rank]["meta"]["advantages_on_host"]


def test_strict_collective_device_restores():
    before = dist.all_reduce
    restore = strict_collective_device("meta")
    assert dist.all_reduce is not before
    restore()
    assert dist.all_reduce is before


@gpu
def test_two_rank_nccl(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    r = _run_two_ranks(tmp_path, "nccl", ["cuda"])
    _check_real_exchange(r, "cuda")
    assert "dist.all_reduce got a tensor on cpu" in r[0]["cuda"]["advantages_on_host"]
    assert r[0]["nccl_host_tensor"] != "ok"  # NCCL's own refusal, which the CPU check imitates
    report("2-rank NCCL collectives", figure="pass")


# -----------------------------------------------------------------------------
# dev/gpu_check.sh: its CPU mode, so the one GPU command cannot rot


@pytest.mark.slow  # ~40 s: seven subprocesses, each importing torch
def test_gpu_check_cpu_mode(tmp_path):
    out = tmp_path / "gpu_check.md"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable}
    res = subprocess.run(
        ["bash", str(REPO / "dev" / "gpu_check.sh"), str(out), "--cpu"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    text = out.read_text()
    lines = [ln for ln in text.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == ["check", "figure", "unit", "MFU / % of bandwidth bound", "peak memory (GB)"]
    rows = {c[0]: c for c in ([x.strip() for x in ln.strip("|").split("|")] for ln in lines[2:])}
    want = [
        "train d2",
        "decode d2 batch 1",
        "decode d2 batch 4",
        "rl d2 step (2x2)",
        "train d2 --fsdp",
    ]
    hf = [
        "hf qwen2 tiny: --hf-model load",
        "hf qwen2 tiny: decode batch 1",
        "hf qwen2 tiny: decode batch 2",
        "hf qwen2 tiny: decode batch 4",
        "hf qwen2 tiny: GRPO step (2x2)",
    ]
    lora = [
        "hf qwen2 tiny --lora-rank 4: --hf-model load",
        "hf qwen2 tiny --lora-rank 4: decode batch 1",
        "hf qwen2 tiny --lora-rank 4: decode batch 2",
        "hf qwen2 tiny --lora-rank 4: GRPO step (2x2)",
    ]
    tail = want + ["train d2 --fsdp: sampler weight gather"] + hf + lora
    assert list(rows)[-len(tail) :] == tail, list(rows)
    assert all(float(rows[name][1]) > 0 for name in lora)
    for name in want:
        row = rows[name]
        assert float(row[1]) > 0 and float(row[4]) > 0, row  # figure and peak memory are numbers
        assert row[3] == "n/a (CPU)", row
    assert rows["train d2"][2] == "tok/s" and rows["rl d2 step (2x2)"][2] == "s/step"
    assert float(rows["train d2 --fsdp: sampler weight gather"][1]) > 0
    assert all(float(rows[name][1]) > 0 for name in hf)
    assert [rows[name][2] for name in hf] == ["s", "tok/s", "tok/s", "tok/s", "s/step"]
    for name in hf[1:4]:  # nanorl's greedy tokens against transformers' in the same run: all equal in fp32
        assert re.fullmatch(r"transformers [\d.]+ tok/s \([\d.]+x\); same greedy tokens 100%", rows[name][3]), rows[
            name
        ]
    # the gpu tests ran (and were skipped here): the table says how many
    assert re.fullmatch(r"0 passed, 0 failed, \d+ skipped", rows["gpu tests"][1]), rows["gpu tests"]
    assert "CPU mode" in text
    # the pipeline step's CPU mode: the profiled decode step alone (no device, so no kernels and no syncs)
    row = rows["pipeline: decode step d2 batch 1 (profiled)"]
    assert float(row[1]) > 0 and row[2:] == ["ms a step (host)", "device 0.000 ms, 0 kernels, 0.0 syncs", ""], row
    # ONLY="pipeline": that kind's steps alone (a GPU session splits the check to fit its per-command limit)
    part = tmp_path / "part.md"
    res = subprocess.run(
        ["bash", str(REPO / "dev" / "gpu_check.sh"), str(part), "--cpu"],
        cwd=REPO,
        env={**env, "ONLY": "pipeline"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    checks = [ln.split("|")[1].strip() for ln in part.read_text().splitlines() if ln.startswith("| ")][1:]
    assert checks == ["pipeline: decode step d2 batch 1 (profiled)"]


def test_gpu_table_reads_figures_printed_after_pytest_progress_marks(tmp_path):
    """Under -s a test's print shares its line with pytest's progress marks (the first H100 run's log: ".s..gpu_check
    {...}"): each figure is a row, and a figure without "figure" (the resume check) lists its fields."""
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "01_tests.log").write_text(
        'sgpu_check {"check": "engine CUDA graph self-check on cuda:0", "figure": "passed"}\n'
        '.s..gpu_check {"check": "engine (bf16) vs trainer log-prob gap: mean", "figure": 0.00016, "unit": "nats"}\n'
        '.gpu_check {"check": "resume on CUDA", "stages": "base_train, chat_rl", "resumed": "ok"}\n'
        "9 passed, 2 skipped, 3 deselected in 270.17s\n"
    )
    (logs / "index.tsv").write_text("01_tests.log\ttests\tgpu tests\t0\n")
    out = tmp_path / "t.md"
    res = subprocess.run(
        [sys.executable, str(REPO / "dev" / "gpu_table.py"), str(logs), str(out), "cpu", "1"],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in out.read_text().splitlines() if ln.startswith("| ")]
    assert rows[1:] == [
        ["gpu tests", "9 passed, 0 failed, 2 skipped", "", "", ""],
        ["engine CUDA graph self-check on cuda:0", "passed", "", "", ""],
        ["engine (bf16) vs trainer log-prob gap: mean", "0.00016", "nats", "", ""],
        ["resume on CUDA", "stages base_train, chat_rl, resumed ok", "", "", ""],
    ]


# -----------------------------------------------------------------------------
# the GPU checks themselves (bash dev/gpu_check.sh runs these first)


def _random_model(depth=4, vocab=4096, seq=512, lm_std=0.05, device="cuda"):
    """A random model (d4: width 256, 4 heads of 64, 2 KV heads) whose every layer matters (init zeroes the output
    projections) and whose next-token distributions are far from uniform: logits of std ~ lm_std x 16."""
    torch.manual_seed(0)
    model = build_model(config_from_depth(depth, vocab, seq, head_dim=64, n_kv_head=2), device)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
        model.lm_head.weight.normal_(0, lm_std)
    return model.eval()


def _byte_tokenizer():
    from nanorl.tokenizer import SPLIT_PATTERN, Tokenizer

    return Tokenizer.from_ranks({bytes([i]): i for i in range(256)}, SPLIT_PATTERN)


def _generate(engine, prompts, temperature, n_new=32):
    from nanorl.engine import Request

    reqs = [
        Request(p, max_tokens=n_new, temperature=temperature, seed=i, stop_tokens=[], use_tools=False)
        for i, p in enumerate(prompts)
    ]
    return [c[0] for c in engine.submit_and_wait(reqs)]


BF16_LOGPROB_ATOL = 5e-2  # bf16 keeps 8 mantissa bits: ~0.4% of a log-prob of ~-5 is 2e-2; twice that for slack


@gpu
@pytest.mark.parametrize("index", [0, 1])
def test_cuda_graph_engine_equals_eager(index):
    """Greedy tokens equal and log-probs within BF16_LOGPROB_ATOL. The graph pads attention to a static length,
    so its sums run in another order; a bf16 near-tie between the two best tokens may then break the other way:
    that is allowed in at most one of the 8 rows, only where both engines' chosen tokens are within the
    tolerance of each other (a true tie), and the row is compared up to there. On cuda:1 (chat_web --num-gpus 2's
    second replica) the graphs must be captured there, not on the current device cuda:0."""
    from nanorl.engine import Engine

    if index >= torch.cuda.device_count():
        pytest.skip(f"needs {index + 1} GPUs")
    device = torch.device("cuda", index)
    model, tok = _random_model(lm_std=0.5, device=device), _byte_tokenizer()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 40, 17, 100, 1, 64, 33, 8)]
    outs = {}
    for graph in (True, False):
        engine = Engine(model, tok, batch_size=8, max_len=160, cuda_graph=graph)
        if graph:  # the engine's own check, each graph replayed once against the eager step at start (its warning
            # line, if it failed, is in this step's log)
            report(f"engine CUDA graph self-check on {device}", figure="passed" if engine.use_cuda_graph else "FAILED")
        assert engine.use_cuda_graph == graph
        outs[graph] = _generate(engine, prompts, temperature=0.0)
    gap, ties = 0.0, 0
    for a, b in zip(outs[True], outs[False]):
        assert len(a.tokens) == len(b.tokens) == 32
        n = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), 32)
        if n < 32:
            ties += 1
            assert abs(a.logprobs[n] - b.logprobs[n]) <= BF16_LOGPROB_ATOL, (n, a.logprobs[n], b.logprobs[n])
        gap = max([gap] + [abs(x - y) for x, y in zip(a.logprobs[:n], b.logprobs[:n])])
    on = "" if index == 0 else f" on {device}"
    report(f"engine CUDA graph vs eager{on}: max |logprob gap|", figure=gap, unit="nats")
    report(f"engine CUDA graph vs eager{on}: rows split at a bf16 tie (of 8)", figure=ties, unit="rows")
    assert gap <= BF16_LOGPROB_ATOL and ties <= 1


@gpu
def test_a_graph_that_replays_nothing_is_caught_at_start(monkeypatch, capfd):
    """A capture bug whose graphs record nothing (as on the wrong device's stream) is found by the engine's start-up
    check: one warning line, eager decoding, the eager engine's tokens."""
    from nanorl.engine import Engine

    model, tok = _random_model(lm_std=0.5), _byte_tokenizer()
    prompts = [[1, 2, 3], list(range(40, 90))]
    want = _generate(Engine(model, tok, batch_size=4, max_len=128, cuda_graph=False), prompts, temperature=0.0)
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda self: None)
    capfd.readouterr()
    engine = Engine(model, tok, batch_size=4, max_len=128, cuda_graph=True)
    err = capfd.readouterr().err
    ours = [line for line in err.splitlines() if line.startswith("warning: the CUDA graph of decode batch")]
    assert not engine.use_cuda_graph and len(ours) == 1 and ours[0].endswith("decodes eagerly (same tokens, slower)"), (
        err
    )
    assert [c.tokens for c in _generate(engine, prompts, temperature=0.0)] == [c.tokens for c in want]


@gpu
def test_training_samples_run_on_the_pinned_kernel():
    """base_train's samples (nanorl.decode.greedy_decode under bf16 autocast): every forward's masked attention runs
    with memory-efficient SDPA the only kernel allowed, and that kernel takes these shapes (else SDPA raises "No
    available kernel"); the first token is the full forward's."""
    from nanorl.decode import greedy_decode

    model, seen, ids = _random_model(lm_std=0.5), [], list(range(40, 77))
    with torch.no_grad(), autocast_ctx("cuda"):
        first = int(model(torch.tensor([ids], device="cuda"))[0, -1].argmax())
    forward = model.hidden_states

    def hidden_states(idx, **kw):
        b = torch.backends.cuda
        seen.append((b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled(), b.cudnn_sdp_enabled()))
        return forward(idx, **kw)

    model.hidden_states = hidden_states
    with autocast_ctx("cuda"):
        out = greedy_decode(model, ids, 16, torch.device("cuda"))
    assert len(out) == 16 and out[0] == first
    assert seen == [(False, True, False, False)] * 16  # flash, memory-efficient, math, cuDNN


@gpu
def test_bf16_engine_vs_trainer_logprob_gap():
    from nanorl.engine import Engine

    model, tok = _random_model(), _byte_tokenizer()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (20,), generator=g).tolist() for _ in range(8)]
    comps = _generate(Engine(model, tok, batch_size=8, max_len=64), prompts, temperature=1.0)
    seqs = torch.tensor([p + c.tokens for p, c in zip(prompts, comps)], device="cuda")
    with torch.no_grad(), autocast_ctx("cuda"):  # the trainer's forward: fp32 master weights, bf16 autocast
        lp = model.token_logprobs(seqs[:, :-1], seqs[:, 1:]).float()
    trainer = lp[:, 19:].cpu()  # the log-probs of the 32 generated tokens
    engine = torch.tensor([c.logprobs for c in comps])
    gap = (trainer - engine).abs()
    report("engine (bf16) vs trainer log-prob gap: mean", figure=gap.mean().item(), unit="nats")
    report("engine (bf16) vs trainer log-prob gap: max", figure=gap.max().item(), unit="nats")
    # expected ~1e-3 mean; equality holds only in fp32 (the CPU suite checks it); a misaligned position would
    # be off by nats, not hundredths
    assert gap.mean() < 2e-2 and gap.max() < 0.3


@gpu
def test_compiled_equals_eager_loss():
    model = _random_model().train()
    x, y = torch.randint(0, 4096, (2, 2, 512), device="cuda")
    doc_ids = (torch.arange(512, device="cuda") // 100).expand(2, 512)  # packed rows: documents of 100 tokens
    compiled = torch.compile(model, dynamic=False)
    for kw in ({}, {"doc_ids": doc_ids}):
        with autocast_ctx("cuda"):
            eager, comp = model(x, targets=y, **kw), compiled(x, targets=y, **kw)
        comp.backward()  # the compiled backward runs too
        name = "packed (flex)" if kw else "causal (flash)"
        report(f"compiled vs eager loss, {name}: |difference|", figure=abs(eager.item() - comp.item()), unit="nats")
        assert abs(eager.item() - comp.item()) < 1e-2 * eager.item()


@gpu
def test_packed_flex_gradients_equal_dense_mask(monkeypatch):
    # fp32 on the GPU: compiled flex (block mask) against SDPA with the dense mask, forward and backward
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    model = _random_model(depth=2, seq=300).train()
    model.transformer.wte.float()  # init_weights keeps the embedding in bf16 on CUDA; fp32 here, no autocast
    idx, tgt = torch.randint(0, 4096, (2, 2, 300), device="cuda")
    doc_ids = torch.tensor([[0] * 40 + [1] * 260, [0] * 129 + [1] * 170 + [2]], device="cuda")
    grads, losses = {}, {}
    for flex in (False, True):
        monkeypatch.setattr(gpt, "use_flex", lambda device: flex)
        model.zero_grad()
        losses[flex] = model(idx, targets=tgt, doc_ids=doc_ids)
        losses[flex].backward()
        grads[flex] = [p.grad.clone() for p in model.parameters()]
    torch.testing.assert_close(losses[True], losses[False], atol=1e-5, rtol=1e-4)
    for a, b in zip(grads[False], grads[True]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)


@gpu
def test_packed_sft_step_d20_peak_memory():
    """One SFT/mid step at the speedrun's d20 shape (--n-kv-head 2, 16 rows x 2048 tokens of packed documents,
    bf16 autocast, MuonAdamW): the dense-mask fallback this replaces needed ~54 GB for attention alone."""
    torch.manual_seed(0)
    cfg = config_from_depth(20, 32768, 2048, n_kv_head=2)
    model = build_model(cfg, "cuda").train()
    optimizer = build_optimizer(model)
    B, T = 16, 2048
    x, y = torch.randint(0, 32768, (2, B, T), device="cuda")
    ends = torch.randint(50, 900, (B, 12)).cumsum(1)  # documents of 50..900 tokens, as packed conversations are
    doc_ids = torch.searchsorted(ends, torch.arange(T).expand(B, T).contiguous(), right=True).cuda()
    torch.cuda.reset_peak_memory_stats()
    with autocast_ctx("cuda"):
        loss = model(x, targets=y, doc_ids=doc_ids)
    loss.backward()
    optimizer.step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 1e9
    report("packed SFT step d20 (16 x 2048, n_kv_head 2): peak memory", figure=peak, unit="GB", peak_mem_gb=peak)
    assert abs(loss.item() - math.log(32768)) < 0.05  # init predicts near uniform
    assert peak < 0.9 * torch.cuda.get_device_properties(0).total_memory / 1e9


@gpu
def test_grpo_step_d12():
    # one GRPO step (rollout, rewards, advantages, policy loss, optimizer step) of a random-init d12 on the GPU
    cmd = [
        sys.executable,
        "-m",
        "scripts.bench",
        "rl",
        "--depth",
        "12",
        "--prompts",
        "4",
        "--samples",
        "4",
        "--prompt-len",
        "64",
        "--new-tokens",
        "64",
    ]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])
    assert r["generated_tokens"] == 4 * 4 * 64 and r["trained_tokens"] == 4 * 4 * (64 + 64)
    assert math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
    report("GRPO step d12 (4x4, 64 new)", figure=r["total_s"], unit="s/step", peak_mem_gb=r["peak_mem_gb"])


# -----------------------------------------------------------------------------
# recovery on CUDA: the crash every --resume hit there (AdamW's moments cast to the bf16 embedding's dtype on load)


@gpu
def test_kill_and_resume_on_cuda(tmp_path):
    """base_train and chat_rl killed mid-run and mid-save and rerun with --resume, as tests/test_resume.py does on the
    CPU in CUDA's layout; here on the GPU itself, within a tolerance (its kernels may sum in another order)."""
    from test_resume import BASE, RL, adamw_moment_dtypes, kill_and_resume

    env = {**os.environ, "NANORL_BASE_DIR": str(tmp_path)}
    tok = [sys.executable, "-m", "scripts.tok_train", "--vocab-size", "600", "--max-chars", "300000"]
    subprocess.run(tok, cwd=REPO, env=env, check=True, capture_output=True)
    base = BASE.replace("--device-type cpu", "--device-type cuda --no-compile").split()
    kill_and_resume(tmp_path, "scripts.base_train", base, "base_checkpoints", "--model-tag", "g", 4, 4, 6, atol=1e-2)
    optim = torch.load(tmp_path / "base_checkpoints" / "g_killed" / "optim_000006.pt", weights_only=True)
    assert adamw_moment_dtypes(optim) == {torch.float32}
    rl_flags = RL.replace("--device-type cpu", "--device-type cuda").split() + [
        "--source",
        "base",
        "--model-tag",
        "g_full",
    ]
    kill_and_resume(tmp_path, "scripts.chat_rl", rl_flags, "rl_checkpoints", "--output-tag", "g", 3, 4, 4, atol=1e-2)
    report("resume on CUDA", stages="base_train, chat_rl", killed="mid-run and mid-save", resumed="ok")


@gpu
def test_the_batch_trial_compiles_the_graph_training_runs_on_cuda(tmp_path):
    """base_train under torchrun (DDP, one rank per GPU), torch.compile with inductor and --device-batch-size auto: the
    trial's graph is the one training runs, so dynamo never recompiles forward (tests/test_pretrain.py counts the graphs
    with 2 CPU ranks and dynamo's eager backend)."""
    from test_resume import BASE

    env = {**os.environ, "NANORL_BASE_DIR": str(tmp_path), "TORCH_LOGS": "recompiles"}
    tok = [sys.executable, "-m", "scripts.tok_train", "--vocab-size", "600", "--max-chars", "300000"]
    subprocess.run(tok, cwd=REPO, env=env, check=True, capture_output=True)
    flags = BASE.replace("--device-type cpu", "--device-type cuda").replace("--device-batch-size 2", "").split()
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m"]
    cmd = [*launch, "scripts.base_train", "--", *flags, "--device-batch-size", "auto", "--model-tag", "cg"]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "device batch (auto)" in res.stdout and "Recompiling function forward" not in res.stdout + res.stderr
    report("base_train batch trial under DDP", graphs="one per shape", recompiles=0)


# -----------------------------------------------------------------------------
# dev/pipeline_check.py (the `pipeline` step): what it reads, on hand-made input; its GPU run awaits a GPU


def pipeline_check():
    sys.path.insert(0, str(REPO / "dev"))
    import pipeline_check

    return pipeline_check


def test_pipeline_check_counts_a_steps_kernels_syncs_and_device_time():
    step_profile = pipeline_check().step_profile
    events = [
        ("aten::mm", False, 0.0),  # host-side ops: neither kernels nor syncs
        ("ampere_bf16_gemm", True, 30.0),
        ("flash_fwd_kernel", True, 12.5),
        ("cudaLaunchKernel", False, 0.0),
        ("cudaStreamSynchronize", False, 0.0),
        ("ampere_bf16_gemm", True, 27.5),
        ("cudaMemcpyAsync", False, 0.0),  # the sampled token back to the host
    ]
    assert step_profile(events, steps=2) == ((30.0 + 12.5 + 27.5) / 1e3 / 2, 1.5, 1.0)


def test_pipeline_check_finds_every_engine_that_decodes_eagerly(tmp_path):
    find = pipeline_check().eager_fallbacks
    graphs = "engine attention: prefill = SDPA flash, decode = SDPA efficient, CUDA graphs (both pinned)"
    eager = "engine attention: prefill = SDPA flash, decode = SDPA efficient (both pinned)"
    warned = (
        "warning: the CUDA graph of decode batch 4, attention length 128 on cuda:1 does not reproduce the eager step: "
        "this engine decodes eagerly (same tokens, slower)"
    )
    (tmp_path / "eval_mid.log").write_text(f"loaded\n{graphs}\n{graphs}\n")
    (tmp_path / "chat_rl.log").write_text(f"{graphs}\n{warned}\n")
    (tmp_path / "eval_rl.log").write_text(f"{eager}\nGSM8K: accuracy 0.1\n")
    (tmp_path / "notes.txt").write_text(warned)  # not a stage's log
    assert find(tmp_path) == [("chat_rl.log", warned), ("eval_rl.log", eager)]
    assert find(tmp_path, cuda=False) == [("chat_rl.log", warned)]  # on the CPU an engine has no graphs to drop


def test_gpu_table_rows_of_the_pipeline_step():
    sys.path.insert(0, str(REPO / "dev"))
    from gpu_table import pipeline_rows

    result = {
        "rehearsal_rc": 0,
        "rehearsal_s": 312,
        "stages_s": {"base_train": 60, "chat_rl": 41},
        "eager_fallbacks": [],
        "chat_web_answer": "5",
        "decode_step": {"host_ms": 3.04, "device_ms": 0.41, "kernels": 182.0, "syncs": 1.0},
        "depth": 20,
        "failed": [],
    }
    assert pipeline_rows("pipeline", result) == [
        ["pipeline: rehearsal", "312", "s", "exit 0; base_train 60, chat_rl 41", ""],
        ["pipeline: engines decoding eagerly", "0", "", "", ""],
        ["pipeline: chat_web -i rl", "answered '5'", "", "", ""],
        [
            "pipeline: decode step d20 batch 1 (profiled)",
            "3.04",
            "ms a step (host)",
            "device 0.410 ms, 182 kernels, 1.0 syncs",
            "",
        ],
    ]
