"""
Time nanorl.fsdp.gather_full_state: the sharded policy's full weights copied into an unsharded sampler copy
(bf16 on CUDA, as the RL engine holds it; fp32 on CPU), the median of a few calls.

    torchrun --standalone --nproc_per_node=2 dev/fsdp_gather_time.py --depth 8
"""

import argparse
import statistics

import torch

from nanorl.common import compute_cleanup, compute_init
from nanorl.fsdp import gather_full_state, shard_model
from nanorl.gpt import build_model, config_from_depth
from nanorl.logger import print0

parser = argparse.ArgumentParser()
parser.add_argument("--depth", type=int, default=20)
parser.add_argument("--n-kv-head", type=int, default=None)
parser.add_argument("--vocab-size", type=int, default=32768)
parser.add_argument("--repeats", type=int, default=5)
args = parser.parse_args()

ddp, rank, local_rank, world_size, device = compute_init()
config = config_from_depth(args.depth, args.vocab_size, n_kv_head=args.n_kv_head)
model = shard_model(build_model(config, device), device)
sampler = build_model(config, device)
if device.type == "cuda":
    sampler.to(torch.bfloat16)
times = [gather_full_state(model, sampler) for _ in range(args.repeats + 1)][1:]  # the first call warms up
nbytes = sum(p.numel() * p.element_size() for p in sampler.parameters())
print0(
    f"d{args.depth} ({model.num_params() / 1e6:.0f}M params) on {world_size} x {device.type}: gather into a "
    f"{nbytes / 2**20:,.0f} MiB sampler copy takes {1000 * statistics.median(times):.1f} ms (median of {args.repeats})"
)
compute_cleanup()
