"""
What a run records while it runs: its printed lines (rank 0's alone), its JSON records (written whole), its metrics
to wandb and/or TensorBoard (Logger, get_logger and the flags that pick them), the time left (ETA) and the time each
part of a step took (Timer, with synchronize: the device's queued work waited for before the clock is read, or before
a memory trial is judged).
"""

import json
import numbers
import os
import time
from collections import deque
from contextlib import contextmanager

import torch


def print0(*args, **kwargs):
    # Only rank 0 talks, so an 8-GPU run prints one log, not eight interleaved ones.
    if int(os.environ.get("RANK", 0)) == 0:
        print(*args, **kwargs, flush=True)


def write_json(obj, path):
    """obj as JSON at path, written to a temp file and renamed: a crash never leaves half a file."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=float)
    os.replace(tmp, path)


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
        minutes = self.minutes()
        return "?" if minutes is None else f"{minutes:.1f}m"


def synchronize(device_type):
    """Wait until the device has run the work queued on it: a clock read after it counts that work, and a memory trial
    has run all of it."""
    if device_type in ("cuda", "mps"):
        getattr(torch, device_type).synchronize()


class Timer(dict):
    """Wall-clock sections for the rollout/ref/train/eval time split: {section name: seconds}."""

    @contextmanager
    def section(self, name, device_type="cpu"):
        """Time the block as section `name` (added up over repeats), the device's queued work included. A block that
        raises is not timed: its exception ends the step the timer was for."""
        synchronize(device_type)
        t0 = time.time()
        yield
        synchronize(device_type)
        self[name] = self.get(name, 0.0) + time.time() - t0
