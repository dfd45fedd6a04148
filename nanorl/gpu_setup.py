"""
Setting up a GPU machine: which PyTorch wheel its NVIDIA driver can run, whether torch then sees the GPUs, and what
a minimal image lacks for torch.compile. speedrun.sh and dev/gpu_check.sh call it; compute_init uses its message.
Only the standard library at import time: speedrun runs it before torch is installed.

    python -m nanorl.gpu_setup wheel      # this driver's build: "12.6 https://download.pytorch.org/whl/cu126 torch..."
    python -m nanorl.gpu_setup check      # the GPUs torch sees; exit 1, in one line, if the machine shows one but
                                          # torch sees none
    python -m nanorl.gpu_setup toolchain  # the Debian/Ubuntu packages torch.compile still needs ("" if none)
"""

import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import warnings
from dataclasses import dataclass

TORCH_SPEC = "torch>=2.11,<2.14"  # the pin in pyproject.toml (a test keeps the two equal)
# The CUDA builds PyTorch publishes for those versions: 2.11 has cu126, cu128 and cu130; 2.12 and 2.13 have cu126,
# cu130 and cu132. pip then takes the newest allowed torch on the chosen index (cu128: 2.11; the others: 2.13).
WHEEL_CUDA = [(12, 6), (12, 8), (13, 0), (13, 2)]
INDEX = "https://download.pytorch.org/whl/cu{}{}"


@dataclass
class Driver:
    version: str  # "535.183.01"
    cuda: tuple  # the newest CUDA it runs, from nvidia-smi's header: (12, 2)
    gpus: int  # physical GPUs nvidia-smi lists (not what a process may use: MIG and CUDA_VISIBLE_DEVICES change that)


def read_driver():
    """The NVIDIA driver as nvidia-smi reports it, or None without a working nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        header = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=60)
        query = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    cuda = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", header.stdout)
    versions = query.stdout.split()
    if header.returncode or query.returncode or not cuda or not versions:
        return None
    return Driver(versions[0], (int(cuda[1]), int(cuda[2])), len(versions))


def pick_wheel(cuda):
    """The CUDA build (major, minor) to install for a driver that runs CUDA up to `cuda`, or None if none runs.
    The newest build not newer than the driver; failing that, the oldest one of the driver's major version:
    CUDA's minor-version compatibility runs any 12.x build on a 12.0+ driver (>= 525), 13.x on 13.0+ (>= 580)."""
    older = [b for b in WHEEL_CUDA if b <= tuple(cuda)]
    if older:
        return max(older)
    same_major = [b for b in WHEEL_CUDA if b[0] == cuda[0]]
    return min(same_major) if same_major else None


def wheel_hint(driver):
    """What to install for this driver, as one clause of an error message."""
    build = pick_wheel(driver.cuda)
    if build is None:
        oldest = min(WHEEL_CUDA)
        return (
            f"no {TORCH_SPEC} wheel runs on CUDA {driver.cuda[0]}.{driver.cuda[1]}: upgrade the NVIDIA driver "
            f"to one for CUDA >= {oldest[0]}.0"
        )
    return f"install the build this driver runs: pip install '{TORCH_SPEC}' --index-url {INDEX.format(*build)}"


def gpu_visible():
    """Whether this machine shows an NVIDIA GPU to this process, whatever torch thinks: a GPU's device node exists
    or nvidia-smi lists one (its tools alone, in an image run without GPUs, do not count), and CUDA_VISIBLE_DEVICES
    does not hide every GPU on purpose ("" or -1)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1"):
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*")) or read_driver() is not None


def no_gpu_message(torch_version, torch_cuda, driver):
    """One line for "a GPU is there but torch sees none": names the driver and the fix."""
    build = "a CPU-only build" if torch_cuda is None else f"built for CUDA {torch_cuda}"
    if driver is None:
        return (
            f"an NVIDIA GPU is present (/dev/nvidia*) but torch {torch_version} ({build}) sees none and "
            f"nvidia-smi does not answer: check the NVIDIA driver, then run python -m nanorl.gpu_setup wheel"
        )
    return (
        f"nvidia-smi shows {driver.gpus} GPU(s), driver {driver.version} (CUDA up to "
        f"{driver.cuda[0]}.{driver.cuda[1]}), but torch {torch_version} ({build}) sees none: {wheel_hint(driver)}"
    )


def cuda_available():
    """torch.cuda.is_available(), without the warning a CUDA build prints when the driver is older than its CUDA
    ("CUDA initialization: The NVIDIA driver on your system is too old"): no_gpu_message says it in one line."""
    import torch

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="CUDA initialization")
        return torch.cuda.is_available()


def torch_gpu_count():
    """The GPUs torch sees; raises SystemExit with no_gpu_message when the machine shows one and torch sees none."""
    import torch

    n = torch.cuda.device_count() if cuda_available() else 0
    if n == 0 and gpu_visible():
        raise SystemExit(no_gpu_message(torch.__version__, torch.version.cuda, read_driver()))
    return n


def missing_packages(cc=None, which=shutil.which, include_dir=None):
    """The Debian/Ubuntu packages torch.compile's Triton still needs on a GPU machine: a C compiler (Triton takes
    $CC, else gcc or clang) and the headers of this Python (Python.h). [] when both are there."""
    cc = os.environ.get("CC") if cc is None else cc
    has_cc = which(cc) is not None if cc else (which("gcc") or which("clang")) is not None
    include_dir = sysconfig.get_paths()["include"] if include_dir is None else include_dir
    missing = [] if has_cc else ["gcc"]
    if not os.path.exists(os.path.join(include_dir, "Python.h")):
        missing.append(f"python{sys.version_info[0]}.{sys.version_info[1]}-dev")
    return missing


def main(argv):
    cmd = argv[0] if argv else ""
    if cmd == "wheel":
        driver = read_driver()
        if driver is None:
            raise SystemExit("nvidia-smi does not answer: no NVIDIA driver to pick a torch build for")
        build = pick_wheel(driver.cuda)
        if build is None:
            raise SystemExit(f"driver {driver.version}: {wheel_hint(driver)}")
        index = INDEX.format(*build)
        print(
            f"driver {driver.version} runs CUDA up to {driver.cuda[0]}.{driver.cuda[1]}: torch built for CUDA "
            f"{build[0]}.{build[1]}, from {index}",
            file=sys.stderr,
        )
        print(f"{build[0]}.{build[1]} {index} {TORCH_SPEC}")
    elif cmd == "check":
        print(torch_gpu_count())
    elif cmd == "toolchain":
        print(" ".join(missing_packages()))
    else:
        raise SystemExit("usage: python -m nanorl.gpu_setup wheel|check|toolchain")


if __name__ == "__main__":
    main(sys.argv[1:])
