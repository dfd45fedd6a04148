"""scripts/bench.py on the CPU: tiny sizes, the final JSON line parsed and checked against the table above it."""

import json
import os
import re
import sys
from pathlib import Path

import warm_python  # pytest puts tests/ on sys.path

ROOT = Path(__file__).resolve().parents[1]


def bench(*args):
    out = warm_python.run(
        [sys.executable, "-m", "scripts.bench", *args],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    return lines, json.loads(lines[-1])


def test_bench_train_cpu_smoke():
    lines, r = bench(
        "train",
        "--depth",
        "2",
        "--batch",
        "2",
        "--seq-len",
        "32",
        "--head-dim",
        "64",
        "--vocab-size",
        "512",
        "--warmup",
        "1",
        "--steps",
        "4",
        "--threads",
        "1",
        "--device-type",
        "cpu",
    )
    assert r["bench"] == "train" and r["device"] == "cpu" and r["batch"] == 2 and r["seq_len"] == 32 and r["steps"] == 4
    assert r["compiled"] is False and r["mfu"] is None and r["peak_mem_gb"] > 0  # no peak FLOP/s for a CPU
    rows = [ln for ln in lines if re.match(r"\s+\d+ \|", ln)]
    assert len(rows) == 4  # one table row per timed step
    ms = [float(row.split("|")[1]) for row in rows]
    assert abs(r["ms_per_step"] - sum(ms) / 4) < 0.02 * r["ms_per_step"] + 0.01
    assert abs(r["tok_per_s"] - 2 * 32 / (r["ms_per_step"] / 1e3)) < 0.01 * r["tok_per_s"]
    # the real step trains: the same random batch four times is being memorised
    assert r["loss_last"] < r["loss_first"]
    # 6 x matmul params + attention, for this width and context
    n_embd, n_layer = 128, 2
    matmul_params = r["params"] - 512 * n_embd
    assert r["flops_per_token"] == 6 * matmul_params + 12 * n_layer * 2 * 64 * 32


def test_bench_decode_still_works():
    _, r = bench(
        "decode",
        "--depth",
        "2",
        "--batch",
        "2",
        "--prompt-len",
        "8",
        "--new-tokens",
        "4",
        "--vocab-size",
        "512",
        "--threads",
        "1",
        "--device-type",
        "cpu",
    )
    assert r["bench"] == "decode" and r["ms_per_step"] > 0 and r["peak_mem_gb"] > 0
    # the path chat_rl takes: the engine samples from its own copy of the fp32 model (fp32 on the CPU) and
    # refreshes it from the model; the weights a step reads are that copy's (matmul weights, 4 bytes each)
    assert r["engine_weights"] == "float32" and r["weight_refresh_ms"] > 0 and r["requests"] == 2
    n_embd, vocab = 128, 512
    assert r["weight_bytes"] == 4 * (2 * 12 * n_embd**2 + vocab * n_embd)
    # MBU on a CPU: the bytes a step reads (weights + 2 rows' KV at 8 + 4/2 tokens) per second over the measured copy
    assert r["bandwidth_source"].startswith("measured copy") and r["bandwidth_bytes_per_s"] > 1e8
    assert r["kv_bytes_per_step"] == 2 * 10 * r["kv_bytes_per_token"] and r["kv_bytes_per_token"] == 2 * 2 * n_embd * 4
    step_bytes = r["weight_bytes"] + r["kv_bytes_per_step"]
    mbu = step_bytes / (r["ms_per_step"] / 1e3) / r["bandwidth_bytes_per_s"]
    assert 0 < r["mbu"] and abs(r["mbu"] - mbu) < 1e-3


def test_bench_decode_one_request_on_a_big_engine():
    lines, r = bench(
        "decode",
        "--depth",
        "1",
        "--head-dim",
        "32",
        "--batch",
        "64",
        "--requests",
        "1",
        "--prompt-len",
        "8",
        "--new-tokens",
        "6",
        "--vocab-size",
        "512",
        "--threads",
        "1",
        "--device-type",
        "cpu",
    )
    assert r["batch"] == 64 and r["requests"] == 1
    assert abs(r["decode_tok_per_s"] - 1 / (r["ms_per_step"] / 1e3)) < 0.01 * r["decode_tok_per_s"]
    assert any("requests 1" in line for line in lines)


RL_TINY = ["rl", "--depth", "1", "--head-dim", "32", "--vocab-size", "512", "--device-type", "cpu", "--threads", "1"]


def test_bench_rl_cpu_smoke():
    _, r = bench(
        *RL_TINY, "--prompts", "3", "--samples", "4", "--prompt-len", "10", "--new-tokens", "6", "--steps", "2"
    )
    assert r["bench"] == "rl" and r["device"] == "cpu" and r["steps"] == 2
    # no stop tokens: every response runs to the full budget, and training sees prompt + response
    assert r["generated_tokens"] == 3 * 4 * 6
    assert r["trained_tokens"] == 3 * 4 * (10 + 6)
    assert r["rollout_s"] > 0 and r["train_s"] > 0
    assert abs(r["total_s"] - (r["rollout_s"] + r["train_s"])) < 2e-4
    assert abs(r["rollout_tok_per_s"] - r["generated_tokens"] / r["rollout_s"]) < 0.01 * r["rollout_tok_per_s"]
    assert 0 < r["reward_mean"] < 1  # the parity reward is mixed, so advantages are non-zero
    assert r["grad_norm"] > 0 and r["peak_mem_gb"] > 0


def test_bench_rl_lora_trains_only_the_adapters():
    """--lora-rank: the parameter count is the base's, the trained count is the adapters' (rank x (in + out) for each
    of depth 1's q, k, v, o and its relu^2 MLP's up and down projections; width 64, 2 kv heads of 32), and it trains."""
    _, full = bench(*RL_TINY, "--prompts", "2", "--samples", "4", "--prompt-len", "10", "--new-tokens", "6")
    _, r = bench(
        *RL_TINY, "--prompts", "2", "--samples", "4", "--prompt-len", "10", "--new-tokens", "6", "--lora-rank", "4"
    )
    assert r["lora_rank"] == 4 and r["params"] == full["params"] and full["lora_rank"] == 0
    hidden = 4 * 64
    shapes = [(64, 64), (64, 64), (64, 64), (64, 64), (64, hidden), (hidden, 64)]
    assert r["trainable_params"] == sum(4 * (i + o) for i, o in shapes)
    assert full["trainable_params"] == full["params"]
    assert r["grad_norm"] > 0 and r["generated_tokens"] == full["generated_tokens"] == 2 * 4 * 6


def test_bench_rl_micro_batches_match_one_batch():
    """Split into micro-batches of 4 rows x 16 tokens or trained as one, the step's gradient is the same."""
    args = [*RL_TINY, "--prompts", "2", "--samples", "4", "--prompt-len", "10", "--new-tokens", "6"]
    _, whole = bench(*args, "--max-tokens-per-gpu", "8192")
    _, split = bench(*args, "--max-tokens-per-gpu", "64")
    assert abs(split["grad_norm"] - whole["grad_norm"]) < 1e-4 * whole["grad_norm"]
    assert split["reward_mean"] == whole["reward_mean"]


def test_bench_rl_bad_flags():
    for flag, value, message in [("--samples", "1", "--samples must be >= 2"), ("--new-tokens", "0", "--new-tokens")]:
        out = warm_python.run(
            [sys.executable, "-m", "scripts.bench", *RL_TINY, flag, value],
            check=False,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert out.returncode != 0 and message in out.stderr


def test_bench_train_fsdp_is_the_same_step():
    """--fsdp over one rank (no torchrun: the bench makes its own one-process group) trains exactly as the plain step
    (fp32 on the CPU), and times the sampler's weight gather."""
    args = [
        "train",
        "--depth",
        "2",
        "--batch",
        "2",
        "--seq-len",
        "32",
        "--head-dim",
        "64",
        "--vocab-size",
        "512",
        "--warmup",
        "1",
        "--steps",
        "2",
        "--threads",
        "1",
        "--device-type",
        "cpu",
    ]
    lines, sharded = bench(*args, "--fsdp")
    _, plain = bench(*args)
    assert sharded["fsdp"] is True and plain["fsdp"] is False and plain["gather_ms"] is None
    assert sharded["params"] == plain["params"] and sharded["flops_per_token"] == plain["flops_per_token"]
    assert (
        abs(sharded["loss_first"] - plain["loss_first"]) < 1e-3
        and abs(sharded["loss_last"] - plain["loss_last"]) < 1e-3
    )
    assert sharded["gather_ms"] > 0 and any("sampler weight gather" in ln for ln in lines)


def test_bench_hf_tiny_cpu():
    """bench hf on the tiny Qwen2 shape: nanorl's engine and transformers' generate pick the same greedy tokens
    (fp32), the parameter count is the HF model's, the GRPO step's token counts are its shape's."""
    lines, r = bench(
        "hf",
        "--arch",
        "qwen2",
        "--size",
        "tiny",
        "--batches",
        "1",
        "3",
        "--prompt-len",
        "6",
        "--new-tokens",
        "7",
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
    )
    assert r["bench"] == "hf" and r["arch"] == "qwen2" and r["vocab_size"] == 512 and r["tokenizer_vocab"] == 300
    # hidden 64, 2 layers, 4 heads of 16 (2 KV heads), MLP 96, tied embedding; q/k/v biases and RMSNorm weights
    h, kv, mlp = 64, 2 * 16, 96
    layer = (h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * mlp + 2 * h
    assert r["params"] == 512 * h + 2 * layer + h
    assert r["load_s"] > 0 and r["load_peak_mem_gb"] > 0 and r["peak_mem_gb"] > 0
    assert [d["batch"] for d in r["decode"]] == [1, 3]
    for d in r["decode"]:
        assert d["same_token_frac"] == 1.0 and d["rows_equal"] == d["batch"], d  # fp32: exactly transformers' greedy
        assert d["distinct_tokens"] > d["batch"] * 7 // 2  # greedy tokens of a far-from-uniform model vary
        assert d["nanorl_tok_per_s"] > 0 and d["hf_tok_per_s"] > 0
        assert abs(d["speedup"] - d["nanorl_tok_per_s"] / d["hf_tok_per_s"]) < 1e-2 * d["speedup"]
    assert r["rl_generated_tokens"] == 2 * 3 * 4 and r["rl_trained_tokens"] == 2 * 3 * (5 + 4)
    assert abs(r["rl_total_s"] - (r["rl_rollout_s"] + r["rl_train_s"])) < 2e-4
    assert r["rl_grad_norm"] > 0 and 0 <= r["rl_reward_mean"] <= 1
    assert sum(1 for ln in lines if re.match(r"\s+[13] \|", ln)) == 2  # one table row per batch size
