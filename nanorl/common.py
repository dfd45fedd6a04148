"""
Small shared utilities: flag parsing, distributed init and each rank's share of an epoch, the device, printing,
paths, logging, ETA, and loading a user's plugin function named on the command line.
"""

import argparse
import datetime
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import random
import sys
import time
from collections import deque

import torch
import torch.distributed as dist

from nanorl.gpu_setup import cuda_available, gpu_visible, no_gpu_message, read_driver

# -----------------------------------------------------------------------------------------------
# flags: every default shown in --help, every number checked when it is parsed, errors on one line


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to every flag's help, unless the help already says what its default is."""

    def _get_help_string(self, action):
        return action.help if "default" in (action.help or "") else super()._get_help_string(action)


# slime's spellings of our flags: the scripts that have the flag accept them too, unlisted in --help (docs/rl.md)
SLIME_NAMES = {
    "--num-rollout": "--num-rollouts",
    "--rollout-max-response-len": "--max-new-tokens",
    "--rollout-temperature": "--temperature",
    "--eval-interval": "--eval-every",
    "--save-interval": "--save-every",
}


class ArgumentParser(argparse.ArgumentParser):
    """argparse with every default in --help, and a bad flag answered with one line (no usage dump), exit 2.
    A leading `--` is dropped: `torchrun ... -m scripts.X -- --flag` hands the script its flags after one.
    aliases: {another spelling: our flag}, read as our flag (e.g. SLIME_NAMES)."""

    def __init__(self, aliases=None, **kwargs):
        super().__init__(formatter_class=HelpFormatter, **kwargs)
        self.aliases = aliases or {}

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        args = args[1:] if args[:1] == ["--"] else args
        return super().parse_known_args([self.our_name(a) for a in args], namespace)

    def our_name(self, arg):
        """--rollout-temperature 0.7 and --rollout-temperature=0.7 as --temperature."""
        name, eq, value = arg.partition("=")
        return self.aliases[name] + eq + value if name in self.aliases else arg

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def number_in(kind, lo=None, hi=None, lo_open=False):
    """An argparse `type=`: parses an int or float and keeps it within [lo, hi] ((lo, hi] with lo_open), else
    argparse names the flag with the allowed range. NaN and infinities never pass."""
    what = "an integer" if kind is int else "a number"
    allowed = " and ".join(
        c
        for c in (
            (f"> {lo}" if lo_open else f">= {lo}") if lo is not None else "",
            f"<= {hi}" if hi is not None else "",
        )
        if c
    )

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if (
            not math.isfinite(value)
            or (lo is not None and (value <= lo if lo_open else value < lo))
            or (hi is not None and value > hi)
        ):
            raise argparse.ArgumentTypeError(f"{text} is out of range: must be {what} {allowed}")
        return value

    parse.__name__ = f"{kind.__name__} {allowed}"  # argparse's fallback message uses the name
    return parse


positive_int = number_in(int, 1)
nonneg_int = number_in(int, 0)
positive_float = number_in(float, 0, lo_open=True)
nonneg_float = number_in(float, 0)
fraction = number_in(float, 0, 1)  # a share of something, 0..1
int_or_off = number_in(int, -1)  # intervals and limits where -1 (or 0) means "off" / "all"


def batch_or_auto(text):
    """An argparse `type=` for --device-batch-size: a positive number of rows, or "auto" (fit_batch picks it)."""
    return text if text == "auto" else positive_int(text)


def tag_name(text):
    """An argparse `type=` for a checkpoint tag (--model-tag, --output-tag): one directory name under a stage's
    checkpoints, so "../x" or "a/b" cannot write or read outside it."""
    if not text or text in (".", "..") or "/" in text or "\\" in text or text.startswith("-"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a tag: one directory name, e.g. d4 or my-run")
    return text


def print0(*args, **kwargs):
    # Only rank 0 talks, so an 8-GPU run prints one log, not eight interleaved ones.
    if int(os.environ.get("RANK", 0)) == 0:
        print(*args, **kwargs, flush=True)


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


def batch_candidates(largest, total_tokens, row_tokens):
    """Device batches to try, largest first: largest, largest / 2, ... 1, keeping those whose micro-steps of
    batch x row_tokens (row_tokens = sequence length x ranks) add up exactly to total_tokens per optimizer step."""
    out, b = [], largest
    while b >= 1:
        if total_tokens % (b * row_tokens) == 0:
            out.append(b)
        b //= 2
    return out


def _step_fits(try_step, batch):
    try:
        try_step(batch)
        return True
    except torch.OutOfMemoryError:
        pass  # out of the except block before freeing: its traceback still holds the failed step's tensors
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return False


def fit_device_batch(try_step, candidates, device=None):
    """
    The largest device batch of `candidates` (largest first) whose training step fits in memory: try_step(batch)
    runs one forward+backward at that batch and raises torch.OutOfMemoryError when it does not fit. Under
    torch.distributed all ranks try the same batch and move on together when any of them ran out of memory, so
    they agree on the smallest batch every rank can take. Returns (batch, the larger candidates that did not fit).
    """
    too_big = []
    for batch in candidates:
        fits = _step_fits(try_step, batch)
        if dist.is_available() and dist.is_initialized():
            flag = torch.tensor([int(fits)], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            fits = bool(flag.item())
        if fits:
            return batch, too_big
        too_big.append(batch)
    raise SystemExit(
        f"out of memory even at a device batch of {candidates[-1]} row(s) (tried {too_big}): "
        f"use a smaller model or --max-seq-len, or shard it with --fsdp"
    )


def compile_model(model, device, no_compile=False):
    """What a training stage steps: on CUDA torch.compile of the model (dynamic=False: one graph per batch shape),
    elsewhere, or with --no-compile, the model itself (eager)."""
    return torch.compile(model, dynamic=False) if torch.device(device).type == "cuda" and not no_compile else model


def oom_is_catchable(device):
    """Whether running out of memory on `device` raises an exception a batch-size trial can catch (CUDA's allocator);
    elsewhere it is the OS killing the process, and there is nothing to try."""
    return torch.device(device).type == "cuda"


def fit_batch(try_step, candidates, device, what="device batch"):
    """The batch of every stage that fits its batch to memory (base_train, mid_train, chat_sft, chat_eval): where out
    of memory can be caught, the largest of `candidates` whose try_step fits on every rank (fit_device_batch), else
    the largest. -> (batch, the line that says which and why)"""
    batch, too_big = fit_device_batch(try_step, candidates, device) if oom_is_catchable(device) else (candidates[0], [])
    why = f", the largest that fits in memory ({', '.join(map(str, too_big))} did not)" if too_big else ""
    return batch, f"{what} (auto): {batch} rows{why}"


def training_trial(run_step, optimizer, device, offloaded=False):
    """fit_batch's try_step for a training stage: run_step(batch) runs one forward and backward at `batch` rows, as
    training runs them (the same model object, so the same compiled graph). The optimizer's state, allocated at its
    first step, does not exist yet: the trial holds that many bytes aside (none with --cpu-offload, where it lives in
    host memory), and throws the gradients away after."""
    state_bytes = 0 if offloaded else optimizer.state_bytes()

    def trial(batch):
        held = torch.empty(state_bytes, dtype=torch.uint8, device=device)
        try:
            run_step(batch)
            synchronize(torch.device(device).type)
        finally:
            optimizer.zero_grad(set_to_none=True)
            del held

    return trial


def synchronize(device_type):
    if device_type == "cuda":
        torch.cuda.synchronize()
    elif device_type == "mps":
        torch.mps.synchronize()


# peak dense bf16 FLOP/s (no sparsity) for MFU and memory bandwidth in bytes/s for MBU (decode is bound by it, not by
# FLOPs), by a substring of the GPU's name; the first match wins, so more specific names come first ("gh200" before
# "h200", "h100 nvl" before "h100")
PEAKS = [  # (substring, flops, bytes/s)
    ("gh200", 989e12, 4.0e12),
    ("h200", 989e12, 4.8e12),
    ("h100 nvl", 835e12, 3.9e12),
    ("h100 pcie", 756e12, 2.0e12),
    ("h100", 989e12, 3.35e12),
    ("h800", 989e12, 3.35e12),
    ("b200", 2250e12, 8.0e12),
    ("a100", 312e12, 2.0e12),
    ("a10g", 125e12, 0.6e12),
    ("l40s", 362e12, 0.864e12),
    ("l4", 121e12, 0.3e12),
    ("4090", 165e12, 1.008e12),
    ("3090", 71e12, 0.936e12),
    ("v100", 125e12, 0.9e12),
    ("t4", 65e12, 0.32e12),
]


def get_peak_flops(device_name):
    """Peak dense bf16 FLOP/s for MFU, by GPU name. Unknown devices give None: MFU is then not printed."""
    return next((flops for key, flops, _ in PEAKS if key in device_name.lower()), None)


def get_peak_bandwidth(device_name):
    """Peak memory bandwidth in bytes/s for MBU, by GPU name; unknown -> None."""
    return next((bw for key, _, bw in PEAKS if key in device_name.lower()), None)


def int_list(text):
    """An argparse `type=` for a comma-separated list of positive integers, e.g. --pass-k 1,4."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text} must hold integers >= 1")
    return values


def add_logging_args(parser):
    parser.add_argument("--run", default="dummy", help="wandb run name ('dummy' = no wandb)")
    parser.add_argument("--tensorboard", default=None, metavar="DIR", help="also write TensorBoard event files to DIR")


def wandb_has_credentials():
    """An API key in the environment or in ~/.netrc (where `wandb login` puts it), or a mode that needs none."""
    import netrc

    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE"):
        return True
    try:
        path = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
        return netrc.netrc(path).authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


class Logger:
    """Sends each dict of metrics to wandb and/or TensorBoard; with neither it does nothing, so scripts log unconditionally.
    The x-axis is `step=` when given, else the dict's own "step", else a running count."""

    def __init__(self, wandb_run=None, tb_writer=None):
        self.wandb_run, self.tb_writer, self.count = wandb_run, tb_writer, 0

    def log(self, metrics, step=None):
        step = step if step is not None else metrics.get("step", self.count)
        self.count += 1
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=step)
        if self.tb_writer is not None:
            for k, v in metrics.items():
                if (
                    k != "step" and isinstance(v, numbers.Real) and not isinstance(v, bool)
                ):  # numpy scalars too; text is wandb's
                    self.tb_writer.add_scalar(k, v, global_step=step)

    def finish(self):
        if self.wandb_run is not None:
            self.wandb_run.finish()
        if self.tb_writer is not None:
            self.tb_writer.close()


def get_logger(run_name, project="nanorl", config=None, master_process=True, tensorboard_dir=None):
    """Call it before building the model: a missing wandb key then stops the run at once, on one line.
    wandb and tensorboard are optional heavy imports, only touched when asked for."""
    if not master_process:
        return Logger()
    wandb_run = tb_writer = None
    if run_name != "dummy":
        if not wandb_has_credentials():
            raise SystemExit(
                f"--run {run_name!r} logs to wandb but no wandb API key is set (WANDB_API_KEY or `wandb login`): "
                f"set WANDB_MODE=offline to log locally, or use --run dummy"
            )
        try:
            import wandb
        except ImportError:
            raise SystemExit(
                f"--run {run_name!r} asks for wandb logging but wandb is not installed; use --run dummy"
            ) from None
        wandb_run = wandb.init(project=project, name=run_name, config=config)
    if tensorboard_dir:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise SystemExit(
                f"--tensorboard {tensorboard_dir}: the tensorboard package is not installed (pip install tensorboard)"
            ) from None
        tb_writer = SummaryWriter(log_dir=tensorboard_dir)
    return Logger(wandb_run, tb_writer)


class ETA:
    """Time left from the pace of the last `window` steps: one slow step does not swing it, a lasting change of
    pace shows within a window. Steps may advance progress (0..1) unevenly, as SFT's epochs of packed rows do."""

    def __init__(self, progress=0.0, window=20):
        self.progress, self.recent = progress, deque(maxlen=window)  # (seconds, progress gained) per step
        self.last = time.time()  # tick's clock

    def tick(self, progress, now=None):
        """Record a step by the wall clock since the previous tick (or since this ETA was made): whatever ran between
        two step lines (an eval, a save) counts, so the estimate includes their share of the time left."""
        now = time.time() if now is None else now
        self.step(now - self.last, progress)
        self.last = now

    def step(self, seconds, progress, timed=True):
        """Record a step that took `seconds` and left the run at `progress`; timed=False for warm-up steps
        (compilation), which move progress but would skew the pace."""
        if timed:
            self.recent.append((seconds, progress - self.progress))
        self.progress = progress

    def minutes(self):
        """None until a step has been timed."""
        seconds, gained = sum(s for s, _ in self.recent), sum(g for _, g in self.recent)
        return seconds / gained * (1 - self.progress) / 60 if gained > 0 else None

    def __str__(self):
        m = self.minutes()
        return "?" if m is None else f"{m:.1f}m"


class Timer:
    """Wall-clock sections for the rollout/ref/train/eval time split."""

    def __init__(self):
        self.times = {}

    def section(self, name, device_type="cpu"):
        timer = self

        class _Ctx:
            def __enter__(self):
                synchronize(device_type)
                self.t0 = time.time()

            def __exit__(self, *exc):
                synchronize(device_type)
                timer.times[name] = timer.times.get(name, 0.0) + time.time() - self.t0

        return _Ctx()


# -----------------------------------------------------------------------------------------------
# plugins: a user function named on the command line as "module:function" or "path/to/file.py:function"


def load_function(path, expected_params, flag):
    """Import a user function and check its signature before any GPU work starts; errors name the flag."""
    if ":" not in path:
        raise ValueError(f"{flag} {path!r}: expected 'module:function' or 'file.py:function'")
    mod_name, fn_name = path.rsplit(":", 1)
    try:
        if mod_name.endswith(".py") or os.path.sep in mod_name:
            spec = importlib.util.spec_from_file_location(os.path.basename(mod_name)[:-3], mod_name)
            if spec is None:
                raise ImportError(f"no such file {mod_name}")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(mod_name)
    except Exception as e:
        raise ValueError(f"{flag} {path!r}: could not import {mod_name!r} ({type(e).__name__}: {e})") from e
    fn = getattr(module, fn_name, None)
    expected = f"{fn_name}({', '.join(expected_params)})"
    if not callable(fn):
        raise ValueError(f"{flag} {path!r}: {mod_name!r} has no function {fn_name!r}; expected {expected}")
    try:
        inspect.signature(fn).bind(*expected_params)
    except TypeError as e:
        raise ValueError(f"{flag} {path!r}: wrong signature {inspect.signature(fn)}; expected {expected}") from e
    return fn
