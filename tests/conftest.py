"""
The tests not marked `gpu` run on the CPU by construction, also on a GPU machine: fp32 bit-exactness checks and
2-rank gloo runs assume it. For each of them NANORL_DEVICE_TYPE=cpu makes nanorl.common.autodetect_device_type pick
the CPU (in this process, where CUDA may already be initialised, and in every script or worker a test starts), and
CUDA_VISIBLE_DEVICES="" hides the GPU from those processes. Tests marked `gpu` see the environment as it was.
"""

import os

import pytest
import torch

HIDE = {"NANORL_DEVICE_TYPE": "cpu", "CUDA_VISIBLE_DEVICES": ""}

if os.environ.get("PYTEST_XDIST_WORKER"):
    # tests/run.sh runs tests in parallel workers (pytest -n): one thread each, here and in the scripts a test starts,
    # or the workers' threads fight over the cores; its pass on other kernels asks for another count (another
    # summation order inside the GEMMs)
    threads = os.environ.get("NANORL_TEST_THREADS", "1")
    os.environ["OMP_NUM_THREADS"] = threads
    torch.set_num_threads(int(threads))
AT_START = {k: os.environ.get(k) for k in HIDE}

# CUDA reads CUDA_VISIBLE_DEVICES once, when this process first asks for a device: ask now, so that a first ask made
# under a hiding test cannot hide the GPU from the gpu tests that run after it
torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _cpu_unless_marked_gpu(request, monkeypatch):
    if request.node.get_closest_marker("gpu") is None:
        for k, v in HIDE.items():
            monkeypatch.setenv(k, v)


@pytest.fixture
def device_env_at_start():
    """NANORL_DEVICE_TYPE and CUDA_VISIBLE_DEVICES as pytest started (None: unset)."""
    return dict(AT_START)


@pytest.fixture(autouse=True)
def _fp32_only_in_fp32(request):
    # a test marked fp32("why") compares against an fp32 reference by design: under CUDA's dtype layout it cannot hold
    marker = request.node.get_closest_marker("fp32")
    if marker is not None and os.environ.get("NANORL_CUDA_DTYPES") == "1":
        pytest.skip(f"fp32 only: {marker.args[0]}")


def pytest_collection_modifyitems(config, items):
    """The slow end-to-end tests first: the parallel workers then share out the short ones and finish together,
    instead of one worker starting a four-minute test when the others are nearly done."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # a stable sort: file order otherwise
