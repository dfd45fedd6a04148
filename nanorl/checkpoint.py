"""
Checkpoints: model, optimizer, data/RNG state and metadata, written atomically.

Layout: <checkpoint_dir>/model_<step>.pt, meta_<step>.json, optim_<step>_rank<r>.pt, extra_<step>_rank<r>.pt.
Every file is written to a temp name, fsynced, then renamed, and meta_<step>.json is written last: a step
with no meta file is incomplete and is never picked as "latest", so a crash mid-save leaves the previous
checkpoint usable.
"""
import glob
import json
import os
import re
import shutil

import torch

from nanorl.common import get_base_dir, print0
from nanorl.gpt import GPTConfig
from nanorl.gpt import build_model as build_gpt


def _atomic_save(obj, path):
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _atomic_json(obj, path):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def complete_steps(checkpoint_dir):
    steps = []
    for p in glob.glob(os.path.join(checkpoint_dir, "meta_*.json")):
        m = re.match(r"meta_(\d+)\.json$", os.path.basename(p))
        model = os.path.join(checkpoint_dir, f"model_{int(m.group(1)):06d}.pt") if m else ""
        if m and (os.path.exists(model) or os.path.isdir(os.path.join(checkpoint_dir, f"dcp_{int(m.group(1)):06d}"))):  # dcp: --fsdp shards
            steps.append(int(m.group(1)))
    return sorted(steps)


def find_last_step(checkpoint_dir):
    steps = complete_steps(checkpoint_dir) if os.path.isdir(checkpoint_dir) else []
    return steps[-1] if steps else None


def save_checkpoint(checkpoint_dir, step, model_state, optim_state=None, meta=None, extra=None, rank=0, keep_last=None, group=None):
    """Rank 0 writes the model and meta; every rank writes its own optimizer shard and extra state.
    group: the process group of the ranks that save (default all; async RL's training ranks)."""
    os.makedirs(checkpoint_dir, exist_ok=True)
    if optim_state is not None:
        _atomic_save(optim_state, os.path.join(checkpoint_dir, f"optim_{step:06d}_rank{rank}.pt"))
    if extra is not None:
        _atomic_save(extra, os.path.join(checkpoint_dir, f"extra_{step:06d}_rank{rank}.pt"))
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier(group=group)  # every rank's files exist before the step is marked complete
    if rank == 0:
        if model_state is not None:  # None: the model was saved as shards (nanorl.fsdp.save_sharded)
            _atomic_save(model_state, os.path.join(checkpoint_dir, f"model_{step:06d}.pt"))
        _atomic_json(meta or {}, os.path.join(checkpoint_dir, f"meta_{step:06d}.json"))  # last: marks it complete
        if keep_last:
            for old in complete_steps(checkpoint_dir)[:-keep_last]:
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
        return torch.load(path, map_location=device, weights_only=False)
    except Exception as e:
        raise RuntimeError(f"checkpoint file {path} is corrupt or truncated ({type(e).__name__}: {e}); "
                           f"delete that step to fall back to the previous one") from e


def load_checkpoint(checkpoint_dir, step=None, device="cpu", load_optimizer=False, rank=0):
    """(model_state, optim_state, meta, extra) of `step` (default: the latest complete one)."""
    if step is None:
        step = find_last_step(checkpoint_dir)
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint in {checkpoint_dir}")
    meta_path = os.path.join(checkpoint_dir, f"meta_{step:06d}.json")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint step {step} is incomplete or missing in {checkpoint_dir} (no {meta_path})")
    except json.JSONDecodeError as e:
        raise RuntimeError(f"checkpoint metadata {meta_path} is corrupt: {e}") from e
    if meta.get("sharded") and not os.path.exists(os.path.join(checkpoint_dir, f"model_{step:06d}.pt")):
        raise FileNotFoundError(f"step {step} of {checkpoint_dir} is sharded (saved with --fsdp): run "
                                f"`python -m nanorl.fsdp consolidate {checkpoint_dir} --step {step}` first, or resume with --fsdp")
    model_state = _load(os.path.join(checkpoint_dir, f"model_{step:06d}.pt"), device)
    optim_state = _load(os.path.join(checkpoint_dir, f"optim_{step:06d}_rank{rank}.pt"), device) if load_optimizer else None
    extra_path = os.path.join(checkpoint_dir, f"extra_{step:06d}_rank{rank}.pt")
    extra = _load(extra_path, "cpu") if os.path.exists(extra_path) else None
    return model_state, optim_state, meta, extra


def build_model(checkpoint_dir, step=None, device="cpu", phase="eval"):
    """Rebuild the GPT from a checkpoint's metadata and weights, plus the tokenizer. -> (model, tokenizer, meta)"""
    from nanorl.tokenizer import get_tokenizer
    model_state, _, meta, _ = load_checkpoint(checkpoint_dir, step, device=device)
    config = GPTConfig(**meta["model_config"])
    model = build_gpt(config, device)
    # checkpoints written from torch.compile'd models carry an _orig_mod. prefix
    model_state = {k.removeprefix("_orig_mod."): v for k, v in model_state.items()}
    model.load_state_dict(model_state, strict=True)
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
    model, tokenizer, meta = build_model(os.path.join(root, model_tag), step, device, phase)
    meta.setdefault("model_tag", model_tag)
    return model, tokenizer, meta
