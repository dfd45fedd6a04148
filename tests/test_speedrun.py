"""The whole tiny pipeline, end to end, with the smallest settings (NANORL_SMOKE=1)."""
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_tiny_speedrun_end_to_end(tmp_path):
    report = tmp_path / "report.md"
    env = {**os.environ, "NANORL_TINY": "1", "NANORL_SMOKE": "1", "NANORL_SKIP_INSTALL": "1",
           "NANORL_BASE_DIR": str(tmp_path / "base"), "NANORL_REPORT": str(report), "OMP_NUM_THREADS": "2"}
    out = subprocess.run(["bash", "speedrun.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "no CUDA GPU" in out.stdout  # it says up front that this is the tiny offline run
    text = report.read_text()
    for section in ["## Environment", "## Report card", "## RL: held-out pass@k before and after", "## Time and cost",
                    "## Plots", "Tokenizer training", "Base model training", "Base model evaluation", "Midtraining", "Chat SFT", "Chat RL"]:
        assert section in text, section
    # the offline task has a number for every stage that evaluates it, and BASE has its val bpb
    row = re.search(r"^\| offline \| (.*) \|$", text, re.M).group(1).split(" | ")
    assert row[0] == "-" and all(re.fullmatch(r"\d\.\d{4}", v) for v in row[1:]), row
    assert re.search(r"^\| val bpb \| \d+\.\d{4} \|", text, re.M)
    # beside greedy accuracy, the sampled pass@1 / pass@4 (temperature 1: what RL optimises) of MID, SFT and RL
    for k in (1, 4):
        row = re.search(rf"^\| offline pass@{k} \(T=1\) \| (.*) \|$", text, re.M).group(1).split(" | ")
        assert row[0] == "-" and all(re.fullmatch(r"\d\.\d{4}", v) for v in row[1:]), row
    assert re.search(r"^\| pass@1 \| \d\.\d{4} \| \d\.\d{4} \|$", text, re.M)
    for png in ("plot_base_loss.png", "plot_rl.png"):
        assert (tmp_path / png).stat().st_size > 1000
    # a rerun skips every finished stage
    again = subprocess.run(["bash", "speedrun.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and again.stdout.count("already done, skipping") == 13
    minutes = float(re.search(r"total wall time: ([\d.]+) min", report.read_text()).group(1))
    assert minutes >= 0.5  # the rerun's report still counts the stages' own time, not the rerun's seconds
