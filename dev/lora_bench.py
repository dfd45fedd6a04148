"""
CPU figures for docs/lora.md: the weight-sync time of full-weight RL against LoRA's two ways to reach the engine,
and the time of one training step with and without LoRA, on small nanorl-shaped models.

Weight sync after an optimizer step:
  full        the engine's own copy of every weight refreshed by Engine.load_weights (what chat_rl does today)
  lora-merge  the engine keeps its own merged copy; a sync recomputes W + (alpha/r) B A for every adapted layer
              (it must also hold a second copy of the frozen base to merge from)
  lora-share  the engine shares the trainer's wrapped model (share_weights=True): nothing to do

    OMP_NUM_THREADS=1 python -m dev.lora_bench
"""

import argparse
import copy
import statistics
import time

import torch

from nanorl.engine import Engine
from nanorl.gpt import GPTConfig, build_model
from nanorl.lora import LoraConfig, apply_lora, build_lora_optimizer, lora_layers
from nanorl.optim import build_optimizer
from nanorl.tokenizer import SPLIT_PATTERN, Tokenizer

TOK = Tokenizer.from_ranks({bytes([i]): i for i in range(256)}, SPLIT_PATTERN)


def median_time(fn, repeats):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def make(depth, width, seq):
    torch.manual_seed(0)
    cfg = GPTConfig(
        sequence_len=seq, vocab_size=272, n_layer=depth, n_head=width // 64, n_kv_head=width // 64, n_embd=width
    )
    return build_model(cfg, "cpu")


@torch.no_grad()
def merged_sync(engine_model, base, model):
    """The merge option's sync: every adapted weight of the engine's copy := base weight + (alpha/r) B A."""
    for name, m in lora_layers(model):
        engine_model.get_submodule(name).weight.copy_(base.get_submodule(name).weight + m.delta_weight())


def step_time(model, optimizer, x, repeats):
    def step():
        logp = model.token_logprobs(x[:, :-1], x[:, 1:])
        (-logp.mean()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return median_time(step, repeats)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    p.add_argument("--shapes", default="2x64,4x256,8x512", help="depth x width of each model")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batch", type=int, default=8, help="sequences per training step")
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    a = p.parse_args()
    print(
        "| model | params | adapters | sync full ms | sync lora-merge ms | sync lora-share ms "
        "| step full ms | step lora ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for shape in a.shapes.split(","):
        depth, width = map(int, shape.split("x"))
        full = make(depth, width, a.seq)
        x = torch.randint(0, 256, (a.batch, a.seq + 1))
        engine = Engine(full, TOK, batch_size=1, max_len=16)
        t_full = median_time(lambda: engine.load_weights(full), a.repeats)
        t_step_full = step_time(full, build_optimizer(full), x, a.repeats)
        base = copy.deepcopy(full)
        lora = apply_lora(full, LoraConfig(rank=a.rank, alpha=2 * a.rank))
        n_adapt = sum(p.numel() for p in lora.parameters() if p.requires_grad)
        t_merge = median_time(lambda: merged_sync(engine.model, base, lora), a.repeats)
        shared = Engine(lora, TOK, batch_size=1, max_len=16, share_weights=True)
        t_share = median_time(lambda: shared.load_weights(), a.repeats)  # a no-op with share_weights
        t_step_lora = step_time(lora, build_lora_optimizer(lora, lr=1e-3), x, a.repeats)
        n = sum(p.numel() for n_, p in lora.named_parameters() if "lora_" not in n_)
        print(
            f"| d{depth} w{width} | {n / 1e6:.2f}M | {n_adapt / 1e6:.3f}M | {t_full * 1e3:.2f} | {t_merge * 1e3:.2f} "
            f"| {t_share * 1e3:.3f} | {t_step_full * 1e3:.0f} | {t_step_lora * 1e3:.0f} |"
        )


if __name__ == "__main__":
    main()
