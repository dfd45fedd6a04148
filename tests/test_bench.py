"""scripts/bench.py on the CPU: tiny sizes, the final JSON line parsed and checked against the table above it."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def bench(*args):
    out = subprocess.run([sys.executable, "-m", "scripts.bench", *args], check=False, cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    return lines, json.loads(lines[-1])


def test_bench_train_cpu_smoke():
    lines, r = bench("train", "--depth", "2", "--batch", "2", "--seq-len", "32", "--head-dim", "64", "--vocab-size", "512",
                     "--warmup", "1", "--steps", "4", "--threads", "1", "--device-type", "cpu")
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
    _, r = bench("decode", "--depth", "2", "--batch", "2", "--prompt-len", "8", "--new-tokens", "4", "--vocab-size", "512",
                 "--threads", "1", "--device-type", "cpu")
    assert r["bench"] == "decode" and r["ms_per_step"] > 0 and r["peak_mem_gb"] > 0
    # the path chat_rl takes: the engine samples from its own copy of the fp32 model (fp32 on the CPU) and
    # refreshes it from the model; the weights a step reads are that copy's (matmul weights, 4 bytes each)
    assert r["engine_weights"] == "float32" and r["weight_refresh_ms"] > 0 and r["requests"] == 2
    n_embd, vocab = 128, 512
    assert r["weight_bytes"] == 4 * (2 * 12 * n_embd ** 2 + vocab * n_embd)


def test_bench_decode_one_request_on_a_big_engine():
    lines, r = bench("decode", "--depth", "1", "--head-dim", "32", "--batch", "64", "--requests", "1", "--prompt-len", "8",
                     "--new-tokens", "6", "--vocab-size", "512", "--threads", "1", "--device-type", "cpu")
    assert r["batch"] == 64 and r["requests"] == 1
    assert abs(r["decode_tok_per_s"] - 1 / (r["ms_per_step"] / 1e3)) < 0.01 * r["decode_tok_per_s"]
    assert any("requests 1" in line for line in lines)


RL_TINY = ["rl", "--depth", "1", "--head-dim", "32", "--vocab-size", "512", "--device-type", "cpu", "--threads", "1"]


def test_bench_rl_cpu_smoke():
    _, r = bench(*RL_TINY, "--prompts", "3", "--samples", "4", "--prompt-len", "10", "--new-tokens", "6", "--steps", "2")
    assert r["bench"] == "rl" and r["device"] == "cpu" and r["steps"] == 2
    # no stop tokens: every response runs to the full budget, and training sees prompt + response
    assert r["generated_tokens"] == 3 * 4 * 6
    assert r["trained_tokens"] == 3 * 4 * (10 + 6)
    assert r["rollout_s"] > 0 and r["train_s"] > 0
    assert abs(r["total_s"] - (r["rollout_s"] + r["train_s"])) < 2e-4
    assert abs(r["rollout_tok_per_s"] - r["generated_tokens"] / r["rollout_s"]) < 0.01 * r["rollout_tok_per_s"]
    assert 0 < r["reward_mean"] < 1  # the parity reward is mixed, so advantages are non-zero
    assert r["grad_norm"] > 0 and r["peak_mem_gb"] > 0


def test_bench_rl_micro_batches_match_one_batch():
    """Split into micro-batches of 4 rows x 16 tokens or trained as one, the step's gradient is the same."""
    args = [*RL_TINY, "--prompts", "2", "--samples", "4", "--prompt-len", "10", "--new-tokens", "6"]
    _, whole = bench(*args, "--max-tokens-per-gpu", "8192")
    _, split = bench(*args, "--max-tokens-per-gpu", "64")
    assert abs(split["grad_norm"] - whole["grad_norm"]) < 1e-4 * whole["grad_norm"]
    assert split["reward_mean"] == whole["reward_mean"]


def test_bench_rl_bad_flags():
    for flag, value, message in [("--samples", "1", "--samples must be >= 2"), ("--new-tokens", "0", "--new-tokens")]:
        out = subprocess.run([sys.executable, "-m", "scripts.bench", *RL_TINY, flag, value], check=False, cwd=ROOT,
                             capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert out.returncode != 0 and message in out.stderr
