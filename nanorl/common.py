"""
The process a stage runs in: the base directory everything is written under, the device and torch.distributed (init,
cleanup, each rank's share of an epoch, metrics averaged over ranks, a check of the collectives' devices), and FSDP2's
type checks.
"""

import datetime
import os
import random
import sys
import time

import torch
import torch.distributed as dist

from nanorl.gpu_setup import cuda_available, gpu_visible, no_gpu_message, read_driver
from nanorl.logger import print0


def get_base_dir():
    # Everything a run writes (tokenizer, checkpoints, data, report) lives under one directory.
    base = os.environ.get("NANORL_BASE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "nanorl")
    os.makedirs(base, exist_ok=True)
    return base


DEVICE_TYPES = ("cpu", "cuda", "mps")


def autodetect_device_type():
    """cuda if torch sees a GPU, else mps, else cpu. NANORL_DEVICE_TYPE=cpu|cuda|mps overrides it: the test suite
    sets cpu for its tests not marked gpu, so that they, and the scripts they launch, run on the CPU (fp32, gloo)
    also on a GPU machine, where CUDA may already be initialised in the test process."""
    forced = os.environ.get("NANORL_DEVICE_TYPE")
    if forced:
        if forced not in DEVICE_TYPES:
            raise ValueError(f"NANORL_DEVICE_TYPE={forced!r}: expected one of {', '.join(DEVICE_TYPES)}")
        return forced
    if torch.cuda.is_available():
        return "cuda"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def is_ddp():
    return int(os.environ.get("RANK", -1)) != -1


def get_dist_info():
    """(ddp, rank, local_rank, world_size), read from torchrun's environment."""
    if is_ddp():
        return True, int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    return False, 0, 0, 1


# FSDP2's module and DTensor types are looked up, not imported: importing them costs ~1.5 s a process (DTensor pulls
# in sympy), and no model or tensor can be one unless something imported torch.distributed.fsdp (nanorl/fsdp.py
# does when it shards), so a process that never shards never pays for it


def is_sharded(model):
    """Whether fully_shard wrapped this model (FSDP2)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def is_dtensor(t):
    """Whether t is an FSDP2 shard (a DTensor)."""
    tensor = sys.modules.get("torch.distributed.tensor")
    return tensor is not None and isinstance(t, tensor.DTensor)


def epoch_order(n, seed, epoch, rank=0, world_size=1, shuffle=True):
    """This rank's strided share of the indices 0..n-1 in epoch `epoch`'s order: one permutation per (seed, epoch),
    the same on every rank, so the ranks' shares never overlap and a resumed run draws it again."""
    order = list(range(n))
    if shuffle:
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order[rank::world_size]


def compute_init(device_type=None, seed=42, timeout_s=None, cpu_collectives=False):
    """Init torch.distributed when launched by torchrun (nccl on CUDA, gloo otherwise), pick the device, seed RNGs.
    timeout_s: how long a collective waits for a missing rank before failing (torch's default: 10 min).
    cpu_collectives: on CUDA also accept CPU tensors (gloo beside nccl; FSDP's CPU offload needs it)."""
    if device_type in (None, "cuda") and not cuda_available():
        if gpu_visible():  # a GPU this torch cannot use (a CPU build, or one built for a newer CUDA than the
            # driver's): stop, rather than run a GPU-sized job on the host until it is killed
            raise SystemExit(no_gpu_message(torch.__version__, torch.version.cuda, read_driver()))
        if device_type == "cuda":
            raise SystemExit("--device-type cuda was asked for but torch sees no CUDA GPU")
    device_type = device_type or autodetect_device_type()
    _, _, local_rank, _ = get_dist_info()
    if device_type == "cuda" and local_rank >= torch.cuda.device_count():
        raise SystemExit(
            f"local rank {local_rank} has no GPU: torch sees {torch.cuda.device_count()} "
            f"(launch at most that many ranks per node, or check CUDA_VISIBLE_DEVICES)"
        )
    torch.manual_seed(seed)
    random.seed(seed)  # Python's too: a checkpoint saves its state, and a resumed run must restore the same one
    if device_type == "cuda":
        # fewer out-of-memory failures from fragmentation: the allocator grows segments instead of adding new ones.
        # Read when CUDA's allocator starts, which has not happened yet; a value the user set wins
        if not (os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")):
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        torch.cuda.manual_seed(seed)
        # tf32 matmuls: free speed for the fp32 parts (optimizer math, fp32 logits)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    ddp, rank, local_rank, world_size = get_dist_info()
    if ddp:
        kw = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}
        if device_type == "cuda":
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
            dist.init_process_group(backend="cpu:gloo,cuda:nccl" if cpu_collectives else "nccl", device_id=device, **kw)
        else:
            device = torch.device(device_type)
            dist.init_process_group(backend="gloo", **kw)
        dist.barrier()
    else:
        device = torch.device(device_type)
    return ddp, rank, local_rank, world_size, device


def skipped_on_any_rank(skipped):
    """This rank's {task: why it was skipped} merged with every other rank's (the same tasks on all ranks): a task
    one rank could not load is skipped by all, or each task's closing all-reduce would pair
    one task's sums with another's (NCCL: a hang until the timeout). Tasks only other ranks skipped get a line."""
    if not (dist.is_available() and dist.is_initialized()):
        return skipped
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, skipped)
    merged = dict(skipped)
    for rank, theirs in enumerate(every):
        for name, why in theirs.items():
            if name not in merged:
                print0(f"skipping {name}: rank {rank} could not load it ({why})")
                merged[name] = f"rank {rank}: {why}"
    return merged


def mean_over_ranks(metrics, device, group=None):
    """The mean of a {name: number} dict over the ranks of `group` (default: all), the same dict on every rank.
    Ranks may hold different names (a dynamic-sampling filter's drop reasons, reward components seen on one rank
    only): one all-reduce of a vector needs the same names in the same order everywhere, else gloo fails on the
    size and NCCL hangs or mixes metrics. So the union of the names is gathered first, and a name a rank lacks
    counts as 0 there (all of them are counts or sums that rank did not see)."""
    world = dist.get_world_size(group)
    names = [None] * world
    dist.all_gather_object(names, sorted(metrics), group=group)
    keys = sorted(set().union(*names))
    vec = torch.tensor([float(metrics.get(k, 0.0)) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(vec, group=group)
    return {k: v / world for k, v in zip(keys, vec.tolist())}


# torch.distributed's tensor collectives: the ones strict_collective_device checks
_TENSOR_COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "all_to_all",
    "gather",
    "scatter",
)


class _DoneWork:
    def wait(self, *args, **kwargs):
        return True


def strict_collective_device(device):
    """
    Make every tensor collective of torch.distributed fail unless all its tensors are on `device`, the way NCCL
    refuses a CPU tensor ("No backend type associated with device type cpu"). gloo takes tensors on any device,
    so without this a CPU run never notices a collective fed from the host that will crash on GPUs.
    device "meta" stands in for a GPU on a machine without one: call the code under test with meta tensors
    (shapes only) and any tensor it builds on the CPU on its own fails the check; the exchange itself is
    skipped for meta tensors, which hold no data (async_op=True then gets a handle whose wait() returns at once).
    Returns a function that undoes the patch. A test aid: in a CPU-only process host and compute tensors are both
    on the CPU, so only meta inputs can tell them apart.
    """
    want = torch.device(device).type
    originals = {name: getattr(dist, name) for name in _TENSOR_COLLECTIVES}

    def tensors_in(args, kwargs):
        for a in list(args) + list(kwargs.values()):
            for t in a if isinstance(a, (list, tuple)) else [a]:
                if isinstance(t, torch.Tensor):
                    yield t

    def checked(name, fn):
        def wrapper(*args, **kwargs):
            ts = list(tensors_in(args, kwargs))
            for t in ts:
                if t.device.type != want:
                    raise RuntimeError(
                        f"dist.{name} got a tensor on {t.device} but the compute device is {want}: "
                        f'NCCL would fail with "No backend type associated with device type {t.device.type}"'
                    )
            if want == "meta":
                return _DoneWork() if kwargs.get("async_op") else None
            return fn(*args, **kwargs)

        return wrapper

    for name, fn in originals.items():
        setattr(dist, name, checked(name, fn))

    def restore():
        for name, fn in originals.items():
            setattr(dist, name, fn)

    return restore


def compute_cleanup():
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        # A collective's worker thread frees the collective's tensors after the caller has moved on, and needs the
        # GIL for it. FSDP2's modules hold the process group, so under --fsdp it outlives destroy_process_group and
        # its worker threads run into interpreter shutdown, where taking the GIL aborts the process ("terminate called
        # without an active exception"). Release the GIL for a moment so a pending free finishes first.
        time.sleep(0.2)
