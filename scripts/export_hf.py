"""
Export a nanorl checkpoint as a Hugging Face model directory: model.safetensors + config.json +
generation_config.json + tokenizer.json (HF `tokenizers` format) + tokenizer_config.json with the chat template.
transformers then loads it with AutoModelForCausalLM.from_pretrained(DIR) and gives the same logits. nanorl's own
architecture is written as NanoChatForCausalLM; a model imported with --hf-model (and trained further) in its own
architecture, with that model's declared context, eos and pad ids and generation settings.

    python -m scripts.export_hf -i rl -o out/my-model
    python -m scripts.export_hf -i rl --dtype bfloat16 -o out/my-model-bf16
"""
import torch

from nanorl.checkpoint import add_model_args, load_model_from_args
from nanorl.common import ArgumentParser
from nanorl.hf import export_hf

parser = ArgumentParser(description="Export a nanorl checkpoint to Hugging Face format")
add_model_args(parser, "rl", short=True, hf_model=False)
parser.add_argument("-o", "--output", required=True, help="directory to write (replaced if it exists)")
parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="dtype of the saved weights")
args = parser.parse_args()

# a checkpoint that began as an open model keeps that model's context, eos/pad ids and sampling defaults
model, tokenizer, meta = load_model_from_args(args, "cpu", phase="eval")
model.float()  # the CUDA embedding is kept in bf16; the export's dtype is --dtype's alone
out = export_hf(model, tokenizer, args.output, dtype=getattr(torch, args.dtype), source_config=meta.get("hf_config"),
                source_generation=meta.get("hf_generation_config"))
print(f"wrote {args.source} ({meta.get('model_tag')} step {meta.get('step')}) to {out}")
