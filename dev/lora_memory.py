"""
Memory of RL on one GPU for Qwen2.5-shaped models, full-weight vs LoRA, computed from the sizes of the tensors a run
holds (the models live on the meta device; the optimizer takes one step there to create its state):

  full  fp32 master weights (the untied embedding bf16, as on CUDA) + fp32 gradients + Muon momentum / AdamW moments
        + the engine's own bf16 copy of every weight
  lora  the frozen base once in bf16 (the engine shares it) + fp32 adapters, their gradients and AdamW moments
  both  + the bf16 KV cache of a rollout of --prompts x --samples sequences of --tokens tokens

Activations, the logits of a micro-batch and the allocator's slack come on top (they depend on --max-tokens-per-gpu,
not on the model's size alone), so a row that fits with little room left may still not run.

    python -m dev.lora_memory --rank 16 --gpu-gb 80
"""

import argparse

import torch

from nanorl.fsdp import local_bytes
from nanorl.gpt import GPT, GPTConfig
from nanorl.lora import LoraConfig, apply_lora, build_lora_optimizer
from nanorl.optim import build_optimizer

# Qwen2.5 shapes from the models' config.json: hidden, layers, heads, kv heads, MLP hidden, vocab, tied embeddings
QWEN25 = {
    "0.5B": (896, 24, 14, 2, 4864, 151936, True),
    "1.5B": (1536, 28, 12, 2, 8960, 151936, True),
    "3B": (2048, 36, 16, 2, 11008, 151936, True),
    "7B": (3584, 28, 28, 4, 18944, 152064, False),
    "14B": (5120, 48, 40, 8, 13824, 152064, False),
    "32B": (5120, 64, 40, 8, 27648, 152064, False),
    "72B": (8192, 80, 64, 8, 29568, 152064, False),
}


def qwen_config(size):
    c, n_layer, n_head, n_kv, hidden, vocab, tied = QWEN25[size]
    return GPTConfig(
        sequence_len=4096,
        vocab_size=vocab,
        n_layer=n_layer,
        n_head=n_head,
        n_kv_head=n_kv,
        n_embd=c,
        mlp="swiglu",
        mlp_hidden=hidden,
        norm_weight=True,
        attn_bias=True,
        qk_norm=False,
        tie_embeddings=tied,
        softcap=0.0,
    )


def meta_model(config):
    with torch.device("meta"):
        model = GPT(config)
    model.tie_weights()
    if not config.tie_embeddings:
        model.transformer.wte.to(torch.bfloat16)  # as on CUDA (gpt.embedding_dtype)
    return model


def with_state(model, optimizer):
    """Bytes of parameters + gradients + optimizer state after one (meta) step."""
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    return local_bytes(model, optimizer)


def footprints(config, lora_cfg):
    """(params, adapter params, full-weight bytes, LoRA bytes) without the KV cache."""
    model = meta_model(config)
    n = model.num_params()
    full = with_state(model, build_optimizer(model)) + 2 * n  # + the engine's bf16 copy
    model = meta_model(config)
    apply_lora(model, lora_cfg)
    for p in model.parameters():
        if not p.requires_grad:
            p.data = p.data.to(torch.bfloat16)  # apply_lora keeps the base in bf16 on CUDA
    n_adapt = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return n, n_adapt, full, with_state(model, build_lora_optimizer(model, lr=1e-3))


def kv_bytes(config, sequences, tokens):
    head_dim = config.head_dim or config.n_embd // config.n_head
    return 2 * config.n_layer * sequences * tokens * config.n_kv_head * head_dim * 2  # K and V, bf16


def main():
    p = argparse.ArgumentParser(description="RL memory on one GPU, full-weight vs LoRA")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--targets", default="qkv,o,mlp")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--gpu-gb", type=float, default=80.0)
    a = p.parse_args()
    lora_cfg = LoraConfig(rank=a.rank, alpha=2 * a.rank, targets=a.targets)
    print(
        f"| Qwen2.5 shape | params | adapters (r={a.rank}) | full: bytes/param | full GB | LoRA: bytes/param "
        f"| LoRA GB | KV cache GB ({a.prompts}x{a.samples}x{a.tokens}) | fits {a.gpu_gb:.0f} GB full / LoRA |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for size in QWEN25:
        config = qwen_config(size)
        n, n_adapt, full, lora = footprints(config, lora_cfg)
        kv = kv_bytes(config, a.prompts * a.samples, a.tokens)
        fits = ["yes" if (b + kv) / 1e9 <= a.gpu_gb else "no" for b in (full, lora)]
        print(
            f"| {size} | {n / 1e9:.2f}B | {n_adapt / 1e6:.1f}M | {full / n:.1f} | {full / 1e9:.1f} | {lora / n:.2f} "
            f"| {lora / 1e9:.1f} | {kv / 1e9:.1f} | {fits[0]} / {fits[1]} |"
        )


if __name__ == "__main__":
    main()
