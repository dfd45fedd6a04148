"""
FSDP2 for models larger than one GPU: parameters, gradients and optimizer state sharded across ranks.

With --fsdp every rank holds 1/world of the fp32 weights, of their gradients and of the optimizer state;
each transformer block's full weights exist only while that block runs (all-gathered in bf16 on CUDA just
before its forward and again before its backward, freed right after; gradients are reduce-scattered in fp32).
This is PyTorch's own engine (torch.distributed.fsdp.fully_shard), one call per block plus one for the root.
The optimizer is the same MuonAdamW: AdamW works on the shards, Muon gathers each full matrix to orthogonalise
it (split across ranks, see optim.py).

Checkpoints are torch.distributed.checkpoint (DCP) directories, dcp_<step>/ beside the usual meta/extra
files: every rank writes its own shards (checkpoint.save and checkpoint.resume take a sharded model as they take
any other). To get the single-file model that chat_eval/chat_web/export load:

    python -m nanorl.fsdp consolidate ~/.cache/nanorl/base_checkpoints/d20 [--step N]
"""

import argparse
import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nanorl.checkpoint import dcp_dir, find_last_step, save_checkpoint
from nanorl.common import get_dist_info, is_dtensor
from nanorl.gpt import GPTConfig, build_model
from nanorl.logger import synchronize
from nanorl.precision import checkpoint_context_fn, cuda_dtypes


def add_args(parser):
    """The three flags of every training script that can shard."""
    parser.add_argument(
        "--fsdp",
        action="store_true",
        help="shard params, grads and optimizer state over the ranks (FSDP2; models too big to replicate)",
    )
    parser.add_argument(
        "--activation-checkpointing", action="store_true", help="with --fsdp: recompute block activations in backward"
    )
    parser.add_argument(
        "--cpu-offload", action="store_true", help="with --fsdp: keep the shards and optimizer state in CPU memory"
    )


def check_args(args, script):
    """Before any work: the two options need --fsdp, and --fsdp needs torchrun (FSDP2 runs on a process group)."""
    if (args.activation_checkpointing or args.cpu_offload) and not args.fsdp:
        raise SystemExit("--activation-checkpointing and --cpu-offload only apply with --fsdp")
    if args.fsdp and not get_dist_info()[0]:
        raise SystemExit(
            f"--fsdp needs torchrun, also on one GPU: torchrun --standalone --nproc_per_node=1 -m scripts.{script} -- --fsdp ..."
        )


def mixed_precision(device_type):
    """The FSDP2 precision policy of a device. CUDA: weights gathered in bf16 for compute, gradients reduced in
    fp32 (also on the CPU in CUDA's layout, precision.cuda_dtypes). Elsewhere: everything fp32 (exact tests)."""
    # FSDP2 is imported where it is used, here and below: ~1.5 s a process that every script not sharding would pay
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if cuda_dtypes(device_type):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard_model(model, device, activation_checkpointing=False, cpu_offload=False, mp_policy=None):
    """Shard a GPT in place over all ranks: one FSDP unit per block, the root unit holds embedding and head.
    Master shards are fp32; mp_policy (default: mixed_precision(device.type)) sets the compute and reduce dtypes.
    activation_checkpointing: recompute each block's activations in backward instead of keeping them.
    cpu_offload: keep the sharded weights, gradients and optimizer state in CPU memory (the optimizer steps on the
    CPU); the largest models only, it costs host-device copies every step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard, register_fsdp_forward_method

    if cpu_offload and device.type != "cuda":
        raise ValueError("--cpu-offload moves shards from GPU to CPU memory: it needs --device-type cuda")
    # FSDP2 asserts one original dtype per unit, and on CUDA init_weights (or a load into a model it built) leaves
    # the token embedding in bf16 beside the fp32 head of the root unit. Cast it back to fp32 rather than give it a
    # unit of its own: the policy already gathers it in bf16 for the lookup, so the bf16 copy saved nothing here,
    # the fp32 master costs only 1/world of the embedding per rank, and AdamW then steps it in fp32 like the rest.
    model.float()
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = mixed_precision(device.type) if mp_policy is None else mp_policy
    kw = dict(mesh=mesh, mp_policy=mp, offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy())
    for block in model.transformer.h:
        if activation_checkpointing:
            from torch.distributed._composable import checkpoint  # hooks, not a wrapper: parameter names stay the same

            checkpoint(block, context_fn=checkpoint_context_fn())
        # the last block's weights are needed again at once by backward: keep them gathered after forward
        fully_shard(block, reshard_after_forward=block is not model.transformer.h[-1], **kw)
    fully_shard(model, **kw)
    # methods that run the model outside forward() (RL's log-probs) must gather the root's weights too
    register_fsdp_forward_method(model, "token_logprobs")
    return model


def local_bytes(model, optimizer):
    """Bytes this rank holds for parameters + gradients + optimizer state, from the tensors' local shards.
    Count between steps: right after a forward the root and last block still hold their gathered weights."""

    def nbytes(t):
        t = t.to_local() if is_dtensor(t) else t
        return t.numel() * t.element_size()

    total = sum(nbytes(p) + (nbytes(p.grad) if p.grad is not None else 0) for p in model.parameters())
    return total + sum(nbytes(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))


# --- the device-batch trial under --fsdp (scripts/base_train.py) -----------------------------------

# the collectives a sharded step issues (torch versions name FSDP2's all-gather and reduce-scatter differently)
STEP_COLLECTIVES = [
    n
    for n in ("all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor", "reduce_scatter_single")
    + ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
    if hasattr(dist, n)
]


@contextmanager
def collectives_seen(on_call):
    """While inside, on_call(name, args, kwargs) after each of STEP_COLLECTIVES has been issued on this rank."""
    originals = {n: getattr(dist, n) for n in STEP_COLLECTIVES}

    def seen(name, fn):
        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            on_call(name, args, kwargs)
            return out

        return call

    for n, fn in originals.items():
        setattr(dist, n, seen(n, fn))
    try:
        yield
    finally:
        for n, fn in originals.items():
            setattr(dist, n, fn)


@dataclass(frozen=True)
class TensorSpec:  # a recorded collective's tensor: its shape, never its memory (it may be a whole gathered block)
    shape: tuple
    dtype: torch.dtype
    device: torch.device


def _spec(a):
    if isinstance(a, torch.Tensor):
        return TensorSpec(tuple(a.shape), a.dtype, a.device)
    return [_spec(t) for t in a] if isinstance(a, list) else a


def _zeros(a):
    if isinstance(a, TensorSpec):
        return torch.zeros(a.shape, dtype=a.dtype, device=a.device)
    return [_zeros(t) for t in a] if isinstance(a, list) else a


def lockstep_trial(try_step, model):
    """fit_device_batch's try_step for a sharded model: whatever happens on a rank, it leaves the trial having entered
    the same collectives as the others. A rank out of memory part-way through a step would otherwise enter
    fit_device_batch's all-reduce while the others wait in FSDP's next all-gather (NCCL: a hang, or a mix-up).
    A step's all-gathers and reduce-scatters do not depend on the batch, so they are recorded once, as shapes, from a
    step of one row; a rank whose step then raises torch.OutOfMemoryError enters the ones it had not reached with
    zeros, so the others finish their step (its gradients are thrown away), resets FSDP's per-step state and raises
    the error again. A rank out of memory at one row stops the run (one line; torchrun ends the others)."""
    tape = None

    def step(batch):
        nonlocal tape
        if tape is None:
            tape = []

            def record(name, args, kwargs):
                tape.append((name, _spec(list(args)), {k: _spec(v) for k, v in kwargs.items()}))

            try:
                with collectives_seen(record):
                    try_step(1)
            except torch.OutOfMemoryError:
                raise SystemExit("out of memory at a device batch of 1 row: use a smaller model or --max-seq-len")
        done = 0

        def count(*_):
            nonlocal done
            done += 1

        try:
            with collectives_seen(count):
                return try_step(batch)
        except torch.OutOfMemoryError:
            pass  # out of the except block first: its traceback holds the failed step's tensors
        for name, args, kwargs in tape[done:]:
            work = getattr(dist, name)(*_zeros(args), **{k: _zeros(v) for k, v in kwargs.items()})
            if work is not None:
                work.wait()
        model.reset_iter_state()
        raise torch.OutOfMemoryError(f"out of memory at a device batch of {batch} rows")

    return step


@torch.no_grad()
def gather_full_state(model, into):
    """Copy the sharded model's full weights into `into`, an unsharded model of the same config (the sampler's copy,
    typically bf16): one all-gather per FSDP unit, in the unit's compute dtype (bf16 on CUDA), so at most one
    block's full weights exist beside `into` at a time. Every rank must call it. Returns the seconds it took."""
    synchronize(next(into.parameters()).device.type)
    t0 = time.time()
    target = dict(into.named_parameters())
    units = [(f"transformer.h.{i}.", b) for i, b in enumerate(model.transformer.h)] + [("", model)]
    for prefix, unit in units:
        unit.unshard()  # the root unit gathers only its own weights (embedding, head): blocks stay sharded
        for name, p in unit.named_parameters():
            if not is_dtensor(p):  # gathered by this unit (DTensors still belong to another unit)
                target[prefix + name].copy_(p)
        unit.reshard()
    synchronize(next(into.parameters()).device.type)
    return time.time() - t0


def consolidate(checkpoint_dir, step=None):
    """Write the single-file model (model_<step>.safetensors) of a sharded step, in one process, no GPU needed."""
    import torch.distributed.checkpoint as dcp

    step = find_last_step(checkpoint_dir) if step is None else step
    if step is None:
        raise SystemExit(f"no complete checkpoint in {checkpoint_dir}")
    with open(os.path.join(checkpoint_dir, f"meta_{step:06d}.json")) as f:
        meta = json.load(f)
    if not os.path.isdir(dcp_dir(checkpoint_dir, step)):
        raise SystemExit(
            f"step {step} of {checkpoint_dir} is not sharded (no {dcp_dir(checkpoint_dir, step)}): "
            f"nothing to consolidate"
        )
    model = build_model(GPTConfig(**meta["model_config"]), "cpu")  # fp32 full tensors for DCP to fill
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=dcp_dir(checkpoint_dir, step))  # no process group: one process reads all shards
    save_checkpoint(checkpoint_dir, step, state["model"], None, {**meta, "consolidated": True})
    return step


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description="FSDP checkpoints: consolidate a sharded (DCP) step into one model file"
    )
    parser.add_argument("command", choices=["consolidate"], help="what to do")
    parser.add_argument("checkpoint_dir", help="a run's checkpoint directory holding dcp_<step>/ folders")
    parser.add_argument("--step", type=int, default=None, help="default: the latest complete step")
    a = parser.parse_args()
    s = consolidate(a.checkpoint_dir, a.step)
    print(f"wrote {os.path.join(a.checkpoint_dir, f'model_{s:06d}.safetensors')}")
