"""
Checkpoints: model, optimizer, data/RNG state and metadata, written atomically.

Layout: <checkpoint_dir>/model_<step>.safetensors (the weights: loading them runs no code), meta_<step>.json,
optim_<step>_rank<r>.pt and extra_<step>_rank<r>.pt (tensors and plain Python values only, read with
torch.load(weights_only=True)). Every file is written to a temp name, fsynced, then renamed, and
meta_<step>.json is written last: a step with no meta file is incomplete and is never picked as "latest", so
a crash mid-save leaves the previous checkpoint usable. Checkpoints of older versions (model_<step>.pt) still load.
"""
import glob
import io
import json
import os
import pickle
import re
import shutil

import torch

from nanorl.common import get_base_dir, print0
from nanorl.gpt import GPTConfig
from nanorl.gpt import build_model as build_gpt


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


def _steps_with_files(checkpoint_dir):
    names = os.listdir(checkpoint_dir) if os.path.isdir(checkpoint_dir) else []
    return {int(m.group(1)) for n in names if (m := re.match(r"(?:model|meta|optim|extra|dcp)_(\d+)", n))}


def complete_steps(checkpoint_dir):
    steps = []
    for p in glob.glob(os.path.join(checkpoint_dir, "meta_*.json")):
        m = re.match(r"meta_(\d+)\.json$", os.path.basename(p))
        if m and (model_path(checkpoint_dir, int(m.group(1))) or os.path.isdir(os.path.join(checkpoint_dir, f"dcp_{int(m.group(1)):06d}"))):  # dcp: --fsdp shards
            steps.append(int(m.group(1)))
    return sorted(steps)


def find_last_step(checkpoint_dir):
    steps = complete_steps(checkpoint_dir) if os.path.isdir(checkpoint_dir) else []
    return steps[-1] if steps else None


def save_checkpoint(checkpoint_dir, step, model_state, optim_state=None, meta=None, extra=None, rank=0, keep_last=None, group=None):
    """Rank 0 writes the model and meta; every rank writes its own optimizer shard and extra state.
    extra must hold only tensors and plain Python values (dict, list, tuple, str, int, float, bool, None).
    group: the process group of the ranks that save (default all; async RL's training ranks)."""
    os.makedirs(checkpoint_dir, exist_ok=True)
    if optim_state is not None:
        _atomic_write(_torch_bytes(optim_state), os.path.join(checkpoint_dir, f"optim_{step:06d}_rank{rank}.pt"))
    if extra is not None:
        _atomic_write(_torch_bytes(extra), os.path.join(checkpoint_dir, f"extra_{step:06d}_rank{rank}.pt"))
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier(group=group)  # every rank's files exist before the step is marked complete
    if rank == 0:
        if model_state is not None:  # None: the model was saved as shards (nanorl.fsdp.save_sharded)
            _atomic_write(_safetensors_bytes(model_state), os.path.join(checkpoint_dir, f"model_{step:06d}.safetensors"))
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
        shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)


def _load(path, device):
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint file {path} is missing")
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file
            return load_file(path, device=str(device))
        return torch.load(path, map_location=device, weights_only=True)
    except Exception as e:
        unsafe = isinstance(e, pickle.UnpicklingError) and "weights_only" in str(e)
        what = "holds Python objects other than tensors and plain values" if unsafe else "is corrupt or truncated"
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise RuntimeError(f"checkpoint file {path} {what} ({type(e).__name__}: {first_line[:200]}); "
                           f"delete that step to fall back to the previous one") from e


def resume_point(checkpoint_dir, world_size, fsdp):
    """(step, meta) of the latest complete step a --resume run continues from, read before any per-rank file.
    Refuses an empty directory, another number of ranks (each rank's place in the data order is its own and cannot be
    re-split) and a --fsdp setting other than the one it was saved with (sharded steps are DCP directories)."""
    step = find_last_step(checkpoint_dir)
    if step is None:
        raise SystemExit(f"--resume: no checkpoint in {checkpoint_dir}")
    with open(os.path.join(checkpoint_dir, f"meta_{step:06d}.json")) as f:
        meta = json.load(f)
    saved = meta.get("world_size", world_size)
    if saved != world_size:
        raise SystemExit(f"--resume: step {step} in {checkpoint_dir} was written by {saved} rank(s), this run has "
                         f"{world_size}; resume with --nproc_per_node={saved}")
    if bool(meta.get("sharded")) != fsdp:
        was = "with" if meta.get("sharded") else "without"
        raise SystemExit(f"--resume: step {step} in {checkpoint_dir} was saved {was} --fsdp; resume {was} it")
    return step, meta


def load_checkpoint(checkpoint_dir, step=None, device="cpu", load_optimizer=False, rank=0):
    """(model_state, optim_state, meta, extra) of `step` (default: the latest complete one).
    load_optimizer=True (resuming) also needs this rank's optimizer and extra-state files."""
    if step is None:
        step = find_last_step(checkpoint_dir)
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint in {checkpoint_dir}")
    meta_path = os.path.join(checkpoint_dir, f"meta_{step:06d}.json")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint step {step} is incomplete or missing in {checkpoint_dir} (no {meta_path})") from None
    except json.JSONDecodeError as e:
        raise RuntimeError(f"checkpoint metadata {meta_path} is corrupt: {e}") from e
    weights = model_path(checkpoint_dir, step)
    if meta.get("sharded") and weights is None:
        raise FileNotFoundError(f"step {step} of {checkpoint_dir} is sharded (saved with --fsdp): run "
                                f"`python -m nanorl.fsdp consolidate {checkpoint_dir} --step {step}` first, or resume with --fsdp")
    model_state = _load(weights or os.path.join(checkpoint_dir, f"model_{step:06d}.safetensors"), device)
    optim_state = _load(os.path.join(checkpoint_dir, f"optim_{step:06d}_rank{rank}.pt"), device) if load_optimizer else None
    extra_path = os.path.join(checkpoint_dir, f"extra_{step:06d}_rank{rank}.pt")
    if load_optimizer and not os.path.exists(extra_path):
        raise FileNotFoundError(f"checkpoint file {extra_path} is missing: step {step} has no data/RNG state to resume from")
    extra = _load(extra_path, "cpu") if os.path.exists(extra_path) else None
    return model_state, optim_state, meta, extra


def load_weights(model, state, path):
    """load_state_dict, but a checkpoint that does not fit the model is one line naming the file and the keys."""
    # checkpoints written from torch.compile'd models carry an _orig_mod. prefix
    state = {k.removeprefix("_orig_mod."): v for k, v in state.items()}
    expected = model.state_dict()
    missing, unexpected = sorted(expected.keys() - state.keys()), sorted(state.keys() - expected.keys())
    shapes = [f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}" for k, v in expected.items() if k in state and state[k].shape != v.shape]

    def few(names):
        return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    problems = [f"missing keys {few(missing)}" if missing else "", f"unexpected keys {few(unexpected)}" if unexpected else "",
                f"wrong shapes {few(shapes)} (checkpoint vs model)" if shapes else ""]
    if any(problems):
        raise ValueError(f"checkpoint file {path} does not fit the model: " + "; ".join(p for p in problems if p))
    model.load_state_dict(state, strict=True)


def load_model_dir(checkpoint_dir, step=None, device="cpu", phase="eval"):
    """Rebuild the GPT from a checkpoint's metadata and weights, plus the tokenizer. -> (model, tokenizer, meta)"""
    from nanorl.tokenizer import get_tokenizer
    step = find_last_step(checkpoint_dir) if step is None else step
    model_state, _, meta, _ = load_checkpoint(checkpoint_dir, step, device=device)
    if meta.get("lora"):  # adapters only, and a pointer to their base: nanorl/lora.py builds the merged model
        from nanorl.lora import load_lora_checkpoint
        return load_lora_checkpoint(meta, model_state, model_path(checkpoint_dir, step), device, phase)
    meta_path = os.path.join(checkpoint_dir, f"meta_{step:06d}.json")
    if not isinstance(meta.get("model_config"), dict):
        raise ValueError(f"checkpoint metadata {meta_path} has no model_config: it cannot say which model to build")
    try:
        config = GPTConfig(**meta["model_config"])
    except TypeError as e:
        raise ValueError(f"checkpoint metadata {meta_path} has a model_config this version cannot read ({e})") from None
    model = build_gpt(config, device)
    load_weights(model, model_state, model_path(checkpoint_dir, step))
    model.train() if phase == "train" else model.eval()
    if meta.get("tokenizer_dir"):  # trained from an open model: its own tokenizer, whose embedding may have spare rows
        from nanorl.tokenizer import HFTokenizer
        tokenizer = HFTokenizer.load(meta["tokenizer_dir"])
        if tokenizer.vocab_size > config.vocab_size:
            raise ValueError(f"tokenizer in {meta['tokenizer_dir']} has {tokenizer.vocab_size} tokens, more than the checkpoint in {checkpoint_dir} ({config.vocab_size})")
        return model, tokenizer, meta
    tokenizer = get_tokenizer()
    if tokenizer.vocab_size != config.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} tokens but the checkpoint in {checkpoint_dir} expects {config.vocab_size}")
    return model, tokenizer, meta


SOURCES = ("base", "mid", "sft", "rl")


def checkpoint_root(source):
    if source not in SOURCES:
        raise ValueError(f"unknown checkpoint source {source!r}; valid: {', '.join(SOURCES)}")
    return os.path.join(get_base_dir(), f"{source}_checkpoints")


def load_hf(directory, device, phase="eval"):
    """A Hugging Face model directory -> (model, tokenizer, meta). Trained in fp32 (autocast makes bf16
    matmuls); served in bf16 on CUDA. meta's tokenizer_dir travels into checkpoints saved from it."""
    from nanorl.hf import load_hf_model
    from nanorl.tokenizer import HFTokenizer
    device = torch.device(device)
    model, _ = load_hf_model(directory, device, dtype=torch.float32 if phase == "train" else None)
    tokenizer = HFTokenizer.load(directory)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"{directory}/tokenizer.json has {tokenizer.vocab_size} tokens, more than the model's {model.config.vocab_size}")
    model.train() if phase == "train" else model.eval()
    directory = os.path.abspath(directory)
    meta = {"model_config": model.config.to_dict(), "model_tag": os.path.basename(directory.rstrip("/")),
            "hf_model": directory, "tokenizer_dir": directory}
    return model, tokenizer, meta


def load_model(source, device, phase="eval", model_tag=None, step=None, hf_model=None):
    """Load the model of a pipeline stage: <base>/{source}_checkpoints/{model_tag} (default: the newest tag),
    or, with hf_model, a Hugging Face model directory (Llama-3, Qwen2/2.5, Qwen3, NanoChat) instead."""
    if hf_model is not None:
        return load_hf(hf_model, device, phase)
    root = checkpoint_root(source)
    tags = [t for t in (os.listdir(root) if os.path.isdir(root) else []) if find_last_step(os.path.join(root, t)) is not None]
    if model_tag is None:
        if not tags:
            raise FileNotFoundError(f"no {source} checkpoint in {root}: run the {source} stage first")
        model_tag = max(tags, key=lambda t: os.path.getmtime(os.path.join(root, t)))
    elif model_tag not in tags:
        raise FileNotFoundError(f"no {source} checkpoint tagged {model_tag!r} in {root}; found: {tags or 'none'}")
    model, tokenizer, meta = load_model_dir(os.path.join(root, model_tag), step, device, phase)
    meta.setdefault("model_tag", model_tag)
    return model, tokenizer, meta
