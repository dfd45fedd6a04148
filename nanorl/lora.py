"""
LoRA: low-rank adapters on the GPT's Linear layers, for RL (and SFT) of a model too large to train whole.

A wrapped layer computes  y = W x + b + (alpha / r) B A x  with W (and b) frozen and only A (r x in) and B (out x r)
trained. B starts at zero (the LoRA paper's init; A is Kaiming-uniform as in its reference code), so before the first
step the model is exactly the base model, bit for bit.

- targets by name: qkv = attn.c_q/c_k/c_v, o = attn.c_proj, mlp = mlp.c_fc/c_gate/c_proj (the same names for models
  imported from Hugging Face by nanorl/hf.py). The embedding, the unembedding and the norms stay frozen
- the base is kept once: frozen, in bf16 on CUDA (half the bytes of fp32 master weights, and no optimizer state), fp32
  elsewhere; the adapters are fp32 and cast to the activations' dtype in the forward
- the engine samples through the live adapters: it shares the trainer's wrapped model (Engine(share_weights=True)),
  so an update is seen at once and there is nothing to sync (docs/lora.md has the measurement behind the choice)
- state-dict names are the base's own plus `<layer>.lora_A.weight` / `<layer>.lora_B.weight`, which are also the
  names PEFT gives its adapter tensors; save_peft() writes a PEFT adapter directory for a Hugging Face base

    model = apply_lora(model, LoraConfig(rank=16, alpha=32, targets=("qkv", "o", "mlp")))
    optimizer = build_lora_optimizer(model, lr=1e-3)
"""

import json
import math
import os
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanorl.optim import MuonAdamW
from nanorl.precision import low_precision_dtype

# target group -> the Linear layers it wraps, by name inside a Block (mlp.c_gate exists in SwiGLU models only)
TARGETS = {
    "qkv": ("attn.c_q", "attn.c_k", "attn.c_v"),
    "o": ("attn.c_proj",),
    "mlp": ("mlp.c_fc", "mlp.c_gate", "mlp.c_proj"),
}
# nanorl layer name -> the Hugging Face module name PEFT targets (Llama / Qwen naming; see nanorl/hf.py)
HF_MODULES = {
    "attn.c_q": "self_attn.q_proj",
    "attn.c_k": "self_attn.k_proj",
    "attn.c_v": "self_attn.v_proj",
    "attn.c_proj": "self_attn.o_proj",
    "mlp.c_gate": "mlp.gate_proj",
    "mlp.c_fc": "mlp.up_proj",
    "mlp.c_proj": "mlp.down_proj",
}


DEFAULT_LR = 1e-3  # AdamW on the adapters; chosen by the sweep in dev/LOG.md


@dataclass
class LoraConfig:
    rank: int = 16
    alpha: float = 32.0
    targets: tuple = ("qkv", "o", "mlp")
    dropout: float = 0.0

    def __post_init__(self):
        if isinstance(self.targets, str):
            self.targets = tuple(t for t in self.targets.split(",") if t)
        self.targets = tuple(self.targets)
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        if self.alpha <= 0:
            raise ValueError(f"LoRA alpha must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        bad = [t for t in self.targets if t not in TARGETS]
        if bad or not self.targets:
            raise ValueError(f"unknown LoRA targets {','.join(bad) or '(none)'}: choose from {','.join(TARGETS)}")

    @property
    def scaling(self):
        return self.alpha / self.rank

    def to_dict(self):
        return asdict(self)


class LoRALinear(nn.Linear):
    """A Linear whose weight (and bias) are the frozen base's own Parameters, plus a trainable rank-r update.
    A subclass of nn.Linear, so code that reads .weight / .in_features (the optimizer, the export) keeps working."""

    def __init__(self, base, rank, alpha, dropout=0.0):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias  # the same Parameters: no copy of the base
        dev = base.weight.device
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, device=dev, dtype=torch.float32)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, device=dev, dtype=torch.float32)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # the LoRA reference code's init of A
        nn.init.zeros_(self.lora_B.weight)  # B = 0: the update starts at exactly zero
        self.scaling, self.dropout = alpha / rank, dropout
        self.enabled = True  # False inside adapters_off(): the layer is its frozen base

    def forward(self, x):
        out = F.linear(x, self.weight, self.bias)
        if not self.enabled:
            return out
        # dropout only on forwards that train: the engine's sampling and the trainer's no-grad log-probs see the
        # same deterministic model (share_weights samples from this module while it is in train mode)
        if self.dropout > 0 and self.training and torch.is_grad_enabled():
            x = F.dropout(x, self.dropout)
        # fp32 adapters are cast to bf16 activations (the engine's bf16 base runs without autocast); a no-op in fp32
        a, b = self.lora_A.weight.to(x.dtype), self.lora_B.weight.to(x.dtype)
        return out + F.linear(F.linear(x, a), b) * self.scaling

    def delta_weight(self):
        """(alpha / r) B A in fp32: what the adapter adds to the weight."""
        return (self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.scaling


def target_layers(model, cfg):
    """[(name, Linear)] of the layers cfg.targets wraps, in model order (absent ones are skipped: c_gate in ReLU^2
    MLPs)."""
    wanted = [n for t in cfg.targets for n in TARGETS[t]]
    out = []
    for i, block in enumerate(model.transformer.h):
        for rel in wanted:
            try:
                out.append((f"transformer.h.{i}.{rel}", block.get_submodule(rel)))
            except AttributeError:
                continue
    return out


def apply_lora(model, cfg):
    """Freeze every base parameter (bf16 on CUDA, fp32 elsewhere) and wrap the target layers; in place -> model.
    The adapters are drawn from torch's global RNG (seed it for reproducible adapters)."""
    if is_lora(model):
        raise ValueError("apply_lora: the model already has LoRA adapters")
    dtype = low_precision_dtype(model.lm_head.weight.device)
    for p in model.parameters():
        p.requires_grad_(False)
        p.data = p.data.to(dtype)  # parameters only: the rotary buffers keep fp32
    for name, lin in target_layers(model, cfg):
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, LoRALinear(lin, cfg.rank, cfg.alpha, cfg.dropout))
    model.lora_config = cfg
    return model


def is_lora(model):
    return any(isinstance(m, LoRALinear) for m in model.modules())


def lora_layers(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]


def adapter_params(model):
    """The trainable parameters: every lora_A / lora_B weight, in model order."""
    return [p for n, m in lora_layers(model) for p in (m.lora_A.weight, m.lora_B.weight)]


def lora_state_dict(model):
    """{name: tensor} of the adapters only (a few MB): what a LoRA checkpoint stores besides a pointer to the base."""
    return {k: v for k, v in model.state_dict().items() if ".lora_A." in k or ".lora_B." in k}


def base_state_dict(model):
    """The base model's state dict (no adapter tensors), under the plain GPT's names."""
    return {k: v for k, v in model.state_dict().items() if ".lora_A." not in k and ".lora_B." not in k}


@torch.no_grad()
def load_lora_state_dict(model, state, path="the adapter state"):
    """Copy saved adapters into the model's; a set of names or shapes that does not fit is one line naming path."""
    own = lora_state_dict(model)
    missing, unexpected = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
    shapes = [k for k in own.keys() & state.keys() if own[k].shape != state[k].shape]
    if missing or unexpected or shapes:
        raise ValueError(
            f"{path} does not fit the model's LoRA adapters: missing {missing[:2]}, unexpected "
            f"{unexpected[:2]}, wrong shapes {shapes[:2]} (check --lora-rank and --lora-targets)"
        )
    for k, v in own.items():
        v.copy_(state[k])


@torch.no_grad()
def merge_lora(model):
    """Fold every adapter into its base weight (W + (alpha/r) B A, summed in fp32) and put plain Linears back: the
    result is an ordinary GPT (export_hf, the engine's inference copy). In place -> model."""
    for name, m in lora_layers(model):
        lin = nn.Linear(
            m.in_features, m.out_features, bias=m.bias is not None, device=m.weight.device, dtype=m.weight.dtype
        )
        lin.weight.copy_((m.weight.float() + m.delta_weight()).to(m.weight.dtype))
        if m.bias is not None:
            lin.bias.copy_(m.bias)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, lin)
    if hasattr(model, "lora_config"):
        del model.lora_config
    return model


@contextmanager
def adapters_off(model):
    """Run the model as its frozen base: every adapter skipped until the block ends."""
    layers = [m for _, m in lora_layers(model)]
    for m in layers:
        m.enabled = False
    try:
        yield model
    finally:
        for m in layers:
            m.enabled = True


class Reference:
    """The KL reference of a LoRA run at no memory cost: the policy's own model with its adapters off (the base is
    exactly the model RL started from). Has what the RL trainer reads of a reference: config and token_logprobs."""

    def __init__(self, model):
        self.model, self.config = model, model.config

    def token_logprobs(self, *args, **kwargs):
        with torch.no_grad(), adapters_off(self.model):
            return self.model.token_logprobs(*args, **kwargs)


def build_lora_optimizer(model, lr, weight_decay=0.0, betas=(0.9, 0.999)):
    """AdamW on the adapters only (no Muon: an r x n matrix has only r singular directions and Muon would set every
    one of them to the same size, and B = 0 at step 0 has no direction to orthogonalise at all)."""
    params = adapter_params(model)
    if not params:
        raise ValueError("build_lora_optimizer: the model has no LoRA adapters (apply_lora first)")
    group = dict(params=params, kind="adamw", lr=lr, initial_lr=lr, betas=betas, eps=1e-8, weight_decay=weight_decay)
    return MuonAdamW([group])


# -----------------------------------------------------------------------------------------------
# flags and checkpoints: a LoRA checkpoint stores the adapters (model_<step>.safetensors holds only them) and, in its
# meta, the config and a pointer to the base it was trained on


def add_args(parser):
    g = parser.add_argument_group("LoRA (nanorl/lora.py)")
    g.add_argument(
        "--lora-rank", type=int, default=0, help="train rank-R adapters on a frozen base (0: train every weight)"
    )
    g.add_argument(
        "--lora-alpha", type=float, default=None, help="adapter scale alpha (update = alpha/R B A; default 2R)"
    )
    g.add_argument("--lora-targets", default="qkv,o,mlp", help="layers to adapt: any of qkv, o, mlp, comma-separated")
    g.add_argument(
        "--lora-dropout", type=float, default=0.0, help="dropout on the adapters' input (training forwards only)"
    )
    g.add_argument(
        "--lora-lr", type=float, default=DEFAULT_LR, help="AdamW LR of the adapters (--lr-scale does not apply)"
    )


def config_from_args(args):
    return LoraConfig(args.lora_rank, args.lora_alpha or 2.0 * args.lora_rank, args.lora_targets, args.lora_dropout)


def check_args(args, parser=None):
    """Refuse what LoRA does not combine with, one line each (parser.error, or SystemExit without a parser);
    validate the config before any model is built."""
    if not args.lora_rank:
        return

    def fail(msg):
        if parser is not None:
            parser.error(msg)
        raise SystemExit(msg)

    if args.lora_rank < 0:
        fail(f"--lora-rank must be >= 0, got {args.lora_rank}")
    if getattr(args, "fsdp", False):
        fail("--lora-rank does not work with --fsdp: LoRA keeps the frozen base whole on one GPU")
    if getattr(args, "async_mode", False):
        fail("--lora-rank does not work with --async: the sampling ranks would need the adapters shipped")
    try:
        config_from_args(args)
    except ValueError as e:
        fail(f"--lora-*: {e}")


def setup(args, model, meta):
    """--lora-rank R: wrap the loaded model in place -> the pointer to its base that checkpoints store (None: off)."""
    if not args.lora_rank:
        return None
    apply_lora(model, config_from_args(args))
    return {
        "source": args.source,
        "model_tag": args.model_tag or meta.get("model_tag"),
        "step": args.model_step if args.model_step is not None else meta.get("step"),
        "hf_model": args.hf_model,
    }


def trained_state(model):
    """What a checkpoint of the model stores: the adapters of a LoRA model, else the whole state dict."""
    return lora_state_dict(model) if is_lora(model) else model.state_dict()


def checkpoint_meta(model, base):
    """The meta entry of a LoRA checkpoint: the adapter config and `base` (source, model_tag, step, hf_model)."""
    return {"config": model.lora_config.to_dict(), "base": base}


# -----------------------------------------------------------------------------------------------
# PEFT's adapter directory: adapter_config.json + adapter_model.safetensors, for a Hugging Face base


def peft_state_dict(model):
    """The adapters under PEFT's key names: base_model.model.model.layers.{i}.<hf module>.lora_{A,B}.weight."""
    out = {}
    for name, t in lora_state_dict(model).items():
        _, _, i, rest = name.split(".", 3)  # transformer.h.{i}.<layer>.lora_X.weight
        layer, _, tail = rest.partition(".lora_")
        key = f"base_model.model.model.layers.{i}.{HF_MODULES[layer]}.lora_{tail}"
        out[key] = t.detach().float().cpu().contiguous()
    return out


def save_peft(model, out_dir, base_model_name_or_path=None):
    """Write a PEFT LoRA adapter directory for the model's Hugging Face base (peft.PeftModel.from_pretrained)."""
    from safetensors.torch import save_file

    cfg = model.lora_config
    if not model.config.norm_weight:
        raise ValueError("a PEFT adapter needs a Hugging Face base: this is nanorl's own architecture (export merged)")
    os.makedirs(out_dir, exist_ok=True)
    modules = sorted({HF_MODULES[n.split(".", 3)[3]].split(".")[-1] for n, _ in lora_layers(model)})
    adapter_cfg = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "use_rslora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
    }
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(adapter_cfg, f, indent=2)
    save_file(peft_state_dict(model), os.path.join(out_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    return out_dir
