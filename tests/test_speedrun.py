"""The whole tiny pipeline, end to end, with the smallest settings (NANORL_SMOKE=1)."""

import importlib.util
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch
from test_gpu_setup import gpu_env as fake_gpu_env  # pytest puts tests/ on sys.path

ROOT = Path(__file__).resolve().parents[1]
SHARED_GSM8K = ROOT.parent / "shared" / "data" / "gsm8k"  # the real GSM8K beside the checkout (as in CI), if there
RUN = {"capture_output": True, "text": True}


@pytest.mark.slow
def test_tiny_speedrun_end_to_end(tmp_path):
    """The pipeline as a user runs it: killed in RL (as by the OOM killer), rerun, which continues RL from its last
    checkpoint; then the report, and a rerun that skips every finished stage. (That the resumed weights equal an
    uninterrupted run's is tests/test_resume.py's, stage by stage.)"""
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
    run = base / "tiny"  # the tiny run's own directory: no other kind of run reads it
    log, rl = run / "logs" / "chat_rl.log", run / "rl_checkpoints" / "d4"
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
    assert not list(rl.parent.glob("d4.old-*")) and not list((run / "started").iterdir())
    assert "no CUDA GPU" in out.stdout  # it says up front that this is the tiny offline run
    # bf16 (CUDA's dtypes) exactly where the CPU has bf16 matrix units, and each training stage's log says which
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    for stage in ("base_train", "mid_train", "chat_sft", "chat_rl"):
        line = next(
            ln for ln in (run / "logs" / f"{stage}.log").read_text().splitlines() if ln.startswith("precision:")
        )
        assert line.startswith("precision: bf16 autocast" if amx else "precision: fp32"), (stage, line)
    # and at the end, the next step: the venv to activate (a new shell lacks it) and the run's directory, then how to chat
    tail = out.stdout.strip().splitlines()[-6:]
    assert tail[0].endswith(f"the report card is in {report} ==") and tail[1:4] == [
        "Chat with the RL model it trained:",
        "  source .venv/bin/activate",
        f"  export NANORL_BASE_DIR={run}   # where this run's checkpoints are",
    ]
    assert tail[4].startswith("  python -m scripts.chat_cli -i rl") and tail[5].startswith(
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
        assert (run / "report" / png).stat().st_size > 1000 and not (tmp_path / png).exists()
    # a rerun skips every finished stage
    again = subprocess.run(["bash", "speedrun.sh"], cwd=ROOT, env=env, **RUN, timeout=300)
    assert again.returncode == 0 and again.stdout.count("already done, skipping") == 13, again.stdout + again.stderr
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


# ----------------------------------------------------------------------------------------------
# the rehearsal (NANORL_REHEARSAL=1): the GPU branch's own stage commands at tiny sizes, on 2 CPU ranks here

STAGES = [  # the GPU branch's stages in order; data_download runs in the background
    *("data_first", "data_download", "tok_train", "tok_eval", "base_train", "base_eval", "mid_train", "eval_mid"),
    *("chat_sft", "eval_sft", "chat_rl", "eval_rl", "eval_rl_sampled"),
]
# the differences allowed between the rehearsal's commands and the GPU run's: the values of these size flags; chat_eval's
# problem count and answer length, which the real run leaves to each task (all problems, the task's own length); the
# rank count and the device. The mirror is no flag at all: NANORL_MIRROR, in the environment.
SIZE_FLAGS = {
    *("-n", "--vocab-size", "--max-chars", "--depth", "--head-dim", "--max-seq-len", "--device-batch-size"),
    *("--total-batch-size", "--num-iterations", "--eval-every", "--eval-tokens", "--sample-every", "--save-every"),
    *("--split-tokens", "--num-examples", "--num-rollouts", "--rollout-batch-size", "--n-samples-per-prompt"),
    *("--max-new-tokens", "--eval-max-problems", "--n-samples-per-eval-prompt", "--pass-k", "-x", "-k", "-m"),
}
REHEARSAL_ONLY = {"-x", "-m"}
LAUNCHER = ["-m", "torch.distributed.run", "--standalone"]


def dry_run(env):
    """{stage: its command's words} of `bash speedrun.sh --dry-run`, in order."""
    out = subprocess.run(["bash", "speedrun.sh", "--dry-run"], cwd=ROOT, env=env, **RUN, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return {m[0]: m[1].split() for m in re.findall(r"^-- (\w+)(?: \(in the background\))?: (.*)$", out.stdout, re.M)}


def options(words):
    """[(flag, value or None)] in order: a word that starts with a dash and a letter is a flag, the next word its value
    unless it is a flag too (-1 is a value)."""
    out, i = [], 0
    while i < len(words):
        flag = words[i]
        assert re.match(r"^--?[a-z]", flag), (flag, words)
        value = words[i + 1] if i + 1 < len(words) and not re.match(r"^--?[a-z]", words[i + 1]) else None
        out.append((flag, value))
        i += 1 if value is None else 2
    return out


def split_command(words):
    """(ranks, device, module, its options) of a stage's command; ranks and device None for a one-process stage."""
    assert words[0].endswith("python"), words
    if words[1:4] != LAUNCHER:
        assert words[1] == "-m", words
        return None, None, words[2], options(words[3:])
    nproc, m, module, sep, device_flag, device = words[4:10]
    assert (nproc.split("=")[0], m, sep, device_flag) == ("--nproc_per_node", "-m", "--", "--device-type"), words
    return int(nproc.split("=")[1]), device, module, options(words[10:])


def rehearsal_env(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items() if k not in ("NANORL_TINY", "NANORL_SMOKE", "NANORL_MIRROR")}
    env.update(NANORL_REHEARSAL="1", NANORL_SKIP_INSTALL="1", NANORL_BASE_DIR=str(tmp_path / "base"))
    env["NANORL_REHEARSAL_GSM8K"] = str(SHARED_GSM8K)  # the real GSM8K where the checkout has it beside it
    return {**env, "NANORL_REPORT": str(tmp_path / "report.md"), **extra}


def test_the_rehearsal_runs_the_gpu_branchs_commands_with_only_sizes_device_and_ranks_changed(tmp_path):
    gpu = dry_run(gpu_env(tmp_path))  # the faked 8-GPU node (this torch cannot use them: a listing needs none)
    small = dry_run(rehearsal_env(tmp_path))
    assert list(gpu) == list(small) == STAGES
    sized = set()
    for stage in STAGES:
        ranks, device, module, opts = split_command(gpu[stage])
        s_ranks, s_device, s_module, s_opts = split_command(small[stage])
        assert module == s_module, stage
        assert (ranks, device, s_ranks, s_device) in ((None, None, None, None), (8, "cuda", 2, "cpu")), stage
        extra = [o for o in s_opts if o[0] in REHEARSAL_ONLY and o[0] not in dict(opts)]
        s_opts = [o for o in s_opts if o not in extra]
        assert [f for f, _ in opts] == [f for f, _ in s_opts], (stage, opts, s_opts)  # the same flags, in order
        for (flag, value), (_, s_value) in zip(opts, s_opts):
            assert value == s_value or flag in SIZE_FLAGS, (stage, flag, value, s_value)
            if value != s_value:
                sized.add(flag)
        sized |= {f for f, _ in extra}
    assert sized == SIZE_FLAGS  # every allowed difference is used: the list names nothing that does not differ
    # the real run's sizes are the ones its comments and docs name
    assert ("--depth", "20") in split_command(gpu["base_train"])[3] and ("-n", "300") in split_command(
        gpu["data_download"]
    )[3]
    assert ("--num-rollouts", "467") in split_command(gpu["chat_rl"])[3]
    assert not (tmp_path / "base" / "rehearsal").exists()  # a listing writes nothing


def test_the_gpu_run_stops_on_an_older_tiny_runs_markers(tmp_path):
    # before each run had its own directory the tiny run kept its done/ markers where the GPU run keeps its own: the
    # GPU run would have skipped every stage and reported the tiny model. It stops in one line naming the way out
    base = tmp_path / "base"
    (base / "done").mkdir(parents=True)
    (base / "done" / "eval_mid_sampled").write_text("12\n")
    out = subprocess.run(
        ["bash", "speedrun.sh", "--dry-run"],
        cwd=ROOT,
        env=gpu_env(tmp_path, NANORL_BASE_DIR=str(base)),
        **RUN,
        timeout=120,
    )
    assert out.returncode == 1 and "-- " not in out.stdout, out.stdout
    assert f"{base} holds an older tiny run's files (done/eval_mid_sampled)" in out.stderr
    assert f"mv {base} {base}.tiny" in out.stderr and "Traceback" not in out.stderr


def card_rows(report):
    card = report.read_text().split("## Report card")[1].split("\n## ")[0]
    return {m[0]: m[1].split(" | ") for m in re.findall(r"^\| (.+?) \| (.+) \|$", card, re.M) if m[0] != "metric"}


@pytest.mark.slow
def test_rehearsal_after_a_tiny_run_runs_every_stage_and_continues_after_kills(tmp_path):
    """A tiny run first, in the same base directory; then the rehearsal, killed in base_train after its step-2 save and
    in chat_rl after its step-1 save, each time continued by rerunning the same command."""
    from nanorl.execution import sandbox_missing

    base, report = tmp_path / "base", tmp_path / "report.md"
    kill_site = {"PYTHONPATH": str(ROOT / "tests" / "kill_site")}
    # the tiny run: its tokenizer and its markers, stopped in base_train's first step (all that is needed to be read)
    tiny = {**rehearsal_env(tmp_path), "NANORL_TINY": "1", "NANORL_SMOKE": "1", "NANORL_REHEARSAL": "0", **kill_site}
    tiny.update(NANORL_TEST_KILL_MODULE="scripts.base_train", NANORL_TEST_KILL="optstep:1")
    out = subprocess.run(["bash", "speedrun.sh"], cwd=ROOT, env=tiny, **RUN, timeout=300)
    assert out.returncode == 1 and "-- tok_train: " in out.stdout and "-- tok_eval: " in out.stdout, out.stderr

    env, run = rehearsal_env(tmp_path), base / "rehearsal"
    outs = []
    for module, at in (("scripts.base_train", "optstep:3"), ("scripts.chat_rl", "optstep:2")):
        kill = {**kill_site, "NANORL_TEST_KILL_MODULE": module, "NANORL_TEST_KILL": at}
        outs.append(subprocess.run(["bash", "speedrun.sh"], cwd=ROOT, env={**env, **kill}, **RUN, timeout=600))
        # no stage of the tiny run is taken for one of the rehearsal's: its first attempt runs every stage to the kill
        assert "already done" not in outs[0].stdout and "on 2 cpu rank(s)" in outs[0].stdout, outs[0].stdout
        stage = module.split(".")[1]
        assert outs[-1].returncode == 1 and outs[-1].stderr.strip().splitlines()[-1].startswith(
            f"!! stage '{stage}' failed; its log is {run / 'logs' / stage}.log."
        ), outs[-1].stdout[-3000:] + outs[-1].stderr[-3000:]
    outs.append(subprocess.run(["bash", "speedrun.sh"], cwd=ROOT, env=env, **RUN, timeout=600))
    assert outs[-1].returncode == 0, outs[-1].stdout[-3000:] + outs[-1].stderr[-3000:]
    first, second, third = (o.stdout for o in outs)
    assert (base / "tiny" / "tokenizer").is_dir() and (run / "tokenizer").is_dir()  # each run its own
    # each stopped stage went on from its last save, its log after the stopped attempt's
    for text, stage, said in (
        (second, "base_train", f"resumed from {run / 'base_checkpoints' / 'd2'} at step 2\n"),
        (third, "chat_rl", f"resumed from {run / 'rl_checkpoints' / 'd2'} step 1\n"),
    ):
        line = next(ln for ln in text.splitlines() if ln.startswith(f"-- {stage}: "))
        assert line.endswith(" --resume") and "--overwrite" not in line, line
        assert said in (run / "logs" / f"{stage}.log").read_text(), stage
    assert third.count("already done, skipping") == STAGES.index("chat_rl") - 1  # the background download has none
    assert sorted(os.listdir(run / "done")) == sorted(set(STAGES) - {"data_download"})
    assert not os.listdir(run / "started")
    # what ran is what the dry run lists: each stage's first attempt
    ran = {}
    for text in (first, second, third):
        for name, cmd in re.findall(r"^-- (\w+): (.*)$", text, re.M):
            ran.setdefault(name, cmd.split())
    listed = dry_run(env)
    assert ran == {k: v for k, v in listed.items() if k != "data_download"}
    # the data came from the mirror, through the real downloaders and loaders
    assert sorted(p.name for p in (run / "base_data").glob("*.parquet")) == [f"shard_{i:05d}.parquet" for i in range(3)]
    assert (run / "eval_bundle" / "core.yaml").is_file() and (
        run / "hub_data" / "datasets" / "openai" / "gsm8k"
    ).is_dir()
    for section in ("Midtraining", "Chat SFT"):
        assert f"## {section}\n" in report.read_text()
        assert "- data: hub\n" in report.read_text().split(f"## {section}\n")[1].split("\n## ")[0]
    # the card: CORE for the base model, the seven chat tasks for MID, SFT and RL, RL's sampled GSM8K
    rows, number = card_rows(report), re.compile(r"\d\.\d{4}")
    assert number.fullmatch(rows["CORE (3 tasks)"][0]) and rows["CORE (3 tasks)"][1:] == ["-", "-", "-"]
    tasks = ["ARC-Easy", "ARC-Challenge", "MMLU", "GSM8K", "SpellingBee", "offline levels 1,2"]
    tasks += ["HumanEval"] if sandbox_missing() is None else []
    for task in tasks:
        row = rows[f"{task} accuracy (greedy, 4 problems)"]
        assert row[0] == "-" and all(number.fullmatch(v) for v in row[1:]), (task, row)
    if sandbox_missing() is not None:
        assert rows["HumanEval"] == ["-", "skipped: no sandbox", "skipped: no sandbox", "skipped: no sandbox"]
    for k in (1, 2):
        assert number.fullmatch(rows[f"GSM8K pass@{k} (T=1, 4 problems x 2 samples)"][3])
    # dev/pipeline_check.py's checks, which gpu_check's pipeline step makes on a GPU: here the engines have no CUDA graphs
    # to drop, and chat_web answers with the RL model
    sys.path.insert(0, str(ROOT / "dev"))
    import pipeline_check

    engines = ("chat_rl", "eval_mid", "eval_sft", "eval_rl", "eval_rl_sampled")  # each names its engine's kernels
    assert all("\nengine attention: " in (run / "logs" / f"{stage}.log").read_text() for stage in engines)
    assert pipeline_check.eager_fallbacks(run / "logs", cuda=False) == []
    assert isinstance(pipeline_check.chat_web_answer(run), str)
    # the mirror's server stopped with the run
    url = (run / "mirror.url").read_text().strip()
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=5)


def test_the_rl_recipe_experiments_start_from_the_tiny_runs_rl_flags(tmp_path):
    """dev/rl_recipe.py runs chat_rl with the tiny speedrun's RL flags plus an experiment's own: the flags it calls
    the speedrun's are the ones `bash speedrun.sh` runs (a recipe compared against the card must differ only in its
    own flags)."""
    spec = importlib.util.spec_from_file_location("rl_recipe", ROOT / "dev" / "rl_recipe.py")
    rl_recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rl_recipe)
    env = {**os.environ, "NANORL_TINY": "1", "NANORL_SKIP_INSTALL": "1", "NANORL_BASE_DIR": str(tmp_path / "base")}
    env.pop("NANORL_SMOKE", None)
    _, _, module, opts = split_command(dry_run(env)["chat_rl"])
    assert module == "scripts.chat_rl"
    assert [o for o in opts if o[0] != "--overwrite"] == options(rl_recipe.SPEEDRUN_RL)


def test_the_rl_recipe_seen_problems_are_the_ones_chat_rl_deals_first():
    """`dev/rl_recipe.py seen` grades the level 3,4 training problems an RL run of a seed was dealt: the task rows its
    prompt order puts first, as many as the speedrun's rollouts x prompts. Those rows are the ones chat_rl's own
    prompt source hands out for that seed."""
    spec = importlib.util.spec_from_file_location("rl_recipe", ROOT / "dev" / "rl_recipe.py")
    rl_recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rl_recipe)
    assert rl_recipe.DEALT == 24 * 16  # the speedrun's RL stage: 24 rollouts of 16 prompts
    from nanorl.prompts import PromptSource, task_prompts
    from tasks import get_task

    task = get_task("offline", "train", levels=(3, 4), n=500)
    dealt, _ = PromptSource(task_prompts(task, "offline", "train"), seed=7).get(40)
    rows, _ = PromptSource(list(range(len(task))), seed=7).get(40)
    assert [p["metadata"]["row"] for p in dealt] == rows
    assert [p["conversation"] for p in dealt] == [task.get_example(r) for r in rows]
    assert sorted(rows) != rows  # shuffled: not simply the task's first rows
