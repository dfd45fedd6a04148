"""
Finding and loading a model to evaluate, serve, export or train further: a pipeline stage's checkpoint
(<base>/{source}_checkpoints/<tag>) or a Hugging Face model directory.

Top to bottom: where a stage's checkpoints are (SOURCES, checkpoint_root, find_checkpoint_dir), loading a checkpoint
directory (load_model_dir) or a Hugging Face one (load_hf), load_model (either), the flags that pick the model
(add_model_args, load_model_from_args), and LoRA checkpoints (the adapters on their base; export_peft). The files
themselves are read by nanorl/checkpoint.py; the adapters are nanorl/lora.py's.
"""

import os
import sys

import torch

from nanorl import lora
from nanorl.checkpoint import find_last_step, load_checkpoint, load_weights, model_config, model_path
from nanorl.common import get_base_dir
from nanorl.errors import BadValue, MissingFile
from nanorl.flags import nonneg_int, tag_name
from nanorl.gpt import build_model as build_gpt
from nanorl.logger import print0

SOURCES = ("base", "mid", "sft", "rl")


def checkpoint_root(source):
    if source not in SOURCES:
        raise ValueError(f"unknown checkpoint source {source!r}; valid: {', '.join(SOURCES)}")
    return os.path.join(get_base_dir(), f"{source}_checkpoints")


def find_checkpoint_dir(source, model_tag=None):
    """<base>/{source}_checkpoints/{model_tag}; model_tag None: the tag whose last complete step was saved most
    recently (a hand run into another tag counts too), and when there are several tags, a line on stderr names them
    and the one taken."""
    root = checkpoint_root(source)
    tags = [
        t
        for t in (os.listdir(root) if os.path.isdir(root) else [])
        if find_last_step(os.path.join(root, t)) is not None
    ]
    if model_tag is None:
        if not tags:
            raise MissingFile(f"no {source} checkpoint in {root}: run the {source} stage first")

        def saved_at(t):
            return os.path.getmtime(os.path.join(root, t, f"meta_{find_last_step(os.path.join(root, t)):06d}.json"))

        model_tag = max(sorted(tags), key=saved_at)
        if len(tags) > 1:
            print0(
                f"{source} checkpoints have {len(tags)} tags ({', '.join(sorted(tags))}): loading {model_tag!r}, the "
                f"most recently saved; -g/--model-tag picks another",
                file=sys.stderr,
            )
    elif model_tag not in tags:
        raise MissingFile(f"no {source} checkpoint tagged {model_tag!r} in {root}; found: {tags or 'none'}")
    return os.path.join(root, model_tag)


def describe_checkpoint(checkpoint_dir, step):
    """ "sft checkpoint d4 step 80" for <base>/sft_checkpoints/d4 (a directory elsewhere: "checkpoint step 80")."""
    parent, tag = os.path.split(os.path.abspath(checkpoint_dir))
    source = os.path.basename(parent).removesuffix("_checkpoints")
    return f"{source} checkpoint {tag} step {step}" if source in SOURCES else f"checkpoint step {step}"


def load_model_dir(checkpoint_dir, step=None, device="cpu", phase="eval"):
    """Rebuild the GPT from a checkpoint's metadata and weights, plus the tokenizer, and say which step it loaded
    (a run never silently uses another step than the one its user meant). -> (model, tokenizer, meta)"""
    step = find_last_step(checkpoint_dir) if step is None else step
    loaded = _load_model_dir(checkpoint_dir, step, device, phase)
    print0(f"loaded {describe_checkpoint(checkpoint_dir, step)} from {os.path.abspath(checkpoint_dir)}")
    return loaded


def _load_model_dir(checkpoint_dir, step, device, phase):
    from nanorl.tokenizer import get_tokenizer

    model_state, _, meta, _ = load_checkpoint(checkpoint_dir, step, device=device)
    if meta.get("lora"):  # adapters only, and a pointer to their base: the base with the adapters merged in
        return load_lora_checkpoint(meta, model_state, model_path(checkpoint_dir, step), device, phase)
    config = model_config(meta, os.path.join(checkpoint_dir, f"meta_{step:06d}.json"))
    model = build_gpt(config, device)
    load_weights(model, model_state, model_path(checkpoint_dir, step))
    model.train() if phase == "train" else model.eval()
    if meta.get("tokenizer_dir"):  # trained from an open model: its own tokenizer, whose embedding may have spare rows
        from nanorl.tokenizer import HFTokenizer

        tokenizer = HFTokenizer.load(meta["tokenizer_dir"])
        if tokenizer.vocab_size > config.vocab_size:
            raise BadValue(
                f"tokenizer in {meta['tokenizer_dir']} has {tokenizer.vocab_size} tokens, more than the checkpoint in {checkpoint_dir} ({config.vocab_size})"
            )
        return model, tokenizer, meta
    tokenizer = get_tokenizer()
    if tokenizer.vocab_size != config.vocab_size:
        raise BadValue(
            f"tokenizer has {tokenizer.vocab_size} tokens but the checkpoint in {checkpoint_dir} expects {config.vocab_size}"
        )
    return model, tokenizer, meta


def load_hf(directory, device, phase="eval"):
    """A Hugging Face model directory -> (model, tokenizer, meta). Trained in fp32 (autocast makes bf16
    matmuls); served in bf16 on CUDA. meta's tokenizer_dir and source configs travel into checkpoints saved from it."""
    from nanorl.hf import load_hf_model, read_generation_config
    from nanorl.tokenizer import HFTokenizer

    device = torch.device(device)
    model, hf_cfg = load_hf_model(directory, device, dtype=torch.float32 if phase == "train" else None)
    tokenizer = HFTokenizer.load(directory)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise BadValue(
            f"{directory}/tokenizer.json has {tokenizer.vocab_size} tokens, more than the model's {model.config.vocab_size}"
        )
    model.train() if phase == "train" else model.eval()
    directory = os.path.abspath(directory)
    print0(f"loaded Hugging Face model {directory}")
    meta = {
        "model_config": model.config.to_dict(),
        "model_tag": os.path.basename(directory.rstrip("/")),
        "hf_model": directory,
        "tokenizer_dir": directory,
        # what an export writes back: the declared context, every eos id, the pad token, sampling defaults
        "hf_config": hf_cfg,
        "hf_generation_config": read_generation_config(directory),
    }
    return model, tokenizer, meta


def load_model(source, device, phase="eval", model_tag=None, step=None, hf_model=None):
    """Load the model of a pipeline stage: <base>/{source}_checkpoints/{model_tag} (default: the newest tag),
    or, with hf_model, a Hugging Face model directory (Llama-3, Qwen2/2.5, Qwen3, NanoChat) instead."""
    if hf_model is not None:
        return load_hf(hf_model, device, phase)
    checkpoint_dir = find_checkpoint_dir(source, model_tag)
    model, tokenizer, meta = load_model_dir(checkpoint_dir, step, device, phase)
    meta.setdefault("model_tag", os.path.basename(checkpoint_dir))
    return model, tokenizer, meta


def add_model_args(parser, source="sft", short=False, hf_model=True):
    """The flags that pick the model a script loads, read back by load_model_from_args: --source (the pipeline
    stage; source=None: the script has no choice), --model-tag, --model-step and --hf-model (hf_model=False: none).
    short: also -i, -g and -s, as the chat tools take them. parser may be an argument group."""

    def names(*flags):
        return [f for f in flags if short or f.startswith("--")]

    if source is not None:
        parser.add_argument(
            *names("-i", "--source"),
            default=source,
            choices=SOURCES,
            help="the pipeline stage whose checkpoint to load",
        )
    parser.add_argument(
        *names("-g", "--model-tag"),
        type=tag_name,
        default=None,
        help="checkpoint subdirectory (default: the one saved most recently; named when there are several)",
    )
    parser.add_argument(
        *names("-s", "--model-step", "--step"),
        type=nonneg_int,
        default=None,
        help="checkpoint step (default: the last)",
    )
    if hf_model:
        parser.add_argument(
            "--hf-model",
            default=None,
            metavar="DIR",
            help="load a Hugging Face model directory (Llama-3, Qwen2/2.5, Qwen3) instead of --source",
        )


def load_model_from_args(args, device, phase="eval", source=None):
    """load_model with the flags of add_model_args -> (model, tokenizer, meta); source: for scripts without --source."""
    hf_model = getattr(args, "hf_model", None)
    return load_model(source or args.source, device, phase, args.model_tag, args.model_step, hf_model)


# -----------------------------------------------------------------------------------------------
# LoRA checkpoints: the adapters (model_<step>.safetensors holds only them) and, in meta["lora"], where their base is
# (nanorl/lora.py makes the adapters and their meta entry)


def load_lora_checkpoint(meta, adapter_state, path, device, phase="eval", merge=True):
    """A LoRA checkpoint -> (model, tokenizer, meta): the base it points to with the adapters loaded; merged into a
    plain GPT (merge=True: what eval, serving and export want) or still wrapped."""
    base = meta["lora"]["base"]
    try:
        model, tokenizer, _ = load_model(
            base["source"], device, phase, base.get("model_tag"), base.get("step"), base.get("hf_model")
        )
    except (FileNotFoundError, ValueError) as e:
        raise FileNotFoundError(f"{path} holds LoRA adapters, and their base model cannot be loaded: {e}") from e
    lora.apply_lora(model, lora.LoraConfig(**meta["lora"]["config"]))
    lora.load_lora_state_dict(model, adapter_state, path)
    if not merge:
        return model, tokenizer, meta
    # merged, it is a plain model: its meta must not send a later load (or a save made from it) to the adapters
    return lora.merge_lora(model), tokenizer, {k: v for k, v in meta.items() if k != "lora"}


def export_peft(checkpoint_dir, step, out_dir, force=False):
    """A LoRA checkpoint of a Hugging Face base -> a PEFT adapter directory that peft loads onto that base. out_dir
    is claimed as hf.export_directory says (force: an earlier export there may be replaced)."""
    from nanorl.hf import check_export_dir, export_directory

    state, _, meta, _ = load_checkpoint(checkpoint_dir, step)
    path = model_path(checkpoint_dir, meta.get("step", step))
    if not meta.get("lora"):
        raise BadValue(
            f"{checkpoint_dir} step {meta.get('step')} holds full weights, not LoRA adapters: export it without --peft"
        )
    hf_dir = meta["lora"]["base"].get("hf_model")
    if not hf_dir:
        raise BadValue(f"{path}: the adapters' base is a nanorl checkpoint, not a Hugging Face model: export merged")
    check_export_dir(out_dir, force)  # before the model loads: a refused target is one line at once
    model, _, _ = load_lora_checkpoint(meta, state, path, "cpu", merge=False)
    with export_directory(out_dir, force) as tmp:
        lora.save_peft(model, tmp, hf_dir)
    return out_dir
