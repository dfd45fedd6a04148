"""
Export a nanorl checkpoint as a Hugging Face model directory: model.safetensors + config.json +
generation_config.json + tokenizer.json (HF `tokenizers` format) + tokenizer_config.json with the chat template.
transformers then loads it with AutoModelForCausalLM.from_pretrained(DIR) and gives the same logits. nanorl's own
architecture is written as NanoChatForCausalLM; a model imported with --hf-model (and trained further) in its own
architecture, with that model's declared context, eos and pad ids and generation settings.

    python -m scripts.export_hf -i rl -o out/my-model
    python -m scripts.export_hf -i rl --dtype bfloat16 -o out/my-model-bf16
    python -m scripts.export_hf -i rl --peft -o out/my-adapter     # a LoRA run on --hf-model: PEFT adapter dir

A LoRA checkpoint (chat_rl --lora-rank) exports merged (base + adapters) unless --peft is given. The output is a
new or empty directory; --force replaces an earlier export there, and nothing else is ever replaced.
"""

import os

import torch

from nanorl.flags import ArgumentParser
from nanorl.hf import check_export_dir, export_hf
from nanorl.model_loading import add_model_args, export_peft, find_checkpoint_dir, load_model_from_args

parser = ArgumentParser(description="Export a nanorl checkpoint to Hugging Face format")
add_model_args(parser, "rl", short=True, hf_model=False)
parser.add_argument(
    "-o", "--output", required=True, help="directory to write: a new or empty one (or an earlier export, with --force)"
)
parser.add_argument(
    "--force", action="store_true", help="replace an earlier export in --output (never a directory it did not write)"
)
parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="dtype of the saved weights")
parser.add_argument(
    "--peft",
    action="store_true",
    help="a LoRA checkpoint of a Hugging Face base: write the adapters "
    "as a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) instead of merged weights",
)
args = parser.parse_args()
check_export_dir(args.output, args.force)  # before anything loads: a target it may not replace is one line at once

if args.peft:  # the adapters alone, in the layout peft's PeftModel.from_pretrained reads
    checkpoint_dir = find_checkpoint_dir(args.source, args.model_tag)
    out = export_peft(checkpoint_dir, args.model_step, args.output, args.force)
    print(
        f"wrote the LoRA adapters of {args.source} ({os.path.basename(checkpoint_dir)}) as a PEFT adapter directory "
        f"to {out}"
    )
    raise SystemExit(0)

# a checkpoint that began as an open model keeps that model's context, eos/pad ids and sampling defaults
model, tokenizer, meta = load_model_from_args(args, "cpu", phase="eval")
model.float()  # the CUDA embedding is kept in bf16; the export's dtype is --dtype's alone
out = export_hf(
    model,
    tokenizer,
    args.output,
    dtype=getattr(torch, args.dtype),
    source_config=meta.get("hf_config"),
    source_generation=meta.get("hf_generation_config"),
    force=args.force,
)
print(f"wrote {args.source} ({meta.get('model_tag')} step {meta.get('step')}) to {out}")
