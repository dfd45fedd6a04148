import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanorl.common import autodetect_device_type
from nanorl.flags import ArgumentParser, fraction, int_or_off, load_function, number_in, positive_float, positive_int
from nanorl.logger import ETA, Logger, get_logger


def parse_error(parser, argv, capsys):
    with pytest.raises(SystemExit) as e:
        parser.parse_args(argv)
    err = capsys.readouterr().err
    return e.value.code, err


def test_number_flags_name_the_flag_and_the_range_on_one_line(capsys):
    p = ArgumentParser(prog="prog")
    p.add_argument("--batch", type=positive_int, default=4, help="rows")
    p.add_argument("--temperature", type=positive_float, default=1.0, help="sampling temperature")
    p.add_argument("--ratio", type=fraction, default=0.2, help="a share")
    p.add_argument("--every", type=int_or_off, default=-1, help="interval")
    p.add_argument("--port", type=number_in(int, 1, 65535), default=8000, help="TCP port")
    assert vars(
        p.parse_args(["--batch", "3", "--temperature", "0.5", "--ratio", "1", "--every", "-1", "--port", "65535"])
    ) == {"batch": 3, "temperature": 0.5, "ratio": 1.0, "every": -1, "port": 65535}
    cases = [
        (["--batch", "0"], "argument --batch: 0 is out of range: must be an integer >= 1"),
        (["--batch", "-4"], "argument --batch: -4 is out of range: must be an integer >= 1"),
        (["--batch", "2.5"], "argument --batch: '2.5' is not an integer"),
        (["--temperature", "0"], "argument --temperature: 0 is out of range: must be a number > 0"),
        (["--temperature", "nan"], "argument --temperature: nan is out of range"),
        (["--temperature", "inf"], "argument --temperature: inf is out of range"),
        (["--ratio", "1.5"], "argument --ratio: 1.5 is out of range: must be a number >= 0 and <= 1"),
        (["--every", "-2"], "argument --every: -2 is out of range: must be an integer >= -1"),
        (["--port", "99999"], "argument --port: 99999 is out of range: must be an integer >= 1 and <= 65535"),
    ]
    for argv, message in cases:
        code, err = parse_error(p, argv, capsys)
        assert code == 2 and err == f"prog: error: {message}" + err[len("prog: error: ") + len(message) :]
        assert err.count("\n") == 1 and err.endswith(" (see --help)\n"), err  # one line, no usage dump


def test_help_shows_every_default(capsys):
    p = ArgumentParser(prog="prog")
    p.add_argument("--batch", type=positive_int, default=4, help="rows")
    p.add_argument("--tag", default=None, help="checkpoint (default: the newest)")
    with pytest.raises(SystemExit):
        p.parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--batch BATCH rows (default: 4)" in out
    assert "--tag TAG checkpoint (default: the newest)" in out and "(default: None)" not in out  # said once, in words


def test_eta_averages_recent_steps_by_hand():
    eta = ETA(window=3)
    assert str(eta) == "?" and eta.minutes() is None  # nothing timed yet: no estimate, not "nan"
    eta.step(60, 0.1)
    assert eta.minutes() == pytest.approx(60 / 0.1 * 0.9 / 60)  # 9 minutes left at one minute per 10%
    for seconds, progress in [(60, 0.2), (60, 0.3), (240, 0.4)]:
        eta.step(seconds, progress)
    # the window holds the last 3 steps: 60 + 60 + 240 s for 0.3 of progress -> 1200 s per unit; 0.6 left -> 720 s
    assert eta.minutes() == pytest.approx(12.0) and str(eta) == "12.0m"
    # the last step alone would have said 0.6 / 0.1 * 240 s = 24 min: one slow step does not swing it
    eta.step(1000, 0.5, timed=False)  # a warm-up step moves progress, not the pace
    assert eta.minutes() == pytest.approx((60 + 60 + 240) / 0.3 * 0.5 / 60)
    uneven = ETA(progress=0.5, window=2)  # resumed half way; SFT's steps move progress unevenly
    uneven.step(10, 0.6)
    uneven.step(30, 0.65)
    assert uneven.minutes() == pytest.approx(40 / 0.15 * 0.35 / 60)


def test_tensorboard_event_files_hold_the_logged_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = get_logger("dummy", tensorboard_dir=str(tmp_path / "tb"))
    logger.log({"train/loss": 2.5, "train/lrm": 1.0}, step=1)
    logger.log({"step": 2, "train/loss": 2.25, "note": "text is skipped"})
    logger.log({"val/bpb": 1.125})  # no step given: the running count (2: this is the third call)
    logger.finish()
    acc = EventAccumulator(str(tmp_path / "tb")).Reload()
    assert sorted(acc.Tags()["scalars"]) == ["train/loss", "train/lrm", "val/bpb"]
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 2.5), (2, 2.25)]
    assert [(e.step, e.value) for e in acc.Scalars("val/bpb")] == [(2, 1.125)]


def test_wandb_without_a_key_fails_at_once_naming_offline_mode(monkeypatch, tmp_path):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc from `wandb login`
    monkeypatch.delenv("NETRC", raising=False)
    with pytest.raises(SystemExit) as e:
        get_logger("myrun")
    assert "set WANDB_MODE=offline" in str(e.value) and "--run 'myrun'" in str(e.value) and "\n" not in str(e.value)
    assert isinstance(get_logger("dummy"), Logger) and isinstance(get_logger("myrun", master_process=False), Logger)
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password abc\n")
    from nanorl.logger import wandb_has_credentials

    assert wandb_has_credentials()


def run_script(module, argv, monkeypatch):
    """Run a script in this process up to its flag parsing (every argv here stops there): (exit code, stdout, stderr)."""
    import contextlib
    import io
    import runpy
    import sys

    monkeypatch.setattr(sys, "argv", [module.split(".")[-1] + ".py", *argv])
    out, err = io.StringIO(), io.StringIO()
    with pytest.raises(SystemExit) as e, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        runpy.run_module(module, run_name="__main__")
    return e.value.code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("script", ["base_train", "mid_train", "chat_sft", "tok_train", "tok_eval", "base_eval"])
def test_every_flag_has_help_and_its_default(script, monkeypatch):
    code, out, _ = run_script(f"scripts.{script}", ["--help"], monkeypatch)
    assert code == 0
    entries, current = [], None
    for line in out.split("options:", 1)[1].splitlines():
        if line.startswith("  -"):
            current = [line]
            entries.append(current)
        elif current is not None and line.strip():
            current.append(line)
    entries = [" ".join(" ".join(e).split()) for e in entries if not e[0].startswith("  -h, --help")]
    usage = out.split("options:", 1)[0]
    assert {e.split()[0].rstrip(",") for e in entries} == set(
        re.findall(r"\[(--[\w-]+)", usage)
    )  # every flag has an entry
    for entry in entries:
        flag, _, text = entry.partition(" ")
        assert "default" in text and len(text.split()) >= 3, f"{script} {flag}: {text!r}"


@pytest.mark.parametrize(
    "script,argv,message",
    [
        (
            "base_train",
            ["--device-batch-size", "0"],
            "argument --device-batch-size: 0 is out of range: must be an integer >= 1",
        ),
        (
            "base_train",
            ["--device-batch-size", "-4"],
            "argument --device-batch-size: -4 is out of range: must be an integer >= 1",
        ),
        ("base_train", ["--max-seq-len", "0"], "argument --max-seq-len: 0 is out of range: must be an integer >= 1"),
        (
            "base_train",
            ["--max-seq-len", "-64"],
            "argument --max-seq-len: -64 is out of range: must be an integer >= 1",
        ),
        ("base_train", ["--head-dim", "0"], "argument --head-dim: 0 is out of range: must be an integer >= 1"),
        (
            "base_train",
            ["--total-batch-size", "0"],
            "argument --total-batch-size: 0 is out of range: must be an integer >= 1",
        ),
        (
            "base_train",
            ["--total-batch-size", "-256"],
            "argument --total-batch-size: -256 is out of range: must be an integer >= 1",
        ),
        (
            "base_train",
            ["--depth", "2", "--aspect-ratio", "32", "--head-dim", "48"],
            "--depth 2 x aspect ratio 32 = model dim 64, "
            "which is not a multiple of head_dim 48; pick a depth/aspect ratio/head dim that divides",
        ),
        (
            "chat_sft",
            ["--device-batch-size", "0"],
            "argument --device-batch-size: 0 is out of range: must be an integer >= 1",
        ),
        (
            "chat_sft",
            ["--device-batch-size", "-2"],
            "argument --device-batch-size: -2 is out of range: must be an integer >= 1",
        ),
        ("chat_sft", ["--num-epochs", "0"], "argument --num-epochs: 0 is out of range: must be a number > 0"),
        (
            "mid_train",
            ["--warmdown-ratio", "2"],
            "argument --warmdown-ratio: 2 is out of range: must be a number >= 0 and <= 1",
        ),
        ("tok_train", ["--vocab-size", "0"], "argument --vocab-size: 0 is out of range: must be an integer >= 1"),
        ("tok_eval", ["--num-docs", "-1"], "argument --num-docs: -1 is out of range: must be an integer >= 1"),
        ("base_eval", ["--split-tokens", "0"], "argument --split-tokens: 0 is out of range: must be an integer >= 1"),
    ],
)
def test_bad_numbers_stop_the_scripts_with_one_line(script, argv, message, monkeypatch):
    code, out, err = run_script(f"scripts.{script}", argv, monkeypatch)
    assert code == 2 and out == "" and err == f"{script}.py: error: {message} (see --help)\n"


def test_canonical_flag_names_and_their_aliases(monkeypatch):
    # an alias lands on our name: a bad value through either is named by ours (slime's spellings are unlisted)
    _, _, err = run_script("scripts.chat_sft", ["--eval-interval", "0"], monkeypatch)
    assert "argument --eval-every: 0 is out of range" in err
    _, _, err = run_script("scripts.base_eval", ["--step", "-1"], monkeypatch)
    assert "argument --model-step/--step: -1 is out of range" in err
    _, _, err = run_script("scripts.base_train", ["--save-interval", "-3"], monkeypatch)
    assert "argument --save-every: -3 is out of range" in err


def test_tests_not_marked_gpu_run_on_the_cpu_even_where_torch_sees_a_gpu(monkeypatch):
    # tests/conftest.py: on a GPU machine the suite's fp32 and 2-rank gloo tests must not pick CUDA
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine, as torch reports it
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""  # hidden from every process a test starts
    assert autodetect_device_type() == "cpu"  # in this process, where CUDA may already be initialised
    # a script launched as the tests launch them (their environment, no --device-type), in a process that sees a GPU
    argv = [
        "bench",
        "train",
        "--depth",
        "1",
        "--batch",
        "1",
        "--seq-len",
        "8",
        "--head-dim",
        "64",
        "--vocab-size",
        "64",
        "--warmup",
        "0",
        "--steps",
        "1",
        "--threads",
        "1",
    ]
    code = (
        "import runpy, sys, torch; torch.cuda.is_available = lambda: True; "
        f"sys.argv = {argv!r}; runpy.run_module('scripts.bench', run_name='__main__')"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])["device"] == "cpu"
    monkeypatch.delenv("NANORL_DEVICE_TYPE")
    assert autodetect_device_type() == "cuda"  # without the override the fake GPU is taken: the override did it
    monkeypatch.setenv("NANORL_DEVICE_TYPE", "gpu")
    with pytest.raises(ValueError, match=r"^NANORL_DEVICE_TYPE='gpu': expected one of cpu, cuda, mps$"):
        autodetect_device_type()


@pytest.mark.gpu
def test_tests_marked_gpu_keep_the_device_environment(device_env_at_start):
    # (runs on any machine: it only checks that tests/conftest.py hides nothing from the gpu tests)
    assert {k: os.environ.get(k) for k in device_env_at_start} == device_env_at_start


def test_a_leading_double_dash_from_torchrun_is_dropped(monkeypatch):
    # torchrun --nproc_per_node=8 -m scripts.X -- --flag: the script's argv starts with "--"
    p = ArgumentParser(prog="prog")
    p.add_argument("--depth", type=positive_int, default=20, help="layers")
    monkeypatch.setattr("sys.argv", ["prog", "--", "--depth", "4"])
    assert p.parse_args().depth == 4
    assert p.parse_args(["--", "--depth", "3"]).depth == 3 and p.parse_args(["--depth", "2"]).depth == 2
    assert p.parse_known_args(["--", "--depth", "5", "--other"]) == (p.parse_args(["--depth", "5"]), ["--other"])


def test_load_function_errors(tmp_path):
    f = tmp_path / "myrm.py"
    f.write_text("def rm(a, b):\n    return 1.0\n")
    assert load_function(f"{f}:rm", ["response", "label"], "--custom-rm-path")("x", "y") == 1.0
    with pytest.raises(ValueError, match="--custom-rm-path.*could not import"):
        load_function("no_such_module_xyz:rm", ["response", "label"], "--custom-rm-path")
    with pytest.raises(ValueError, match="no function 'nope'"):
        load_function(f"{f}:nope", ["response", "label"], "--custom-rm-path")
    with pytest.raises(ValueError, match="wrong signature"):
        load_function(f"{f}:rm", ["a", "b", "c"], "--custom-rm-path")
    with pytest.raises(ValueError, match="module:function"):
        load_function("justaname", ["a"], "--x")


def test_eta_tick_counts_the_time_between_step_lines():
    # what runs between two step lines (an eval, a save) is part of the pace: 3 steps of 10 s with a 30 s eval after
    # the second -> 60 s for 0.3 of progress; 0.7 left -> 140 s
    eta = ETA(window=5)
    eta.last = 1000.0
    for now, progress in [(1010.0, 0.1), (1020.0, 0.2), (1060.0, 0.3)]:
        eta.tick(progress, now=now)
    assert eta.minutes() == pytest.approx(60 / 0.3 * 0.7 / 60) and eta.last == 1060.0


def test_precision_line_says_which_dtypes_a_stage_runs_in(monkeypatch):
    from nanorl.precision import precision_line

    monkeypatch.delenv("NANORL_CUDA_DTYPES", raising=False)
    assert (
        precision_line("cpu")
        == "precision: fp32 (NANORL_CUDA_DTYPES=1 on a CPU with bf16 matrix units runs bf16 instead)"
    )
    cuda = "precision: bf16 autocast over fp32 weights, bf16 embedding, bf16 engine copy and KV cache"
    assert precision_line(torch.device("cuda")) == cuda
    monkeypatch.setenv("NANORL_CUDA_DTYPES", "1")
    assert precision_line("cpu") == cuda + " (CUDA's layout on the CPU: NANORL_CUDA_DTYPES=1)"


# -----------------------------------------------------------------------------------------------
# bf16 matmuls on a CPU without bf16 matrix kernels: fp32 products of bf16-rounded inputs, rounded to bf16


def test_bf16_matmuls_apply_exactly_on_a_cpu_in_cudas_layout_without_bf16_kernels(monkeypatch):
    from nanorl.precision import _Bf16MatmulsInFp32, bf16_matmuls

    for layout, kernels, expected in (("1", False, True), ("1", True, False), ("0", False, False)):
        monkeypatch.setenv("NANORL_CUDA_DTYPES", layout)
        monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda k=kernels: k)
        assert isinstance(bf16_matmuls("cpu"), _Bf16MatmulsInFp32) == expected, (layout, kernels)
        assert isinstance(bf16_matmuls(torch.device("cpu")), _Bf16MatmulsInFp32) == expected


def test_bf16_matmuls_give_a_bf16_gemms_values_and_gradients():
    """Against torch's own bf16 kernels on the same inputs: the same dtypes forward and backward, values within the
    bf16 rounding of each output (the two differ only in the order of the fp32 sum)."""
    import torch.nn.functional as F

    from nanorl.precision import _Bf16MatmulsInFp32

    def close(a, b):  # one bf16 unit of the largest value: what a different sum order can move a rounded result
        assert a.dtype == b.dtype and a.shape == b.shape
        assert (a.float() - b.float()).abs().max() <= 2**-7 * a.float().abs().max(), (a, b)

    torch.manual_seed(0)
    x, w = torch.randn(16, 48, requires_grad=True), torch.randn(40, 48, requires_grad=True)
    results = []
    for mode in (None, _Bf16MatmulsInFp32()):
        x.grad = w.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16), mode or torch.autocast("cpu", enabled=True):
            y = F.linear(x, w)
        y.float().square().sum().backward()
        results.append((y, x.grad, w.grad))
    assert results[0][0].dtype == torch.bfloat16 and results[0][1].dtype == torch.float32
    for a, b in zip(*results):
        close(a, b)
    q, k, v = (torch.randn(2, 3, 8, 16).bfloat16() for _ in range(3))
    native = (F.scaled_dot_product_attention(q, k, v, is_causal=True), q @ k.mT, torch.bmm(q[0], k[0].mT))
    with _Bf16MatmulsInFp32():
        mine = (F.scaled_dot_product_attention(q, k, v, is_causal=True), q @ k.mT, torch.bmm(q[0], k[0].mT))
    for a, b in zip(native, mine):
        close(a, b)
    # an exact case, by hand: bf16 inputs whose products and sums fp32 holds exactly give the exact bf16 result
    a = torch.tensor([[1.0, 2.0], [3.0, 0.5]], dtype=torch.bfloat16)
    with _Bf16MatmulsInFp32():
        assert torch.equal(a @ a, torch.tensor([[7.0, 3.0], [4.5, 6.25]], dtype=torch.bfloat16))
    # fp32 outside autocast is not touched: the same kernel, bit for bit
    with _Bf16MatmulsInFp32():
        assert torch.equal(F.linear(x, w), F.linear(x.detach(), w.detach()))


def test_checkpointed_log_probs_recompute_under_the_mode_their_forward_ran_in(monkeypatch):
    """RL's log-probs are checkpointed: backward recomputes them outside the forward's contexts. A model built where
    bf16 matmuls run through _Bf16MatmulsInFp32 recomputes them with recompute_like_forward: without it the
    recomputation ran torch's bf16 kernels and its tensors' dtypes differed (an error). Elsewhere no such mode can be
    active, and the checkpoints take torch's default (entering nothing)."""
    from torch.utils.checkpoint import noop_context_fn

    from nanorl.gpt import GPT, GPTConfig
    from nanorl.precision import CUDA_DTYPES_ENV, autocast_ctx, recompute_like_forward

    cfg = GPTConfig(sequence_len=32, vocab_size=64, n_layer=1, n_head=2, n_kv_head=2, n_embd=32)
    monkeypatch.setenv(CUDA_DTYPES_ENV, "0")
    assert GPT(cfg).checkpoint_context_fn is noop_context_fn
    monkeypatch.setenv(CUDA_DTYPES_ENV, "1")
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    torch.manual_seed(0)
    model = GPT(cfg)
    model.init_weights()
    assert model.checkpoint_context_fn is recompute_like_forward
    idx, tgt = torch.randint(0, 64, (2, 12)), torch.randint(0, 64, (2, 12))
    grads = []
    for checkpointed in (True, False):  # in chunks of 8 positions, recomputed in backward; and from forward's logits
        model.zero_grad()
        with autocast_ctx("cpu"):  # bf16 autocast and _Bf16MatmulsInFp32, as the RL trainer's
            if checkpointed:
                lp = model.token_logprobs(idx, tgt, chunk_size=8)
            else:
                lp = torch.log_softmax(model(idx).float(), -1).gather(-1, tgt[..., None])[..., 0]
        lp.sum().backward()
        grads.append(model.lm_head.weight.grad.clone())
    # the two paths round their logits at different points: equal within bf16 rounding of the largest gradient
    assert torch.allclose(grads[0], grads[1], rtol=0, atol=2**-7 * grads[1].abs().max())
