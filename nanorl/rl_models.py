"""
The models RL builds beside the policy, for scripts/chat_rl.py: the critic of --advantage-estimator ppo with its
optimizer, and the frozen teacher of on-policy distillation (--use-opd). The frozen KL reference is a copy of the
policy (or, with LoRA, the policy with its adapters off: lora.Reference), made where the policy is set up.
"""

import os

from nanorl.checkpoint import load_model, load_model_dir
from nanorl.gpt import Critic
from nanorl.optim import MuonAdamW


def build_critic(model, lr, device):
    """The critic (the policy's architecture with a value head) and its AdamW at `lr` (--critic-lr), no decay."""
    critic = Critic(model).to(device)
    adamw = dict(kind="adamw", lr=lr, initial_lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    return critic, MuonAdamW([dict(params=list(critic.parameters()), **adamw)])


def load_teacher(spec, device):
    """--opd-teacher-load: a checkpoint directory, or source[:tag] (e.g. sft:d8); frozen."""
    if os.path.isdir(spec):
        teacher, _, _ = load_model_dir(spec, device=device)
    else:
        src, _, tag = spec.partition(":")
        teacher, _, _ = load_model(src, device, model_tag=tag or None)
    return teacher.requires_grad_(False)
