"""
Pretrain the base model. --depth is the one dial: width, heads, LRs and the token budget follow from it.

    python -m scripts.base_train --depth 4 --max-seq-len 256 --device-batch-size 8 --total-batch-size 4096 --num-iterations 200
    torchrun --standalone --nproc_per_node=8 -m scripts.base_train -- --depth 20
"""

import math
import os
import time
from contextlib import nullcontext

import torch

from nanorl import fsdp
from nanorl.batch_fit import batch_candidates, compile_model, fit_batch, training_trial
from nanorl.benchmark import get_peak_flops
from nanorl.checkpoint import delete_step, find_last_step, resume, rng_state, save, set_rng_state
from nanorl.common import compute_cleanup, compute_init, get_base_dir
from nanorl.dataloader import PretrainLoader
from nanorl.dataset import describe_source
from nanorl.decode import greedy_decode
from nanorl.flags import (
    SLIME_NAMES,
    ArgumentParser,
    batch_or_auto,
    fraction,
    int_or_off,
    nonneg_float,
    nonneg_int,
    positive_float,
    positive_int,
    tag_name,
)
from nanorl.fsdp import local_bytes, shard_model
from nanorl.gpt import attention_backend, build_model, config_from_depth
from nanorl.logger import ETA, add_logging_args, get_logger, print0, synchronize
from nanorl.loss_eval import evaluate_bpb
from nanorl.optim import build_optimizer
from nanorl.precision import autocast_ctx, precision_line
from nanorl.report import log_json, log_section, record_metrics
from nanorl.tokenizer import get_token_bytes, get_tokenizer

# fmt: off
parser = ArgumentParser(description="Pretrain a base model", aliases=SLIME_NAMES)
parser.add_argument("--depth", type=positive_int, default=20, help="number of layers; width = depth x aspect ratio")
parser.add_argument("--aspect-ratio", type=positive_int, default=64, help="model width per layer of depth")
parser.add_argument("--head-dim", type=positive_int, default=128, help="width of one attention head")
parser.add_argument("--n-kv-head", type=positive_int, default=None, help="key/value heads (GQA); default = number of heads")
parser.add_argument("--max-seq-len", type=positive_int, default=2048, help="context length: tokens per row")
parser.add_argument("--device-batch-size", type=batch_or_auto, default="auto",
                    help="rows per forward/backward on one device; auto: on CUDA the largest of 32, 16, 8, ... "
                         "whose step fits in memory, else 32")
parser.add_argument("--total-batch-size", type=positive_int, default=524288, help="tokens per optimizer step, all ranks")
parser.add_argument("--num-iterations", type=int_or_off, default=-1, help="explicit number of steps (-1: from --target-param-data-ratio)")
parser.add_argument("--target-param-data-ratio", type=positive_float, default=20, help="tokens : params (Chinchilla = 20)")
parser.add_argument("--matrix-lr", type=nonneg_float, default=0.02, help="Muon LR of the transformer's matrices")
parser.add_argument("--embedding-lr", type=nonneg_float, default=0.2, help="AdamW LR of the token embedding")
parser.add_argument("--unembedding-lr", type=nonneg_float, default=0.004, help="AdamW LR of the output head")
parser.add_argument("--weight-decay", type=nonneg_float, default=0.0, help="AdamW weight decay")
parser.add_argument("--warmup-ratio", type=fraction, default=0.0, help="fraction of steps of linear LR warmup")
parser.add_argument("--warmdown-ratio", type=fraction, default=0.2, help="fraction of steps of linear LR decay at the end")
parser.add_argument("--final-lr-frac", type=fraction, default=0.0, help="LR multiplier reached at the last step")
parser.add_argument("--grad-clip", type=nonneg_float, default=1.0, help="max gradient norm (0 = off)")
parser.add_argument("--eval-every", type=int_or_off, default=250, help="val bpb every N steps (0 or -1 = off)")
parser.add_argument("--eval-tokens", type=positive_int, default=10 * 524288, help="tokens of val text per eval")
parser.add_argument("--sample-every", type=int_or_off, default=2000, help="print greedy samples every N steps (0 or -1 = off)")
parser.add_argument("--save-every", type=int_or_off, default=-1, help="checkpoint every N steps (0 or -1 = only at the end)")
parser.add_argument("--keep-last", type=positive_int, default=2, help="keep only the newest N checkpoints")
parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint of this model tag")
parser.add_argument("--model-tag", type=tag_name, default=None, help="checkpoint subdirectory (default: d<depth>)")
parser.add_argument("--data-dir", default=None, help="directory of parquet/jsonl/txt files (default: downloaded shards, else synthetic)")
parser.add_argument("--no-compile", action="store_true", help="skip torch.compile on CUDA")
parser.add_argument("--device-type", default=None, choices=["cuda", "cpu", "mps"], help="default: autodetect")
add_logging_args(parser)
parser.add_argument("--seed", type=nonneg_int, default=42, help="seed of the weights' RNG")
fsdp.add_args(parser)
args = parser.parse_args()
# fmt: on
try:  # the model's shape flags must agree with each other: check them before any work (the vocab size comes later)
    config_from_depth(args.depth, 1, args.max_seq_len, args.aspect_ratio, args.head_dim, args.n_kv_head)
except ValueError as e:
    parser.error(str(e))

fsdp.check_args(args, "base_train")
# CPU offload clips gradients and steps the optimizer on CPU tensors: those collectives need gloo beside NCCL
ddp, rank, local_rank, world_size, device = compute_init(
    args.device_type, seed=args.seed, cpu_collectives=args.cpu_offload
)
master = rank == 0
# before the model: a wandb run that cannot log stops here, not after the model is built
logger = get_logger(
    args.run, project="nanorl", config=vars(args), master_process=master, tensorboard_dir=args.tensorboard
)
tokenizer = get_tokenizer()
token_bytes = get_token_bytes(tokenizer, device)
config = config_from_depth(
    args.depth, tokenizer.vocab_size, args.max_seq_len, args.aspect_ratio, args.head_dim, args.n_kv_head
)
model = build_model(config, device)
if args.fsdp:
    shard_model(model, device, args.activation_checkpointing, args.cpu_offload)
nparams = model.num_params()
flops_per_token = model.estimate_flops()
print0(
    f"model d{args.depth}: {nparams:,} params, {config.n_layer} layers, width {config.n_embd}, {config.n_head} heads "
    f"({config.n_kv_head} kv), {flops_per_token:.3e} FLOPs/token"
)
print0(attention_backend(device))
print0(precision_line(device))
optimizer = build_optimizer(model, args.matrix_lr, args.embedding_lr, args.unembedding_lr, args.weight_decay)
compiled = compile_model(model, device, args.no_compile)
autocast = autocast_ctx(device.type)
ddp_wrapped = ddp and not args.fsdp
if ddp_wrapped:  # DDP's reducer all-reduces gradient buckets while backward still runs, overlapping comms with compute
    compiled = torch.nn.parallel.DistributedDataParallel(
        compiled, device_ids=[device] if device.type == "cuda" else None, gradient_as_bucket_view=True
    )


def trial_step(batch):
    """One forward+backward at `batch` rows through what training calls: under DDP the wrapped model, whose compiled
    graph is split at DDP's gradient buckets (a trial outside DDP compiled, and measured, another graph, and the first
    step compiled again), with input and targets two tensors as in training (one tensor twice is another graph).
    no_sync: no all-reduce, which a rank out of memory part-way would leave the others waiting in. Under --fsdp it
    runs the sharded model, whose collectives fsdp.lockstep_trial makes every rank enter in full."""
    x = torch.zeros(batch, args.max_seq_len, dtype=torch.long, device=device)
    y = torch.zeros(batch, args.max_seq_len, dtype=torch.long, device=device)
    with compiled.no_sync() if ddp_wrapped else nullcontext():
        with autocast:
            loss = compiled(x, targets=y)
        loss.backward()


if args.device_batch_size == "auto":
    candidates = batch_candidates(32, args.total_batch_size, args.max_seq_len * world_size)
    if not candidates:
        raise SystemExit(
            f"--total-batch-size {args.total_batch_size} must be a multiple of --max-seq-len x ranks "
            f"= {args.max_seq_len} x {world_size}"
        )
    trial = training_trial(trial_step, optimizer, device, args.cpu_offload)
    trial = fsdp.lockstep_trial(trial, model) if args.fsdp else trial
    args.device_batch_size, line = fit_batch(trial, candidates, device)
    print0(line)
tokens_per_fwdbwd = args.device_batch_size * args.max_seq_len * world_size
if args.total_batch_size % tokens_per_fwdbwd:
    raise SystemExit(
        f"--total-batch-size {args.total_batch_size} must be a multiple of --device-batch-size x --max-seq-len x ranks "
        f"= {args.device_batch_size} x {args.max_seq_len} x {world_size} = {tokens_per_fwdbwd}"
    )
grad_accum = args.total_batch_size // tokens_per_fwdbwd
num_iterations = (
    args.num_iterations
    if args.num_iterations > 0
    else max(1, round(args.target_param_data_ratio * nparams / args.total_batch_size))
)
model_tag = args.model_tag or f"d{args.depth}"
ckpt_dir = os.path.join(get_base_dir(), "base_checkpoints", model_tag)
print0(
    f"{num_iterations} steps x {args.total_batch_size:,} tokens ({grad_accum} micro-steps each) = "
    f"{num_iterations * args.total_batch_size:,} tokens, data: {describe_source(args.data_dir)}"
)

train_loader = PretrainLoader(
    tokenizer, args.device_batch_size, args.max_seq_len, "train", args.data_dir, device, rank, world_size
)
meta = {"model_config": config.to_dict(), "model_tag": model_tag, "train_args": vars(args), "world_size": world_size}
if args.fsdp:
    print0(
        f"FSDP2 over {world_size} ranks: {local_bytes(model, optimizer) / 2**20:,.1f} MiB of parameters on this rank (before gradients and optimizer state)"
    )

start_step = 0
if args.resume:
    # model and optimizer (or, with --fsdp, their shards); this rank's data position and RNGs beside them
    start_step, _, extra = resume(ckpt_dir, model, optimizer, rank, world_size, model_config=config.to_dict())
    train_loader.load_state_dict(extra["loader"])
    set_rng_state(extra, device)
    print0(f"resumed from {ckpt_dir} at step {start_step}")


def lr_multiplier(it):
    warmup = round(args.warmup_ratio * num_iterations)
    warmdown = round(args.warmdown_ratio * num_iterations)
    if it < warmup:
        return (it + 1) / warmup
    if it <= num_iterations - warmdown:
        return 1.0
    frac = (num_iterations - it) / max(warmdown, 1)
    return frac + (1 - frac) * args.final_lr_frac


def evaluate_val():
    model.eval()
    loader = PretrainLoader(
        tokenizer, args.device_batch_size, args.max_seq_len, "val", args.data_dir, device, rank, world_size
    )
    steps = max(1, args.eval_tokens // tokens_per_fwdbwd)
    with autocast:
        bpb = evaluate_bpb(model, loader, steps, token_bytes)
    model.train()
    return bpb


def sample(prompt, max_tokens=32):
    model.eval()
    with autocast:  # on the compute device (with --cpu-offload the weights live in host memory), pinned kernels
        out = greedy_decode(model, tokenizer.encode(prompt, prepend="<|bos|>"), max_tokens, device)
    model.train()
    return prompt + tokenizer.decode(out)


peak = get_peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
model.train()
losses, val_bpb, t_train, min_val = [], None, 0.0, float("inf")
saved_step = None  # the step of the checkpoint this run wrote last
eta = ETA(start_step / num_iterations)
loader_state = (
    train_loader.state_dict()
)  # the loader's position before the batch waiting in (x, y): what a checkpoint resumes from
x, y = train_loader.next_batch()
t_start = time.time()
for step in range(start_step, num_iterations + 1):
    last_step = step == num_iterations
    if args.eval_every > 0 and (step % args.eval_every == 0 or last_step):
        val_bpb = evaluate_val()
        min_val = min(min_val, val_bpb)
        print0(f"step {step:05d} | val bpb {val_bpb:.4f}")
        logger.log({"val/bpb": val_bpb}, step=step)
    if (master or args.fsdp) and args.sample_every > 0 and (step % args.sample_every == 0 or last_step) and step > 0:
        for p in ["The capital of France is", "Alice has 3 apples and", "The word banana is spelled"]:
            print0(f"  sample: {sample(p)!r}")
    if last_step or (args.save_every > 0 and step > start_step and step % args.save_every == 0):
        extra = {"loader": loader_state, **rng_state(device)}  # with --fsdp every rank writes its shards
        save(ckpt_dir, step, model, optimizer, {**meta, "step": step}, extra, rank, args.keep_last)
        saved_step = step
    if last_step:
        break
    synchronize(device.type)
    t0 = time.time()
    for micro in range(grad_accum):
        # DDP: all-reduce only after the last micro-step's backward; the earlier ones just accumulate locally.
        # FSDP reduce-scatters every micro-step, so that gradients stay sharded (memory is why one uses it)
        with compiled.no_sync() if ddp_wrapped and micro < grad_accum - 1 else nullcontext():
            with autocast:
                loss = compiled(x, targets=y)
            (loss / grad_accum).backward()
        # read and tokenize the next batch on the host while the device still works through this backward
        loader_state = train_loader.state_dict()
        x, y = train_loader.next_batch()
    if ddp:
        optimizer.gradients_averaged()  # DDP / FSDP averaged them: clipping below sees the global gradient
    if args.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    mult = lr_multiplier(step)
    for g in optimizer.param_groups:
        g["lr"] = g["initial_lr"] * mult
    optimizer.step()
    model.zero_grad(set_to_none=True)
    loss_t = loss.detach().float()
    if ddp:  # every rank must see the same verdict, or one stops while the others wait in the next all-reduce
        torch.distributed.all_reduce(loss_t)
        loss_t /= world_size
    loss_val = loss_t.item()  # one host sync per step, for the log line and the NaN check
    if not math.isfinite(loss_val):
        if saved_step == step and master:  # saved just before this step: its weights are the ones that blew up
            delete_step(ckpt_dir, step)
        if ddp:
            torch.distributed.barrier()  # the other ranks name the same surviving step
        good = find_last_step(ckpt_dir)
        kept = (
            f"The last good checkpoint, step {good} in {ckpt_dir}, is kept"
            if good is not None
            else "No checkpoint was written before it"
        )
        raise SystemExit(
            f"step {step + 1}/{num_iterations}: training loss is {loss_val}; stopping. {kept}. "
            f"Lower the LRs (or raise the warmup) and rerun{' with --resume' if good is not None else ''}"
        )
    synchronize(device.type)
    dt = time.time() - t0
    if step > start_step + 2:
        t_train += dt  # the first steps include compilation
    eta.step(
        dt, (step + 1) / num_iterations, timed=step > start_step + 2 or device.type != "cuda"
    )  # GPU warm-up/compile steps skew the pace
    losses.append(loss_val)
    tok_s = args.total_batch_size / dt
    mfu = f" | mfu {100 * flops_per_token * tok_s / (peak * world_size):.1f}%" if peak else ""
    print0(
        f"step {step + 1:05d}/{num_iterations} | loss {loss_val:.4f} | lrm {mult:.2f} | dt {dt * 1000:.0f}ms | "
        f"tok/s {tok_s:,.0f}{mfu} | eta {eta}"
    )
    logger.log({"train/loss": loss_val, "train/lrm": mult, "train/tok_per_s": tok_s}, step=step + 1)

log_section(
    "Base model training",
    [
        {
            "depth": args.depth,
            "params": nparams,
            "num_iterations": num_iterations,
            "total_batch_size": args.total_batch_size,
            "data": describe_source(args.data_dir),
            "final_train_loss": losses[-1] if losses else float("nan"),
            "min_val_bpb": min_val,
            "wall_time_s": round(time.time() - t_start, 1),
        }
    ],
    rank=rank,
    config=vars(args),
)
if losses:
    log_json(
        "base_train_loss",
        {"step": list(range(start_step + 1, start_step + 1 + len(losses))), "loss": losses},
        rank=rank,
    )
if min_val < float("inf"):
    record_metrics(
        "BASE",
        {
            f"val bpb (min during training, {max(1, args.eval_tokens // tokens_per_fwdbwd) * tokens_per_fwdbwd} tokens)": min_val
        },
        rank=rank,
    )
logger.finish()
compute_cleanup()
