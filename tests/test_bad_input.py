"""
Every script x bad input: the run stops with exit code != 0 and ONE line on stderr that names the flag, file or row
at fault; no traceback. Unexpected errors keep theirs, and NANORL_DEBUG=1 shows it for bad input too.

The table runs each script in this process (runpy, as `python -m` would, with the uncaught exception handed to
sys.excepthook exactly as the interpreter hands it): a subprocess per case would spend ~10 s importing torch. A few
cases run as real subprocesses to show that the hook is installed in a fresh interpreter.
"""

import contextlib
import io
import json
import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanorl.checkpoint import save_checkpoint
from nanorl.gpt import build_model, config_from_depth
from nanorl.optim import build_optimizer
from nanorl.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
TAG, STEP = "t", 1


# -----------------------------------------------------------------------------------------------
# fixtures: one tiny pipeline (tokenizer, base/mid/sft/rl checkpoints, an exported HF directory), copied per case


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """A base dir with a 300-token tokenizer and the same 1-layer model saved as every stage's step 1 (optimizer
    and extra state included, so --resume finds them), plus that model exported as a HF directory."""
    from nanorl import synthetic
    from nanorl.hf import export_hf

    base = tmp_path_factory.mktemp("pipeline")
    docs = [d for _, d in zip(range(300), synthetic.pretrain_documents("train"))]
    tok = Tokenizer.train(iter(docs), 300)
    tok.save(str(base / "tokenizer"))
    torch.manual_seed(0)
    # the model base_train builds from TINY_BASE's flags, so that --resume finds the same config
    model = build_model(config_from_depth(1, tok.vocab_size, 512, 32, 16, None), "cpu")
    optim = build_optimizer(model).state_dict()
    for stage in ("base", "mid", "sft", "rl"):
        meta = {"model_config": model.config.to_dict(), "model_tag": TAG, "step": STEP, "world_size": 1}
        save_checkpoint(str(base / f"{stage}_checkpoints" / TAG), STEP, model.state_dict(), optim, meta, {"loader": {}})
    export_hf(model, tok, str(base / "hf"))
    (base / "data_empty").mkdir()
    (base / "bad.jsonl").write_text('{"question": "1+1?", "answer": "2 #### 2"}\n{"question": "no answer"}\n')
    (base / "garbage.jsonl").write_text("not json\n[1, 2]\n")
    return base


def ck(stage, kind):
    """A file of the fixture's step: kind model / meta / optim / extra."""
    name = {
        "model": "model_{:06d}.safetensors",
        "meta": "meta_{:06d}.json",
        "optim": "optim_{:06d}.pt",
        "extra": "extra_{:06d}_rank0.pt",
    }[kind].format(STEP)
    return f"{stage}_checkpoints/{TAG}/{name}"


def truncate(rel):
    def damage(base):
        p = base / rel
        p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2])

    return damage


def empty(rel):
    return lambda base: (base / rel).write_bytes(b"")


def remove(rel):
    return lambda base: (base / rel).unlink()


def write(rel, text):
    return lambda base: (base / rel).write_text(text)


def edit_json(rel, fn):
    def damage(base):
        p = base / rel
        p.write_text(json.dumps(fn(json.loads(p.read_text()))))

    return damage


def drop(key):
    return lambda d: {k: v for k, v in d.items() if k != key}


def run_script(module, argv, env):
    """`python -m module *argv` in this process: (exit code, stdout, stderr). An uncaught exception goes to
    sys.excepthook and SystemExit is handled as the interpreter handles them."""
    out, err = io.StringIO(), io.StringIO()
    saved_argv, saved_env = sys.argv, dict(os.environ)
    sys.argv = [module.split(".")[-1] + ".py", *argv]
    os.environ.update(env)
    sys.modules.pop(
        module, None
    )  # a test that imported it (to drive it in-process) leaves it: `python -m` runs it anew
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
                if not isinstance(e.code, int) and e.code is not None:
                    print(e.code, file=sys.stderr)
            except Exception:
                sys.excepthook(*sys.exc_info())
                code = 1
    finally:
        sys.argv = saved_argv
        os.environ.clear()
        os.environ.update(saved_env)
    return code, out.getvalue(), err.getvalue()


# -----------------------------------------------------------------------------------------------
# the table: (script, argv, damage or None, what the one line must say). {base} is the case's base directory.

TINY_BASE = [
    "--depth",
    "1",
    "--aspect-ratio",
    "32",
    "--head-dim",
    "16",
    "--max-seq-len",
    "512",
    "--device-batch-size",
    "1",
    "--total-batch-size",
    "512",
    "--num-iterations",
    "1",
    "--eval-every",
    "-1",
    "--sample-every",
    "-1",
]
TINY_SFT = ["--num-examples", "20", "--num-iterations", "1", "--device-batch-size", "1", "--eval-tokens", "64"]
TINY_RL = [
    "--num-rollouts",
    "1",
    "--rollout-batch-size",
    "2",
    "--n-samples-per-prompt",
    "2",
    "--eval-max-problems",
    "2",
    "--n-samples-per-eval-prompt",
    "1",
    "--pass-k",
    "1",
    "--max-new-tokens",
    "4",
]
RESUME = TINY_BASE + ["--model-tag", TAG, "--resume"]
CUDA = ["--device-type", "cuda"]
HF, TOKENIZER = "{base}/hf", "tokenizer/tokenizer.json"
NO_CONFIG = "{base}/hf/config.json is missing"
OUT = ["-i", "sft", "-o", "{base}/out"]
CASES = [
    ("tok_train", ["--data-dir", "{base}/nowhere"], None, "--data-dir {base}/nowhere does not exist"),
    ("tok_train", ["--data-dir", "{base}/data_empty"], None, "--data-dir {base}/data_empty has no"),
    ("tok_train", ["--vocab-size", "10"], None, "--vocab-size 10 is too small"),
    ("tok_eval", ["--data-dir", "{base}/nowhere"], None, "--data-dir {base}/nowhere does not exist"),
    ("tok_eval", [], truncate(TOKENIZER), TOKENIZER + " is corrupt"),
    ("tok_eval", [], empty(TOKENIZER), TOKENIZER + " is corrupt"),
    ("tok_eval", [], remove(TOKENIZER), "no tokenizer at {base}/" + TOKENIZER),
    ("base_train", TINY_BASE + ["--data-dir", "{base}/nowhere"], None, "--data-dir {base}/nowhere does not exist"),
    ("base_train", TINY_BASE + ["--data-dir", "{base}/data_empty"], None, "--data-dir {base}/data_empty has no"),
    ("base_train", TINY_BASE + CUDA, None, "--device-type cuda"),
    ("base_train", TINY_BASE, truncate(TOKENIZER), TOKENIZER + " is corrupt"),
    ("base_train", RESUME, remove(ck("base", "optim")), ck("base", "optim") + " is missing"),
    ("base_train", RESUME, remove(ck("base", "extra")), ck("base", "extra") + " is missing"),
    ("base_train", RESUME, truncate(ck("base", "optim")), ck("base", "optim") + " is corrupt"),
    ("base_train", RESUME, write(ck("base", "meta"), "{oops"), ck("base", "meta") + " is corrupt"),
    (
        "base_train",
        RESUME,
        edit_json(ck("base", "meta"), drop("model_config")),
        ck("base", "meta") + " has no model_config",
    ),
    ("base_eval", ["--model-tag", "nope"], None, "no base checkpoint tagged 'nope'"),
    ("base_eval", ["--model-step", "7"], None, "checkpoint step 7 is incomplete or missing"),
    ("base_eval", [], truncate(ck("base", "model")), ck("base", "model") + " is corrupt"),
    ("base_eval", [], empty(ck("base", "model")), ck("base", "model") + " is corrupt"),
    ("base_eval", [], write(ck("base", "meta"), "garbage"), ck("base", "meta") + " is corrupt"),
    ("base_eval", [], edit_json(ck("base", "meta"), drop("model_config")), ck("base", "meta") + " has no model_config"),
    ("base_eval", ["--eval", "bpb", "--data-dir", "{base}/nowhere"], None, "--data-dir {base}/nowhere does not exist"),
    ("base_eval", CUDA, None, "--device-type cuda"),
    ("mid_train", TINY_SFT + ["--identity-path", "{base}/nowhere.jsonl"], None, "{base}/nowhere.jsonl does not exist"),
    (
        "mid_train",
        TINY_SFT + ["--identity-path", "{base}/garbage.jsonl"],
        None,
        "{base}/garbage.jsonl has no valid conversations",
    ),
    ("mid_train", TINY_SFT + ["--levels", "9"], None, "argument --levels: 9 is out of range"),
    ("mid_train", TINY_SFT + ["--levels", "one"], None, "argument --levels: 'one' is not"),
    ("mid_train", TINY_SFT + ["--resume"], remove(ck("mid", "optim")), ck("mid", "optim") + " is missing"),
    ("mid_train", TINY_SFT, truncate(ck("base", "model")), ck("base", "model") + " is corrupt"),
    ("mid_train", TINY_SFT + ["--hf-model", HF], remove("hf/config.json"), NO_CONFIG),
    ("mid_train", TINY_SFT + CUDA, None, "--device-type cuda"),
    ("chat_sft", TINY_SFT + ["--identity-path", "{base}/nowhere.jsonl"], None, "{base}/nowhere.jsonl does not exist"),
    ("chat_sft", TINY_SFT + ["--levels", "0"], None, "argument --levels: 0 is out of range"),
    ("chat_sft", TINY_SFT + ["--source", "mid", "--model-tag", "nope"], None, "no mid checkpoint tagged 'nope'"),
    ("chat_sft", TINY_SFT + ["--resume"], remove(ck("sft", "extra")), ck("sft", "extra") + " is missing"),
    ("chat_sft", TINY_SFT, empty(ck("mid", "model")), ck("mid", "model") + " is corrupt"),
    ("chat_sft", TINY_SFT, write(ck("mid", "meta"), "[]"), ck("mid", "meta") + " is corrupt"),
    ("chat_sft", TINY_SFT + ["--hf-model", HF], truncate("hf/model.safetensors"), HF + "/model.safetensors is corrupt"),
    (
        "chat_sft",
        TINY_SFT + ["--hf-model", HF],
        edit_json("hf/config.json", lambda c: {**c, "model_type": "llama"}),
        HF + "/config.json: architectures[0] NanoChatForCausalLM contradicts model_type 'llama'",
    ),
    ("chat_rl", TINY_RL + ["--task", "nope"], None, "unknown task 'nope'"),
    ("chat_rl", TINY_RL + ["--levels", "9"], None, "argument --levels: 9 is out of range"),
    ("chat_rl", TINY_RL + ["--levels", "2,x"], None, "argument --levels: '2,x' is not"),
    ("chat_rl", TINY_RL + ["--task", "gsm8k", "--task-path", "{base}/bad.jsonl"], None, "{base}/bad.jsonl: row 2"),
    ("chat_rl", TINY_RL + ["--prompt-data", "{base}/nowhere.jsonl"], None, "{base}/nowhere.jsonl does not exist"),
    ("chat_rl", TINY_RL + ["--model-tag", "nope"], None, "no sft checkpoint tagged 'nope'"),
    ("chat_rl", TINY_RL, truncate(ck("sft", "model")), ck("sft", "model") + " is corrupt"),
    ("chat_rl", TINY_RL + ["--hf-model", HF], truncate("hf/model.safetensors"), HF + "/model.safetensors is corrupt"),
    (
        "chat_rl",
        TINY_RL + ["--hf-model", HF],
        edit_json("hf/config.json", drop("hidden_size")),
        HF + "/config.json lacks hidden_size",
    ),
    ("chat_rl", TINY_RL + ["--resume"], remove(ck("rl", "optim")), ck("rl", "optim") + " is missing"),
    ("chat_eval", ["-a", "nope"], None, "unknown task 'nope'"),
    ("chat_eval", ["--levels", "9"], None, "argument --levels: 9 is out of range"),
    ("chat_eval", ["-a", "gsm8k", "--task-path", "gsm8k={base}/bad.jsonl"], None, "{base}/bad.jsonl: row 2"),
    ("chat_eval", ["-g", "nope"], None, "no sft checkpoint tagged 'nope'"),
    ("chat_eval", ["-s", "9"], None, "checkpoint step 9 is incomplete or missing"),
    ("chat_eval", [], write(ck("sft", "meta"), "{"), ck("sft", "meta") + " is corrupt"),
    (
        "chat_eval",
        [],
        edit_json(ck("sft", "meta"), lambda m: {**m, "model_config": {"n_layer": 1, "wings": 2}}),
        ck("sft", "meta") + " has a model_config",
    ),
    (
        "chat_eval",
        ["--hf-model", HF],
        edit_json("hf/config.json", lambda c: {**c, "architectures": ["GPT2Model"]}),
        HF + "/config.json: architecture GPT2Model is not supported",
    ),
    ("chat_eval", ["--hf-model", HF], write("hf/tokenizer_config.json", "{"), HF + "/tokenizer_config.json is corrupt"),
    ("chat_eval", ["--hf-model", "{base}/nowhere"], None, "--hf-model {base}/nowhere: no such directory"),
    ("chat_eval", CUDA, None, "--device-type cuda"),
    ("chat_cli", ["-p", "hi", "-g", "nope"], None, "no sft checkpoint tagged 'nope'"),
    ("chat_cli", ["-p", "hi"], truncate(ck("sft", "model")), ck("sft", "model") + " is corrupt"),
    ("chat_cli", ["-p", "hi"], truncate(TOKENIZER), TOKENIZER + " is corrupt"),
    ("chat_cli", ["-p", "hi", "--hf-model", HF], remove("hf/config.json"), NO_CONFIG),
    ("chat_cli", ["-p", "hi", "--hf-model", HF], truncate("hf/tokenizer.json"), HF + "/tokenizer.json"),
    ("export_hf", ["-i", "sft", "-g", "nope", "-o", "{base}/out"], None, "no sft checkpoint tagged 'nope'"),
    ("export_hf", OUT, edit_json(ck("sft", "meta"), drop("model_config")), ck("sft", "meta") + " has no model_config"),
    ("export_hf", OUT, truncate(ck("sft", "model")), ck("sft", "model") + " is corrupt"),
    ("export_hf", OUT, remove(ck("sft", "model")), "no sft checkpoint in {base}/sft_checkpoints"),
]


def case_id(case):
    script, argv, damage, _ = case
    flags = " ".join(a.replace("{base}/", "") for a in argv if a not in TINY_BASE + TINY_SFT + TINY_RL)
    return f"{script}:{flags}" + (f":{damage.__qualname__.split('.')[0]}" if damage else "")


def prepare(pipeline, tmp_path, damage):
    base = tmp_path / "base"
    shutil.copytree(pipeline, base)
    if damage is not None:
        damage(base)
    return base


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_bad_input_is_one_line(case, pipeline, tmp_path):
    script, argv, damage, expect = case
    base = prepare(pipeline, tmp_path, damage)
    env = {"NANORL_BASE_DIR": str(base), "NANORL_DEBUG": "", "HOME": str(tmp_path)}
    code, out, err = run_script(f"scripts.{script}", [a.format(base=base) for a in argv], env)
    lines = err.strip("\n").split("\n")
    assert code not in (0, None) and "Traceback" not in err and len(lines) == 1, (code, err[-3000:])
    assert expect.format(base=base) in lines[0], lines[0]


# -----------------------------------------------------------------------------------------------
# the hook itself: one line on rank 0, the traceback for anything else or under NANORL_DEBUG=1


def test_hook_prints_one_line_on_rank_zero_and_falls_back_otherwise(monkeypatch, capsys):
    from nanorl.errors import MissingFile, excepthook

    fallback_calls = []

    def fallback(*exc):
        fallback_calls.append(exc[0])

    monkeypatch.setattr(sys, "argv", ["/x/scripts/chat_eval.py"])
    monkeypatch.delenv("NANORL_DEBUG", raising=False)
    msg = "checkpoint file c/extra_000001_rank1.pt is missing"
    err = MissingFile(msg)
    for rank, local_rank, every_rank, want in [
        ("0", "0", False, f"chat_eval.py: error: {msg}\n"),
        ("1", "1", False, ""),  # rank 0 says the same
        ("1", "1", True, f"[rank 1] chat_eval.py: error: {msg}\n"),  # its own file
        ("8", "0", False, f"[rank 8] chat_eval.py: error: {msg}\n"),
    ]:  # the first rank of another node
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        err.every_rank = every_rank
        excepthook(MissingFile, err, None, fallback)
        assert capsys.readouterr().err == want
    assert fallback_calls == []
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    excepthook(ZeroDivisionError, ZeroDivisionError("x"), None, fallback)  # a bug: its traceback
    monkeypatch.setenv("NANORL_DEBUG", "1")
    excepthook(MissingFile, err, None, fallback)  # asked for: the traceback of bad input too
    assert fallback_calls == [ZeroDivisionError, MissingFile] and capsys.readouterr().err == ""


def test_a_fresh_interpreter_has_the_hook(pipeline, tmp_path):
    """Real processes, started together: bad input is one line, NANORL_DEBUG=1 and a bug keep the traceback."""
    raise_bad = "import nanorl; from nanorl.errors import BadValue; raise BadValue('--levels 9: out of range')"
    runs = {
        "bad input": ([sys.executable, "-c", raise_bad], {}),
        "debug": ([sys.executable, "-c", raise_bad], {"NANORL_DEBUG": "1"}),
        "bug": ([sys.executable, "-c", "import nanorl; 1 / 0"], {}),
        "script": ([sys.executable, "-m", "scripts.chat_eval", "-g", "nope"], {"NANORL_BASE_DIR": str(pipeline)}),
    }
    procs = {
        k: subprocess.Popen(
            cmd,
            cwd=ROOT,
            env={**os.environ, "NANORL_DEBUG": "", "OMP_NUM_THREADS": "1", **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for k, (cmd, env) in runs.items()
    }
    out = {k: (p.communicate(timeout=300), p.returncode) for k, p in procs.items()}
    assert out["bad input"] == (("", "error: --levels 9: out of range\n"), 1)
    (_, err), code = out["debug"]
    assert code == 1 and err.startswith("Traceback")
    assert err.endswith("nanorl.errors.BadValue: --levels 9: out of range\n")
    (_, err), code = out["bug"]
    assert code == 1 and err.startswith("Traceback") and err.endswith("ZeroDivisionError: division by zero\n")
    (_, err), code = out["script"]
    assert code == 1
    assert err == f"chat_eval.py: error: no sft checkpoint tagged 'nope' in {pipeline}/sft_checkpoints; found: ['t']\n"


# -----------------------------------------------------------------------------------------------
# the undamaged fixture runs: the table's failures come from the damage, not from the fixture


def test_chat_eval_says_what_it_evaluates_before_it_starts(pipeline, tmp_path):
    base = prepare(pipeline, tmp_path, None)
    argv = ["-a", "offline", "--levels", "2,3", "-x", "2", "-n", "2", "-t", "0.7", "--top-k", "5", "-m", "3", "-k", "1"]
    code, out, err = run_script("scripts.chat_eval", argv, {"NANORL_BASE_DIR": str(base), "HOME": str(tmp_path)})
    assert code == 0, err[-3000:]
    lines = out.splitlines()
    assert (
        lines[0] == f"loaded sft checkpoint t step 1 from {base / 'sft_checkpoints' / 't'}"
    )  # model_loading.load_model
    header = lines.index(
        "evaluating sft checkpoint t step 1 on offline (levels 2,3) (at most 2 problems per "
        "task): temperature 0.7, top-k 5, 2 samples per problem, at most 3 new tokens"
    )
    assert header < next(i for i, line in enumerate(lines) if "offline: accuracy" in line)  # said before it starts


def test_a_python_without_the_dependencies_is_told_to_activate_the_venv():
    """A shell that has not activated .venv runs a python without torch: the script ends in one line saying so (no
    traceback ending in "No module named 'torch'"); the hook's list of dependencies is pyproject.toml's."""
    import re

    from nanorl.errors import DEPENDENCIES

    code = (
        "import sys, runpy; sys.modules['torch'] = None; sys.argv = ['chat_cli.py', '-i', 'rl']; "
        "runpy.run_module('scripts.chat_cli', run_name='__main__', alter_sys=True)"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stdout == "", r.stderr
    assert r.stderr == (
        f"chat_cli.py: error: no module named 'torch' in {sys.executable}: run nanorl in its virtual environment, "
        "`source .venv/bin/activate` first (bash speedrun.sh created it)\n"
    )
    listed = (ROOT / "pyproject.toml").read_text().split("\ndependencies = [")[1].split("\n]")[0]
    names = set(re.findall(r'^\s*"([A-Za-z0-9_-]+)', listed, re.M))
    assert len(names) >= 10 and names <= set(DEPENDENCIES)
