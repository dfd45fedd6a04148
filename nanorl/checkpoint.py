"""
Checkpoints of a training run: model, optimizer, data/RNG state and metadata, written atomically, and --resume.

Layout: <checkpoint_dir>/model_<step>.safetensors (the weights: loading them runs no code), meta_<step>.json,
optim_<step>.pt (the optimizer state, the same on every rank: written once) and extra_<step>_rank<r>.pt (each rank's
data position and RNGs) (tensors and plain Python values only, read with torch.load(weights_only=True)). Every file is written to a temp name, fsynced, then renamed, and
meta_<step>.json is written last: a step with no meta file is incomplete and is never picked as "latest", so
a crash mid-save leaves the previous checkpoint usable. Checkpoints of older versions (model_<step>.pt) still load.
A model sharded with --fsdp (FSDP2) is saved as torch.distributed.checkpoint (DCP) shards, dcp_<step>/, beside the
meta and extra files; `python -m nanorl.fsdp consolidate` writes its single model file.

Top to bottom: atomic writes, a step's files, saving and deleting a step, reading one back (meta, model config,
weights), sharded steps, then what the training scripts call: claim_output_dir(), save() and resume() (which take
either kind of model) and the RNG state. Loading a model to use (eval, chat, export) is nanorl/model_loading.py.
"""

import glob
import io
import json
import os
import pickle
import random
import re
import shutil
import time

import torch

from nanorl import lora
from nanorl.common import is_sharded
from nanorl.errors import BadValue, MissingFile, Unreadable, read_json_object
from nanorl.gpt import GPTConfig
from nanorl.logger import print0


def _atomic_write(data, path):
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _atomic_json(obj, path):
    _atomic_write(json.dumps(obj, indent=2, default=str).encode(), path)


def _torch_bytes(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _safetensors_bytes(state):
    from safetensors.torch import save

    # safetensors wants contiguous tensors of their own: a second name for one storage (tied weights) gets a copy
    tensors, storages = {}, set()
    for k, v in state.items():
        v = v.detach().cpu().contiguous()
        ptr = v.untyped_storage().data_ptr()
        tensors[k] = v.clone() if ptr in storages else v
        storages.add(ptr)
    return save(tensors)


def model_path(checkpoint_dir, step):
    """The weights file of a step: safetensors, or a model_<step>.pt of an older checkpoint; None if neither exists."""
    for name in (f"model_{step:06d}.safetensors", f"model_{step:06d}.pt"):
        path = os.path.join(checkpoint_dir, name)
        if os.path.exists(path):
            return path
    return None


def optim_path(checkpoint_dir, step, rank=None):
    """The optimizer state of a step, one file for all ranks; given a rank, that rank's copy in a checkpoint of an
    older version (which wrote one per rank) when the step has no single file."""
    path = os.path.join(checkpoint_dir, f"optim_{step:06d}.pt")
    older = os.path.join(checkpoint_dir, f"optim_{step:06d}_rank{rank}.pt")
    return older if rank is not None and not os.path.exists(path) and os.path.exists(older) else path


STEP_FILE = re.compile(r"(?:model|meta|optim|extra|dcp)_(\d+)")  # the files (and DCP folders) of a saved step


def _steps_with_files(checkpoint_dir):
    names = os.listdir(checkpoint_dir) if os.path.isdir(checkpoint_dir) else []
    return {int(m.group(1)) for n in names if (m := STEP_FILE.match(n))}


def complete_steps(checkpoint_dir):
    steps = []
    for p in glob.glob(os.path.join(checkpoint_dir, "meta_*.json")):
        m = re.match(r"meta_(\d+)\.json$", os.path.basename(p))
        if m and (
            model_path(checkpoint_dir, int(m.group(1)))
            or os.path.isdir(os.path.join(checkpoint_dir, f"dcp_{int(m.group(1)):06d}"))
        ):  # dcp: --fsdp shards
            steps.append(int(m.group(1)))
    return sorted(steps)


def find_last_step(checkpoint_dir):
    steps = complete_steps(checkpoint_dir) if os.path.isdir(checkpoint_dir) else []
    return steps[-1] if steps else None


def save_checkpoint(
    checkpoint_dir,
    step,
    model_state,
    optim_state=None,
    meta=None,
    extra=None,
    rank=0,
    keep_last=None,
    group=None,
    lead=None,
):
    """The lead rank (default: rank 0) writes the model, the optimizer state and meta; every rank writes its own extra
    state (either state may be None). The optimizer state is the same on every rank (each steps on the same averaged
    gradients), so it is written once: one copy per rank was ranks x its size on disk a save (a sharded optimizer is
    saved by save_sharded, each rank its shards). extra must hold only tensors and plain Python values (dict, list,
    tuple, str, int, float, bool, None). group: the process group of the ranks that save (default all)."""
    os.makedirs(checkpoint_dir, exist_ok=True)
    lead = rank == 0 if lead is None else lead
    if optim_state is not None and lead:
        _atomic_write(_torch_bytes(optim_state), optim_path(checkpoint_dir, step))
    if extra is not None:
        _atomic_write(_torch_bytes(extra), os.path.join(checkpoint_dir, f"extra_{step:06d}_rank{rank}.pt"))
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier(group=group)  # every rank's files exist before the step is marked complete
    if lead:
        if model_state is not None:  # None: the model was saved as shards (save_sharded)
            _atomic_write(
                _safetensors_bytes(model_state), os.path.join(checkpoint_dir, f"model_{step:06d}.safetensors")
            )
        _atomic_json(meta or {}, os.path.join(checkpoint_dir, f"meta_{step:06d}.json"))  # last: marks it complete
        complete = complete_steps(checkpoint_dir)
        # earlier steps with files but no meta: a kill during a save or a deletion left them behind
        for old in sorted(s for s in _steps_with_files(checkpoint_dir) - set(complete) if s < step):
            delete_step(checkpoint_dir, old)
        if keep_last:
            for old in complete[:-keep_last]:
                delete_step(checkpoint_dir, old)
        print0(f"saved checkpoint step {step} to {checkpoint_dir}")


def delete_step(checkpoint_dir, step):
    # meta first: the step stops counting as complete before its other files go
    meta = os.path.join(checkpoint_dir, f"meta_{step:06d}.json")
    if os.path.exists(meta):
        os.remove(meta)
    for p in glob.glob(os.path.join(checkpoint_dir, f"*_{step:06d}*")):
        if STEP_FILE.match(os.path.basename(p)):  # only the step's own files: a user's notes_000010.txt stays
            shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)


def _load(path, device):
    if not os.path.exists(path):
        raise MissingFile(f"checkpoint file {path} is missing")
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(path, device=str(device))
        return torch.load(path, map_location=device, weights_only=True)
    except Exception as e:
        unsafe = isinstance(e, pickle.UnpicklingError) and "weights_only" in str(e)
        what = "holds Python objects other than tensors and plain values" if unsafe else "is corrupt or truncated"
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
        err = Unreadable(
            f"checkpoint file {path} {what} ({type(e).__name__}: {first_line[:200]}); "
            f"delete that step to fall back to the previous one"
        )
        err.every_rank = "_rank" in os.path.basename(path)  # optimizer/extra state: each rank reads its own
        raise err from e


def read_meta(checkpoint_dir, step):
    """meta_<step>.json as a dict; a missing, garbled or non-object file is one line naming it."""
    path = os.path.join(checkpoint_dir, f"meta_{step:06d}.json")
    if not os.path.exists(path):
        have = ", ".join(map(str, complete_steps(checkpoint_dir))) or "none"
        raise MissingFile(
            f"checkpoint step {step} is incomplete or missing in {checkpoint_dir} (no {os.path.basename(path)}); "
            f"the steps there: {have}"
        )
    return read_json_object(path, "checkpoint metadata")


def model_config(meta, meta_path):
    """The GPTConfig a checkpoint's metadata describes; missing or unreadable is one line naming the file."""
    if not isinstance(meta.get("model_config"), dict):
        raise BadValue(f"checkpoint metadata {meta_path} has no model_config: it cannot say which model to build")
    try:
        return GPTConfig(**meta["model_config"])
    except TypeError as e:
        raise BadValue(f"checkpoint metadata {meta_path} has a model_config this version cannot read ({e})") from None


def resume_point(checkpoint_dir, world_size, fsdp):
    """(step, meta) of the latest complete step a --resume run continues from, read before any per-rank file.
    Refuses an empty directory, another number of ranks (each rank's place in the data order is its own and cannot be
    re-split) and a --fsdp setting other than the one it was saved with (sharded steps are DCP directories)."""
    step = find_last_step(checkpoint_dir)
    if step is None:
        raise SystemExit(f"--resume: no checkpoint in {checkpoint_dir}")
    meta = read_meta(checkpoint_dir, step)
    saved = meta.get("world_size", world_size)
    if saved != world_size:
        raise SystemExit(
            f"--resume: step {step} in {checkpoint_dir} was written by {saved} rank(s), this run has "
            f"{world_size}; resume with --nproc_per_node={saved}"
        )
    if bool(meta.get("sharded")) != fsdp:
        was = "with" if meta.get("sharded") else "without"
        raise SystemExit(f"--resume: step {step} in {checkpoint_dir} was saved {was} --fsdp; resume {was} it")
    return step, meta


def load_checkpoint(checkpoint_dir, step=None, device="cpu", load_optimizer=False, rank=0, need_extra=None):
    """(model_state, optim_state, meta, extra) of `step` (default: the latest complete one).
    load_optimizer=True (resuming) also needs this rank's optimizer file, and (need_extra, by default the same) its
    extra-state file."""
    if step is None:
        step = find_last_step(checkpoint_dir)
        if step is None:
            raise MissingFile(f"no complete checkpoint in {checkpoint_dir}")
    meta = read_meta(checkpoint_dir, step)
    weights = model_path(checkpoint_dir, step)
    if meta.get("sharded") and weights is None:
        raise MissingFile(
            f"step {step} of {checkpoint_dir} is sharded (saved with --fsdp): run "
            f"`python -m nanorl.fsdp consolidate {checkpoint_dir} --step {step}` first, or resume with --fsdp"
        )
    model_state = _load(weights or os.path.join(checkpoint_dir, f"model_{step:06d}.safetensors"), device)
    optim_state = _load(optim_path(checkpoint_dir, step, rank), device) if load_optimizer else None
    extra_path = os.path.join(checkpoint_dir, f"extra_{step:06d}_rank{rank}.pt")
    if (load_optimizer if need_extra is None else need_extra) and not os.path.exists(extra_path):
        err = MissingFile(f"checkpoint file {extra_path} is missing: step {step} has no data/RNG state to resume from")
        err.every_rank = True
        raise err
    extra = _load(extra_path, "cpu") if os.path.exists(extra_path) else None
    return model_state, optim_state, meta, extra


def load_extra(checkpoint_dir, step, rank):
    """Rank `rank`'s extra state of a step: where state every rank shares is written once (RL's critic, by the first
    trainer), the other ranks read it from there."""
    return _load(os.path.join(checkpoint_dir, f"extra_{step:06d}_rank{rank}.pt"), "cpu")


def load_weights(model, state, path):
    """load_state_dict, but a checkpoint that does not fit the model is one line naming the file and the keys."""
    # checkpoints written from torch.compile'd models carry an _orig_mod. prefix
    state = {k.removeprefix("_orig_mod."): v for k, v in state.items()}
    expected = model.state_dict()
    missing, unexpected = sorted(expected.keys() - state.keys()), sorted(state.keys() - expected.keys())
    shapes = [
        f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state and state[k].shape != v.shape
    ]

    def few(names):
        return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")

    problems = [
        f"missing keys {few(missing)}" if missing else "",
        f"unexpected keys {few(unexpected)}" if unexpected else "",
        f"wrong shapes {few(shapes)} (checkpoint vs model)" if shapes else "",
    ]
    if any(problems):
        raise BadValue(f"checkpoint file {path} does not fit the model: " + "; ".join(p for p in problems if p))
    model.load_state_dict(state, strict=True)


# -----------------------------------------------------------------------------------------------
# sharded steps (--fsdp): every rank writes and reads its own shards of model and optimizer


def dcp_dir(checkpoint_dir, step):
    return os.path.join(checkpoint_dir, f"dcp_{step:06d}")


def save_sharded(checkpoint_dir, step, model, optimizer, meta, extra, rank, keep_last=None):
    """Every rank writes its shards of model and optimizer (DCP) and its own extra state; meta (written last by
    rank 0, see save_checkpoint) marks the step complete."""
    import torch.distributed.checkpoint as dcp  # here: ~1 s of import that only a sharded run needs
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=dcp_dir(checkpoint_dir, step))
    save_checkpoint(checkpoint_dir, step, None, None, {**meta, "sharded": True}, extra, rank, keep_last)


def load_sharded(checkpoint_dir, step, model, optimizer, rank=0):
    """Load a DCP checkpoint into the sharded model and its optimizer; return this rank's extra state (None if
    it has none). DCP reshards on load, so the weights and optimizer state load on any number of ranks (the data
    loader's position is per rank: resume_point refuses another world size for that reason)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = dcp_dir(checkpoint_dir, step)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path} is missing: step {step} of {checkpoint_dir} was not saved with --fsdp")
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    extra = os.path.join(checkpoint_dir, f"extra_{step:06d}_rank{rank}.pt")
    return torch.load(extra, weights_only=True) if os.path.exists(extra) else None


# -----------------------------------------------------------------------------------------------
# a training run's state, sharded or not: what base_train, mid/SFT and RL save and --resume from


def claim_output_dir(checkpoint_dir, resume, overwrite, rank=0):
    """A fresh run (no --resume) must not write into a directory holding an earlier run's steps: the chat tools load a
    tag's latest step, so an old step 60 would hide this run's step 24. Such steps refuse the run in one line naming
    the ways out; overwrite moves the old directory aside to <dir>.old-<time> (rank 0) rather than deleting it, so
    nothing is lost if the new run fails before its first save. -> the path it was moved to, or None."""
    if resume:
        if overwrite:
            raise SystemExit("--overwrite starts a new run and --resume continues the old one: pass one of them")
        return None
    steps = sorted(_steps_with_files(checkpoint_dir))
    if not steps:
        return None
    held = f"step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps[:5]))}{' ...' if len(steps) > 5 else ''}"
    if not overwrite:
        raise SystemExit(
            f"{checkpoint_dir} already holds {held} of an earlier run, which would hide this run's "
            f"steps: pass --resume to continue it, another --output-tag, or --overwrite to move it aside"
        )
    moved = stamp = f"{checkpoint_dir.rstrip(os.sep)}.old-{time.strftime('%Y%m%d-%H%M%S')}"
    for i in range(1, 100):  # two runs moved aside within one second keep both
        if not os.path.exists(moved):
            break
        moved = f"{stamp}-{i}"
    if rank == 0:
        os.rename(checkpoint_dir, moved)
        print0(f"--overwrite: moved the earlier run's {held} aside to {moved}")
    return moved


def save(checkpoint_dir, step, model, optimizer, meta, extra=None, rank=0, keep_last=None, group=None, lead=None):
    """Save a training step: weights, optimizer, this rank's extra state (data position, RNGs) and meta (which gains
    "sharded", checked on resume). An FSDP2-sharded model is written by every rank as DCP shards; any other as one
    safetensors file by the lead rank (default rank 0), each rank adding its optimizer state. group: the ranks that
    save (default all)."""
    if is_sharded(model):
        save_sharded(checkpoint_dir, step, model, optimizer, meta, extra, rank, keep_last)
    else:
        # a LoRA model stores its adapters alone (meta["lora"] says where their base is)
        save_checkpoint(
            checkpoint_dir,
            step,
            lora.trained_state(model),
            optimizer.state_dict(),
            {**meta, "sharded": False},
            extra,
            rank,
            keep_last,
            group,
            lead,
        )


def resume(checkpoint_dir, model, optimizer, rank=0, world_size=1, model_config=None):
    """--resume: load the latest complete step into model and optimizer (sharded or not, as this run is; optimizer
    None: a rank that does not train, the weights alone) -> (step, meta, this rank's extra state). Refuses what
    resume_point refuses and, given model_config (a dict), a checkpoint of another model shape, before reading any
    weights."""
    sharded = is_sharded(model)
    step, meta = resume_point(checkpoint_dir, world_size, sharded)
    if model_config is not None:
        saved = globals()["model_config"](meta, os.path.join(checkpoint_dir, f"meta_{step:06d}.json")).to_dict()
        if saved != model_config:
            raise SystemExit(f"--resume: the checkpoint's model config {saved} differs from this run's {model_config}")
    if sharded:
        return step, meta, load_sharded(checkpoint_dir, step, model, optimizer, rank)
    device = next(model.parameters()).device
    model_state, optim_state, _, extra = load_checkpoint(
        checkpoint_dir, step, device, load_optimizer=optimizer is not None, rank=rank, need_extra=True
    )
    if lora.is_lora(model):
        lora.load_lora_state_dict(model, model_state, model_path(checkpoint_dir, step))
    else:
        load_weights(model, model_state, model_path(checkpoint_dir, step))
    if optimizer is not None:
        optimizer.load_state_dict(optim_state)
    return step, meta, extra


def rng_state(device):
    """Python's and torch's RNG states (and the GPU's on CUDA), for a checkpoint's extra state."""
    return {
        "py_rng": random.getstate(),
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state() if device.type == "cuda" else None,
    }


def set_rng_state(extra, device):
    """Restore what rng_state saved (a checkpoint without a GPU state leaves the GPU's as it is)."""
    random.setstate(extra["py_rng"])
    torch.set_rng_state(extra["torch_rng"])
    if device.type == "cuda" and extra.get("cuda_rng") is not None:
        torch.cuda.set_rng_state(extra["cuda_rng"])
