"""The whole tiny pipeline, end to end, with the smallest settings (NANORL_SMOKE=1)."""

import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from test_gpu_setup import gpu_env as fake_gpu_env  # pytest puts tests/ on sys.path

ROOT = Path(__file__).resolve().parents[1]
RUN = {"capture_output": True, "text": True}


@pytest.mark.slow
def test_tiny_speedrun_end_to_end(tmp_path):
    """The pipeline as a user runs it: killed in RL (as by the OOM killer), rerun, which continues RL from its last
    checkpoint; then the report, and a rerun of RL alone from scratch, whose weights the resumed run's equal."""
    report, base = tmp_path / "report.md", tmp_path / "base"
    env = {
        **os.environ,
        "NANORL_TINY": "1",
        "NANORL_SMOKE": "1",
        "NANORL_SKIP_INSTALL": "1",
        "NANORL_BASE_DIR": str(base),
        "NANORL_REPORT": str(report),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),  # 1 when tests run in parallel (conftest.py)
    }
    env.pop("NANORL_CUDA_DTYPES", None)  # speedrun.sh's own choice: bf16 where the CPU has bf16 matrix units
    # chat_rl SIGKILLed entering its 2nd step, after saving step 1 (the smoke run saves every RL step)
    kill = {"PYTHONPATH": str(ROOT / "tests" / "kill_site"), "NANORL_TEST_KILL_MODULE": "scripts.chat_rl"}
    out = subprocess.run(
        ["bash", "speedrun.sh"], cwd=ROOT, env={**env, **kill, "NANORL_TEST_KILL": "optstep:2"}, **RUN, timeout=900
    )
    log, rl = base / "logs" / "chat_rl.log", base / "rl_checkpoints" / "d4"
    assert out.returncode == 1 and out.stderr.strip().splitlines()[-1].startswith(
        f"!! stage 'chat_rl' failed; its log is {log}."
    ), out.stdout[-4000:] + out.stderr[-4000:]
    assert sorted(p.name for p in rl.glob("meta_*")) == ["meta_000001.json"]
    out = subprocess.run(["bash", "speedrun.sh"], cwd=ROOT, env=env, **RUN, timeout=900)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert out.stdout.count("already done, skipping") == 10  # the stages before RL
    rerun = next(line for line in out.stdout.splitlines() if line.startswith("-- chat_rl: "))
    assert rerun.endswith(" --resume") and "--overwrite" not in rerun  # which would have moved step 1 aside
    text = log.read_text()  # the stopped attempt's log, then the resumed one's
    assert text.count("step 00001/2 |") == 1 and f"resumed from {rl} step 1\n" in text and "step 00002/2 |" in text
    assert not list(rl.parent.glob("d4.old-*")) and not list((base / "started").iterdir())
    assert "no CUDA GPU" in out.stdout  # it says up front that this is the tiny offline run
    # bf16 (CUDA's dtypes) exactly where the CPU has bf16 matrix units, and each training stage's log says which
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    for stage in ("base_train", "mid_train", "chat_sft", "chat_rl"):
        line = next(
            ln for ln in (base / "logs" / f"{stage}.log").read_text().splitlines() if ln.startswith("precision:")
        )
        assert line.startswith("precision: bf16 autocast" if amx else "precision: fp32"), (stage, line)
    # and at the end, the next step: the venv to activate (a new shell lacks it), then how to chat
    tail = out.stdout.strip().splitlines()[-5:]
    assert tail[0].endswith(f"the report card is in {report} ==") and tail[1:3] == [
        "Chat with the RL model it trained:",
        "  source .venv/bin/activate",
    ]
    assert tail[3].startswith("  python -m scripts.chat_cli -i rl") and tail[4].startswith(
        "  python -m scripts.chat_web"
    )
    text = report.read_text()
    for section in [
        "## Environment",
        "## Report card",
        "## Time and cost",
        "## Plots",
        "## Tokenizer training",
        "## Base model training",
        "## Base model evaluation",
        "## Midtraining",
        "## Chat SFT",
        "## Chat RL",
    ]:
        assert section in text, section
    # every card row names its task, its size and greedy/sampled; the tiny run evaluates one task, so no ChatCORE
    card = text.split("## Report card")[1].split("\n## ")[0]
    rows = {m[0]: m[1].split(" | ") for m in re.findall(r"^\| (.+?) \| (.+) \|$", card, re.M) if m[0] != "metric"}
    greedy = [f"offline levels {lv} accuracy (greedy, 16 problems)" for lv in ("1,2", "3,4")]  # 3,4: RL's reach
    sampled = [f"offline levels 1,2 pass@{k} (T=1, 16 problems x 4 samples)" for k in (1, 4)]
    bpb = ["val bpb (min during training, 2048 tokens)", "val bpb (final model, 2048 tokens)"]
    assert set(rows) == {*bpb, *greedy, *sampled}, rows
    for row in bpb:
        assert re.fullmatch(r"\d+\.\d{4}", rows[row][0]) and rows[row][1:] == ["-", "-", "-"], (row, rows[row])
    for row in (*greedy, *sampled):  # MID, SFT and RL each evaluated both ways; BASE is not a chat model
        assert rows[row][0] == "-" and all(re.fullmatch(r"\d\.\d{4}", v) for v in rows[row][1:]), (row, rows[row])
    assert "ChatCORE" not in text
    assert "(the sum of the stages' own times; the last setup (venv, installs): " in text  # installs apart
    for png in ("plot_base_loss.png", "plot_rl.png"):  # beside the sections, not loose next to report.md
        assert (tmp_path / "base" / "report" / png).stat().st_size > 1000 and not (tmp_path / png).exists()
    # RL again from scratch (its marker removed): --overwrite moves the resumed run aside, and the weights are the same
    (base / "done" / "chat_rl").unlink()
    again = subprocess.run(["bash", "speedrun.sh"], cwd=ROOT, env=env, **RUN, timeout=300)
    assert again.returncode == 0 and again.stdout.count("already done, skipping") == 12, again.stdout + again.stderr
    (resumed,) = rl.parent.glob("d4.old-*")
    assert (
        "resumed" not in log.read_text()
        and (resumed / "model_000002.safetensors").read_bytes() == (rl / "model_000002.safetensors").read_bytes()
    )
    # a rerun skips every finished stage
    again = subprocess.run(["bash", "speedrun.sh"], cwd=ROOT, env=env, **RUN, timeout=300)
    assert again.returncode == 0 and again.stdout.count("already done, skipping") == 13
    minutes = float(re.search(r"total wall time: ([\d.]+) min", report.read_text()).group(1))
    assert minutes >= 0.5  # the rerun's report still counts the stages' own time, not the rerun's seconds


# ----------------------------------------------------------------------------------------------
# the GPU branch on a machine whose torch cannot use the GPU: nvidia-smi (faked) shows 8 H100s on driver 535
# (CUDA 12.2), the .venv holds a CPU build of torch, and NANORL_SKIP_INSTALL=1 keeps it from installing another


def gpu_env(tmp_path, **extra):
    return fake_gpu_env(tmp_path, NANORL_SKIP_INSTALL="1", NANORL_REPORT=str(tmp_path / "report.md"), **extra)


def test_speedrun_stops_before_any_stage_when_torch_cannot_see_the_gpus(tmp_path):
    out = subprocess.run(
        ["bash", "speedrun.sh"], cwd=ROOT, env=gpu_env(tmp_path), capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 1, out.stdout + out.stderr
    # it said which torch build the driver runs, then stopped in one line naming the driver and the fix
    assert (
        "driver 535.183.01 runs CUDA up to 12.2: torch built for CUDA 12.6, from "
        "https://download.pytorch.org/whl/cu126" in out.stderr
    )
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "nvidia-smi shows 8 GPU(s), driver 535.183.01 (CUDA up to 12.2), but torch "
    ) and last.endswith("--index-url https://download.pytorch.org/whl/cu126"), out.stderr
    assert "-- " not in out.stdout and "the full pipeline" not in out.stdout  # no stage started
    assert os.listdir(tmp_path / "base" / "logs") == [] and os.listdir(tmp_path / "base" / "done") == []


def test_speedrun_without_a_sandbox_goes_on_and_says_humaneval_will_be_skipped(tmp_path):
    # a container without user namespaces: bubblewrap fails its probe. Only HumanEval (the model's code) needs it:
    # one line says it will be skipped and how to enable it, and the run goes on to its next check (this torch
    # cannot see the faked GPUs, which stops it there, before any stage)
    fake = tmp_path / "nobwrap"
    fake.mkdir()
    (fake / "bwrap").write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    (fake / "bwrap").chmod(0o755)
    env = gpu_env(tmp_path)
    env["PATH"] = f"{fake}:{env['PATH']}"
    out = subprocess.run(["bash", "speedrun.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    notes = [line for line in out.stdout.splitlines() if "HumanEval" in line]
    assert notes == [
        "note: HumanEval will be skipped: model-written code runs only in the bubblewrap sandbox, which does not work "
        "here (bwrap probe failed: bwrap: No permissions to create new namespace): install the bubblewrap package "
        "(apt-get install bubblewrap), or set NANORL_SANDBOX=guard to run it under the weaker in-process guard"
    ], out.stdout + out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("nvidia-smi shows 8 GPU(s)"), out.stderr


def test_speedrun_names_the_packages_a_minimal_image_lacks(tmp_path):
    # $CC names a compiler that is not there (Triton would use it): with installs off, stop and name the package
    out = subprocess.run(
        ["bash", "speedrun.sh"],
        cwd=ROOT,
        env=gpu_env(tmp_path, CC="/nonexistent/cc"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert out.stderr.strip() == "!! torch.compile needs a C compiler and Python's headers: apt-get install gcc"
    assert out.stdout == ""
