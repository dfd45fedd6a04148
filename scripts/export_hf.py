"""
Export a nanorl checkpoint as a Hugging Face model directory: model.safetensors + config.json + tokenizer.json
(HF `tokenizers` format) + tokenizer_config.json with the chat template. transformers then loads it with
AutoModelForCausalLM.from_pretrained(DIR) and gives the same logits. nanorl's own architecture is written as
NanoChatForCausalLM; a model imported with --hf-model (and trained further) in its own architecture.

    python -m scripts.export_hf -i rl -o out/my-model
    python -m scripts.export_hf -i rl --dtype bfloat16 -o out/my-model-bf16
    python -m scripts.export_hf -i rl --peft -o out/my-adapter     # a LoRA run on --hf-model: PEFT adapter dir

A LoRA checkpoint (chat_rl --lora-rank) exports merged (base + adapters) unless --peft is given.
"""
import os
import sys

import torch

from nanorl.common import ArgumentParser, nonneg_int

parser = ArgumentParser(description="Export a nanorl checkpoint to Hugging Face format")
parser.add_argument("-i", "--source", default="rl", choices=["base", "mid", "sft", "rl"], help="which checkpoint")
parser.add_argument("-g", "--model-tag", default=None, help="checkpoint subdirectory (default: newest)")
parser.add_argument("-s", "--model-step", "--step", type=nonneg_int, default=None, help="checkpoint step (default: last)")
parser.add_argument("-o", "--output", required=True, help="directory to write (replaced if it exists)")
parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="dtype of the saved weights")
parser.add_argument("--peft", action="store_true", help="a LoRA checkpoint of a Hugging Face base: write the adapters "
                    "as a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) instead of merged weights")
args = parser.parse_args()

if args.peft:
    from nanorl.checkpoint import checkpoint_root, find_last_step  # noqa: E402
    from nanorl.lora import export_peft  # noqa: E402
    root = checkpoint_root(args.source)
    tags = [t for t in (os.listdir(root) if os.path.isdir(root) else []) if find_last_step(os.path.join(root, t)) is not None]
    tag = args.model_tag or (max(tags, key=lambda t: os.path.getmtime(os.path.join(root, t))) if tags else None)
    try:
        if tag is None:
            raise FileNotFoundError(f"no {args.source} checkpoint in {root}")
        out = export_peft(os.path.join(root, tag), args.model_step, args.output)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        sys.exit(f"--peft: {e}")
    print(f"wrote the LoRA adapters of {args.source} ({tag}) as a PEFT adapter directory to {out}")
    sys.exit(0)

from nanorl.checkpoint import load_model  # noqa: E402
from nanorl.hf import export_hf  # noqa: E402

try:
    model, tokenizer, meta = load_model(args.source, "cpu", phase="eval", model_tag=args.model_tag, step=args.model_step)
except (FileNotFoundError, ValueError, RuntimeError) as e:
    sys.exit(f"could not load the {args.source} checkpoint: {e}")
model.float()  # the CUDA embedding is kept in bf16; the export's dtype is --dtype's alone
out = export_hf(model, tokenizer, args.output, dtype=getattr(torch, args.dtype))
print(f"wrote {args.source} ({meta.get('model_tag')} step {meta.get('step')}) to {out}")
