"""CPU smoke tests of scripts/bench.py: the final JSON line is there and its numbers add up."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--depth", "1", "--head-dim", "32", "--vocab-size", "512", "--device-type", "cpu", "--threads", "1"]


def bench(*args):
    return subprocess.run([sys.executable, "-m", "scripts.bench", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)


def bench_json(*args):
    out = bench(*args)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_bench_rl_json():
    r = bench_json("rl", *TINY, "--prompts", "3", "--samples", "4", "--prompt-len", "10", "--new-tokens", "6", "--steps", "2")
    assert r["bench"] == "rl" and r["device"] == "cpu" and r["steps"] == 2
    # no stop tokens: every response runs to the full budget, and training sees prompt + response
    assert r["generated_tokens"] == 3 * 4 * 6
    assert r["trained_tokens"] == 3 * 4 * (10 + 6)
    assert r["rollout_s"] > 0 and r["train_s"] > 0
    assert r["total_s"] == pytest.approx(r["rollout_s"] + r["train_s"], abs=2e-4)
    assert r["rollout_tok_per_s"] == pytest.approx(r["generated_tokens"] / r["rollout_s"], rel=1e-2)
    assert 0 < r["reward_mean"] < 1  # the parity reward is mixed, so advantages are non-zero
    assert r["grad_norm"] > 0 and r["peak_mem_gb"] > 0


def test_bench_rl_micro_batches_match_one_batch():
    """Split into many micro-batches (4 rows of 16 tokens) or trained as one, the step's gradient is the same."""
    args = ["rl", *TINY, "--prompts", "2", "--samples", "4", "--prompt-len", "10", "--new-tokens", "6"]
    whole = bench_json(*args, "--max-tokens-per-gpu", "8192")
    split = bench_json(*args, "--max-tokens-per-gpu", "64")
    assert split["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-4)
    assert split["reward_mean"] == whole["reward_mean"]


def test_bench_rl_bad_flags():
    out = bench("rl", *TINY, "--samples", "1")
    assert out.returncode != 0 and "--samples must be >= 2" in out.stderr
    out = bench("rl", *TINY, "--new-tokens", "0")
    assert out.returncode != 0 and "--new-tokens" in out.stderr
