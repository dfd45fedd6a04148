"""
Per-rank memory of parameters + gradients + optimizer state, replicated vs --fsdp, computed from the sizes of
the tensors each rank would hold (no weights are allocated: the model lives on the meta device, and a fake
process group stands in for `--world` ranks). Activations, the KV cache and FSDP's transient gathered blocks
come on top.

    python dev/fsdp_memory.py --depth 20 --n-kv-head 2 --world 8
"""

import argparse

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from nanorl.fsdp import local_bytes, shard_model
from nanorl.gpt import GPT, config_from_depth
from nanorl.optim import build_optimizer

parser = argparse.ArgumentParser()
parser.add_argument("--depth", type=int, default=20)
parser.add_argument("--n-kv-head", type=int, default=None)
parser.add_argument("--vocab-size", type=int, default=32768)
parser.add_argument("--world", type=int, default=8)
args = parser.parse_args()


def footprint(shard):
    config = config_from_depth(args.depth, args.vocab_size, n_kv_head=args.n_kv_head)
    with torch.device("meta"):
        model = GPT(config)
    model.transformer.wte.to(torch.bfloat16)  # as on CUDA (gpt.init_weights)
    if shard:
        shard_model(model, torch.device("cpu"))
    optimizer = build_optimizer(model)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.gradients_averaged()
    optimizer.step()  # creates the optimizer state, shaped as in training
    return model.num_params(), local_bytes(model, optimizer)


dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world)  # rank 0 holds the largest shards
nparams, replicated = footprint(False)
_, sharded = footprint(True)
print(
    f"d{args.depth} ({nparams / 1e9:.2f}B params), {args.world} ranks: replicated {replicated / 2**30:.2f} GiB/rank, "
    f"--fsdp {sharded / 2**30:.2f} GiB/rank ({replicated / sharded:.1f}x less)"
)
