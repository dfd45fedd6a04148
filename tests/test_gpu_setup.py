"""A GPU machine's setup, tested on the CPU with a fake nvidia-smi: the torch wheel its driver runs, the one-line
failure when torch cannot see the GPU (compute_init, gpu_check), the packages torch.compile needs, and the device
batch search that keeps base_train within memory."""

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanorl import gpu_setup
from nanorl.batch_fit import batch_candidates, fit_device_batch
from nanorl.common import compute_init

ROOT = Path(__file__).resolve().parents[1]
CU126 = "https://download.pytorch.org/whl/cu126"

FAKE_SMI = """#!/usr/bin/env bash
# nvidia-smi on an 8xH100 node whose driver is {driver} (CUDA {cuda})
case "$*" in
    -L) for i in 0 1 2 3 4 5 6 7; do echo "GPU $i: NVIDIA H100 80GB HBM3 (UUID: GPU-0000000$i)"; done ;;
    *--query-gpu=driver_version*) for i in 0 1 2 3 4 5 6 7; do echo "{driver}"; done ;;
    "") echo "| NVIDIA-SMI {driver}      Driver Version: {driver}     CUDA Version: {cuda}     |" ;;
    *) exit 2 ;;
esac
"""


def fake_smi(tmp_path, driver="535.183.01", cuda="12.2"):
    """A directory holding a fake nvidia-smi, to put first on PATH."""
    bin_dir = tmp_path / "fake_bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(FAKE_SMI.format(driver=driver, cuda=cuda))
    smi.chmod(0o755)
    return bin_dir


def gpu_env(tmp_path, **extra):
    """The environment of a machine whose nvidia-smi shows 8 H100s on driver 535, with this CPU build of torch."""
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "NANORL_TINY", "NANORL_SMOKE")}
    env.update(PATH=f"{fake_smi(tmp_path)}:{env['PATH']}", PYTHONPATH=str(ROOT), NANORL_BASE_DIR=str(tmp_path / "base"))
    return {**env, **extra}


# ----------------------------------------------------------------------------------------------
# the driver -> wheel mapping


@pytest.mark.parametrize(
    "driver_cuda, build",
    [
        ((12, 2), (12, 6)),
        ((12, 0), (12, 6)),
        ((12, 4), (12, 6)),  # 525-550: the oldest 12.x, by minor compatibility
        ((12, 6), (12, 6)),
        ((12, 8), (12, 8)),
        ((12, 9), (12, 8)),  # 560-575: the newest build not newer than it
        ((13, 0), (13, 0)),
        ((13, 1), (13, 0)),
        ((13, 2), (13, 2)),
        ((13, 4), (13, 2)),
        ((14, 0), (13, 2)),
        ((11, 8), None),
        ((11, 4), None),  # no torch 2.11-2.13 wheel runs there
    ],
)
def test_pick_wheel_takes_the_newest_build_the_driver_runs(driver_cuda, build):
    assert gpu_setup.pick_wheel(driver_cuda) == build


def test_the_torch_pin_is_the_one_in_pyproject():
    pin = re.search(r'"(torch[^"]*)"', (ROOT / "pyproject.toml").read_text())[1]
    assert gpu_setup.TORCH_SPEC == pin


def test_read_driver_parses_nvidia_smi(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{fake_smi(tmp_path)}:{os.environ['PATH']}")
    assert gpu_setup.read_driver() == gpu_setup.Driver("535.183.01", (12, 2), 8)
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert gpu_setup.read_driver() is None


def test_wheel_command_names_the_build_and_why(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "nanorl.gpu_setup", "wheel"],
        env=gpu_env(tmp_path),
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["12.6", CU126, "torch>=2.11,<2.14"]
    assert "driver 535.183.01 runs CUDA up to 12.2: torch built for CUDA 12.6" in out.stderr
    env = gpu_env(tmp_path)
    env["PATH"] = f"{fake_smi(tmp_path / 'old', '470.256.02', '11.4')}:{env['PATH']}"
    old = subprocess.run(
        [sys.executable, "-m", "nanorl.gpu_setup", "wheel"], env=env, cwd=ROOT, capture_output=True, text=True
    )
    assert old.returncode == 1 and old.stdout == ""
    assert old.stderr.strip() == (
        "driver 470.256.02: no torch>=2.11,<2.14 wheel runs on CUDA 11.4: upgrade the "
        "NVIDIA driver to one for CUDA >= 12.0"
    )


# ----------------------------------------------------------------------------------------------
# torch must see the GPU that the machine shows


def test_no_gpu_message_names_the_build_the_driver_and_the_fix():
    # PyPI's default wheel (CUDA 13.0) on a 535 driver: torch.cuda.is_available() is False
    driver = gpu_setup.Driver("535.183.01", (12, 2), 8)
    assert gpu_setup.no_gpu_message("2.13.0+cu130", "13.0", driver) == (
        "nvidia-smi shows 8 GPU(s), driver 535.183.01 (CUDA up to 12.2), but torch 2.13.0+cu130 (built for CUDA 13.0) "
        f"sees none: install the build this driver runs: pip install 'torch>=2.11,<2.14' --index-url {CU126}"
    )
    assert gpu_setup.no_gpu_message("2.13.0+cu130", "13.0", gpu_setup.Driver("570.86.15", (12, 8), 1)).endswith(
        "--index-url https://download.pytorch.org/whl/cu128"
    )


def test_compute_init_stops_when_torch_cannot_see_the_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{fake_smi(tmp_path)}:{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # what a +cpu or too-new CUDA build reports
    for device_type in (None, "cuda"):
        with pytest.raises(SystemExit) as e:
            compute_init(device_type)
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        assert str(e.value) == (
            f"nvidia-smi shows 8 GPU(s), driver 535.183.01 (CUDA up to 12.2), but torch "
            f"{torch.__version__} ({build}) sees none: install the build this driver runs: pip install 'torch>=2.11,<2.14' "
            f"--index-url {CU126}"
        )
    assert compute_init("cpu")[-1] == torch.device("cpu")  # asked for explicitly: no objection
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # every GPU hidden on purpose: the CPU, as asked
    assert compute_init()[-1].type in ("cpu", "mps")


def test_nvidia_tools_without_a_gpu_are_no_gpu(tmp_path, monkeypatch):
    # an image with the driver's tools run without GPUs: nvidia-smi is there but finds no device
    smi = tmp_path / "nvidia-smi"
    smi.write_text('#!/usr/bin/env bash\necho "No devices were found"; exit 6\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(gpu_setup, "glob", SimpleNamespace(glob=lambda pattern: []))  # and no /dev/nvidia0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_setup.read_driver() is None and not gpu_setup.gpu_visible()
    assert compute_init()[-1].type in ("cpu", "mps")
    monkeypatch.setattr(gpu_setup, "glob", SimpleNamespace(glob=lambda pattern: ["/dev/nvidia3"]))  # a GPU's node
    with pytest.raises(
        SystemExit,
        match=r"^an NVIDIA GPU is present \(/dev/nvidia\*\) but torch .* sees none and "
        r"nvidia-smi does not answer",
    ):
        compute_init()


def test_compute_init_turns_on_expandable_segments_for_cuda_only(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    compute_init("cpu")
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    # on CUDA (faked: is_available and the device count; nothing touches a real device before the flag is set)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda seed: None)
    compute_init("cuda")
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")  # the user's setting wins
    compute_init("cuda")
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"


def test_compute_init_refuses_more_local_ranks_than_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for k, v in {"RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit, match=r"^local rank 3 has no GPU: torch sees 2 "):
        compute_init("cuda")


def test_gpu_check_fails_instead_of_measuring_the_cpu(tmp_path):
    out = subprocess.run(
        ["bash", "dev/gpu_check.sh", str(tmp_path / "x.md")],
        cwd=ROOT,
        env=gpu_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "driver 535.183.01" in lines[0] and f"--index-url {CU126}" in lines[0], out.stderr
    assert not (tmp_path / "x_logs").exists() and not (tmp_path / "x.md").exists()  # no step ran


# ----------------------------------------------------------------------------------------------
# a minimal image: what torch.compile needs


def test_missing_packages_names_the_debian_packages(tmp_path):
    headers = tmp_path / "include"
    headers.mkdir()
    (headers / "Python.h").write_text("")
    dev = f"python{sys.version_info[0]}.{sys.version_info[1]}-dev"
    found = {"gcc": "/usr/bin/gcc", "clang": "/usr/bin/clang", "mycc": "/opt/mycc"}
    assert gpu_setup.missing_packages("", found.get, str(headers)) == []
    assert gpu_setup.missing_packages("", {"clang": "/usr/bin/clang"}.get, str(headers)) == []  # Triton takes clang
    assert gpu_setup.missing_packages("", {}.get, str(headers)) == ["gcc"]
    assert gpu_setup.missing_packages("mycc", found.get, str(tmp_path)) == [dev]  # no Python.h there
    assert gpu_setup.missing_packages("nocc", found.get, str(tmp_path)) == ["gcc", dev]  # $CC names a missing one


# ----------------------------------------------------------------------------------------------
# base_train's device batch: the largest that fits, the same on every rank


def oom_above(limit, calls):
    def try_step(batch):
        calls.append(batch)
        if batch > limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory at batch {batch}")

    return try_step


def test_batch_candidates_halve_and_keep_the_tokens_per_step():
    assert batch_candidates(32, 524288, 2048) == [32, 16, 8, 4, 2, 1]
    assert batch_candidates(32, 524288, 2048 * 8) == [32, 16, 8, 4, 2, 1]  # 8 ranks: 524288 / 16384 = 32 rows
    assert batch_candidates(32, 2048 * 24, 2048) == [8, 4, 2, 1]  # 32 and 16 do not divide 24 rows
    assert batch_candidates(32, 2048 * 24 + 1, 2048) == []


def test_fit_device_batch_halves_until_a_step_fits():
    calls = []
    batch, too_big = fit_device_batch(oom_above(12, calls), batch_candidates(32, 524288, 2048))
    assert (batch, too_big, calls) == (8, [32, 16], [32, 16, 8])
    assert 524288 // (batch * 2048) == 32  # base_train's gradient accumulation: 32 micro-steps of 8 x 2048 tokens
    calls = []
    assert fit_device_batch(oom_above(100, calls), [32, 16]) == (32, []) and calls == [32]
    with pytest.raises(SystemExit, match=r"out of memory even at a device batch of 1 row\(s\) \(tried \[4, 2, 1\]\)"):
        fit_device_batch(oom_above(0, []), [4, 2, 1])


def _fit_worker(rank, world, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    calls = []
    limit = {0: 16, 1: 5}[rank]  # rank 1 has less memory to spare
    batch, too_big = fit_device_batch(oom_above(limit, calls), batch_candidates(32, 524288, 2048 * world))
    Path(out_dir, f"{rank}.txt").write_text(f"{batch} {too_big} {calls}")
    dist.destroy_process_group()


def test_fit_device_batch_ranks_agree_on_the_smallest(tmp_path):
    mp.spawn(_fit_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    # rank 0 fits 16 but waits for rank 1, which fits only 4: both take 4 and tried the same batches
    assert (tmp_path / "0.txt").read_text() == "4 [32, 16, 8] [32, 16, 8, 4]"
    assert (tmp_path / "1.txt").read_text() == "4 [32, 16, 8] [32, 16, 8, 4]"
