"""
Chat SFT: fine-tune the midtrained model on a small, clean mixture of chat and problems, with a low LR
that decays to zero. Only what the assistant writes is trained on.

This file is also midtraining's loop: scripts/mid_train.py calls train() below with its own mixture and
defaults. Reading order: the flags; the LR schedule, the held-out loss and one optimizer step; then train(),
the stage itself: load the source checkpoint, train on packed conversations (nanorl/sft_data.py) with a
token-mean loss over the whole step, evaluate, save, resume, write the report section. SFT's data mixture and
main() close the file.

    python -m scripts.chat_sft                                    # offline curriculum, from the mid checkpoint
    python -m scripts.chat_sft --source base                      # skip midtraining
    torchrun --nproc_per_node=8 -m scripts.chat_sft --data hub --identity-path identity.jsonl
"""

import os
import time
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from nanorl import fsdp, lora
from nanorl.batch_fit import batch_candidates, compile_model, fit_batch, training_trial
from nanorl.checkpoint import resume, save
from nanorl.common import compute_cleanup, compute_init, get_base_dir, is_sharded
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
from nanorl.gpt import attention_backend
from nanorl.logger import ETA, add_logging_args, get_logger, print0
from nanorl.model_loading import add_model_args, load_model_from_args
from nanorl.optim import build_optimizer
from nanorl.precision import autocast_ctx, precision_line
from nanorl.report import data_seen, log_json, log_section
from nanorl.sft_data import SFTLoader, build_data, levels, padding_fraction
from nanorl.synthetic import levels_flag
from tasks import ARC, GSM8K, CustomJSON, OfflineChat, OfflineProblems, SmolTalk, SpellingBee, TaskMixture

# -----------------------------------------------------------------------------------------------
# flags: the same for both stages, with each stage's defaults


def add_train_args(parser, stage, source, init_lr_frac, warmdown_ratio, num_epochs):
    """The flags of chat_sft and mid_train; `stage` is "mid" or "sft", the rest are that stage's defaults."""
    a = parser.add_argument
    add_model_args(parser, source)
    a(
        "--output-tag",
        type=tag_name,
        default=None,
        help=f"save under {stage}_checkpoints/<tag> (default: the source's tag)",
    )
    add_data_args(parser)
    add_optim_args(parser, init_lr_frac, warmdown_ratio, num_epochs)
    add_run_args(parser, stage)
    add_logging_args(parser)
    a("--device-type", default=None, choices=["cuda", "cpu", "mps"], help="default: autodetect")
    a(
        "--no-compile",
        action="store_true",
        help="train eagerly on CUDA (default: torch.compile of the model, one graph: every batch is B x T)",
    )
    fsdp.add_args(parser)
    lora.add_args(parser)


def add_data_args(parser):
    """Which conversations: the offline curriculum or the Hub datasets, and local files for them."""
    a = parser.add_argument
    a(
        "--data",
        default="offline",
        choices=["offline", "hub"],
        help="offline: the synthetic curriculum (no download); hub: the Hugging Face datasets (or --task-path files)",
    )
    a(
        "--task-path",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a local jsonl/parquet file or directory for a Hub task, e.g. gsm8k=/data/gsm8k (repeatable)",
    )
    a(
        "--identity-path",
        default=None,
        help="jsonl of identity conversations (CustomJSON), mixed in (twice by midtraining)",
    )
    a("--num-examples", type=positive_int, default=20000, help="offline curriculum: number of training problems")
    a(
        "--levels",
        type=levels_flag,
        default="1,2,3,4",
        help="offline curriculum: difficulty levels of the problems (e.g. 1,2 to start easy)",
    )


def add_optim_args(parser, init_lr_frac, warmdown_ratio, num_epochs):
    """How long, in what batches, at which learning rates (the defaults are the stage's)."""
    a = parser.add_argument
    a(
        "--num-epochs",
        type=positive_float,
        default=num_epochs,
        help="passes over the data (ignored with --num-iterations)",
    )
    a("--num-iterations", type=int_or_off, default=-1, help="optimizer steps (-1: as many as --num-epochs takes)")
    a(
        "--device-batch-size",
        type=batch_or_auto,
        default="auto",
        help="rows per micro-batch per rank; auto: on CUDA the largest of 16, 8, 4, ... whose step fits in memory, "
        "else 16 (the step's tokens stay 16 rows' worth: more micro-batches)",
    )
    a("--max-seq-len", type=positive_int, default=None, help="row length T (default: the model's context)")
    a(
        "--total-batch-size",
        type=positive_int,
        default=None,
        help="tokens per optimizer step, all ranks (default: 16 rows of T per rank with auto, else one micro-batch)",
    )
    a("--matrix-lr", type=nonneg_float, default=0.02, help="Muon LR of the transformer's matrices")
    a("--embedding-lr", type=nonneg_float, default=0.2, help="AdamW LR of the token embedding")
    a("--unembedding-lr", type=nonneg_float, default=0.004, help="AdamW LR of the output head")
    a("--weight-decay", type=nonneg_float, default=0.0, help="AdamW weight decay")
    a(
        "--init-lr-frac",
        type=nonneg_float,
        default=init_lr_frac,
        help="multiplier on the LRs above (the base model's LRs)",
    )
    a(
        "--warmdown-ratio",
        type=fraction,
        default=warmdown_ratio,
        help="fraction of training over which the LR decays to 0",
    )


def add_run_args(parser, stage):
    """When to evaluate and save, resuming, the seed."""
    a = parser.add_argument
    a(
        "--eval-every",
        type=positive_int,
        default=100,
        help="eval loss every N steps (and at the start and end)",
    )
    a("--eval-tokens", type=positive_int, default=200_000, help="tokens of held-out conversations per eval")
    a(
        "--save-every",
        type=int_or_off,
        default=-1,
        help="checkpoint every N steps (-1: only at the end)",
    )
    a("--keep-last", type=positive_int, default=2, help="keep only the newest N checkpoints of this run")
    a("--resume", action="store_true", help=f"continue from the latest checkpoint in {stage}_checkpoints/<tag>")
    a("--seed", type=nonneg_int, default=42, help="seed of the weights' RNG and the data order")


# -----------------------------------------------------------------------------------------------
# the LR schedule, the held-out loss, one optimizer step


def lr_multiplier(progress, warmdown_ratio, final_frac=0.0):
    """Constant, then a linear decay to final_frac over the last warmdown_ratio of training (1.0: decay all along)."""
    if warmdown_ratio <= 0 or progress < 1 - warmdown_ratio:
        return 1.0
    left = max(0.0, 1.0 - progress) / warmdown_ratio
    return final_frac + (1.0 - final_frac) * left


@torch.no_grad()
def eval_loss(model, loader, max_batches, autocast, dev):
    """Token-mean loss over held-out batches, summed over every rank first. dev: the compute device, where the losses
    are (with --cpu-offload the weights, and so model.lm_head.weight.device, are in host memory)."""
    model.eval()
    total, count = torch.zeros((), device=dev, dtype=torch.float64), torch.zeros((), device=dev, dtype=torch.float64)
    batches = iter(loader)
    for _ in range(max_batches):
        batch = next(batches, None)
        # under FSDP each forward gathers weights with the other ranks: all stop when any rank runs dry
        if is_sharded(model):
            more = torch.tensor(float(batch is not None), device=dev)
            dist.all_reduce(more, op=dist.ReduceOp.MIN)
            batch = batch if more.item() else None
        if batch is None:
            break
        x, y, d = batch
        with autocast:
            total += model(x, y, doc_ids=d, loss_reduction="sum").double()
        count += (y >= 0).sum()
    if dist.is_initialized():
        dist.all_reduce(total)
        dist.all_reduce(count)
    model.train()
    return (total / count.clamp(min=1)).item()


def train_step(model, optimizer, batches, autocast, world_size):
    """One optimizer step over the grad-accumulation micro-batches -> the step's token-mean loss over all ranks, a
    device tensor: nothing here waits for the device, so the caller packs the next batches while it works.
    Each micro-batch's summed loss is divided by the step's token count on all ranks (times world size, since the
    optimizer averages gradients across ranks): every target token of the step weighs the same."""
    n_tok = sum((y >= 0).sum() for _, y, _ in batches).float()  # counted on the device: no host sync
    if dist.is_initialized():
        dist.all_reduce(n_tok)
    loss_sum = torch.zeros((), device=n_tok.device)
    for x, y, d in batches:
        with autocast:
            loss = model(x, y, doc_ids=d, loss_reduction="sum")
        (loss * world_size / n_tok.clamp(min=1)).backward()
        loss_sum += loss.detach()
    if dist.is_initialized():
        dist.all_reduce(loss_sum)  # the logged loss is the whole step's, not rank 0's share
    optimizer.step()
    model.zero_grad(set_to_none=True)
    return loss_sum / n_tok.clamp(min=1)


# -----------------------------------------------------------------------------------------------
# the stage: load the source model, train on packed conversations, evaluate, save, report


def shard_and_compile(model, args, device, world_size):
    """--fsdp: shard the loaded model in place, before the optimizer is built on the shards. -> what the training
    steps call: every batch is (B, T) with T fixed, one compiled graph on CUDA (flex attention compiles with it)."""
    print0(attention_backend(device))  # packed rows: document-masked attention
    print0(precision_line(device))
    if args.fsdp:
        fsdp.shard_model(model, device, args.activation_checkpointing, args.cpu_offload)
        print0(
            f"FSDP2 over {world_size} ranks: each holds 1/{world_size} of the parameters, gradients and optimizer state"
        )
    return compile_model(model, device, args.no_compile)


AUTO_ROWS = 16  # --device-batch-size auto: the most rows tried, and the rows of a step by default


def fit_rows(args, compiled, model, optimizer, autocast, T, world_size, device):
    """--device-batch-size auto -> the rows of a micro-batch: on CUDA the largest of 16, 8, 4, ... whose training step
    fits (the mechanism base_train uses, nanorl.batch_fit.fit_batch), with the step's tokens (--total-batch-size, by
    default 16 rows per rank) kept by accumulating more micro-batches; elsewhere 16. A number is taken as it is."""
    if args.device_batch_size != "auto":
        return args.device_batch_size
    total = args.total_batch_size or AUTO_ROWS * T * world_size
    candidates = batch_candidates(AUTO_ROWS, total, T * world_size)
    if not candidates:
        raise SystemExit(f"--total-batch-size {total} is not a multiple of T x ranks = {T} x {world_size}")

    def step(batch):  # one document per row: the packed rows' document-masked attention, as training runs it
        x, y = (torch.zeros(batch, T, dtype=torch.long, device=device) for _ in range(2))
        with autocast:
            compiled(x, y, doc_ids=torch.zeros_like(x), loss_reduction="sum").backward()

    trial = training_trial(step, optimizer, device, args.cpu_offload)
    rows, line = fit_batch(fsdp.lockstep_trial(trial, model) if args.fsdp else trial, candidates, device)
    print0(line)
    if args.total_batch_size is None:
        args.total_batch_size = total
    return rows


def batch_plan(device_batch_size, total_batch_size, T, world_size):
    """(tokens per optimizer step, micro-batches per step): one micro-batch of device_batch_size rows of T tokens per
    rank, accumulated until the step holds total_batch_size tokens (default: one micro-batch)."""
    tokens_per_micro = device_batch_size * T * world_size
    total = total_batch_size or tokens_per_micro
    if total % tokens_per_micro:
        raise SystemExit(
            f"--total-batch-size {total} is not a multiple of device batch x T x ranks = {tokens_per_micro}"
        )
    return total, total // tokens_per_micro


def agreed_progress(step, epochs_done, args, device):
    """Training progress 0..1 by steps or epochs. Every rank must agree on the LR and on when to stop: all take the
    furthest rank's progress."""
    p = step / args.num_iterations if args.num_iterations > 0 else epochs_done / args.num_epochs
    if dist.is_initialized():
        t = torch.tensor(p, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        p = t.item()
    return p


def row_length(args, model):
    """T, the tokens of every packed row: --max-seq-len, at most the model's context (default: all of it)."""
    T = args.max_seq_len or model.config.sequence_len
    if T > model.config.sequence_len:
        raise SystemExit(f"--max-seq-len {T} exceeds the model's context {model.config.sequence_len}")
    return T


def make_optimizer(model, args, lora_base):
    """--lora-rank: AdamW on the adapters alone; else Muon and AdamW at the base model's LRs times --init-lr-frac."""
    if lora_base:
        return lora.build_lora_optimizer(model, args.lora_lr, args.weight_decay)
    return build_optimizer(
        model,
        matrix_lr=args.matrix_lr,
        embedding_lr=args.embedding_lr,
        unembedding_lr=args.unembedding_lr,
        weight_decay=args.weight_decay,
        lr_scale=args.init_lr_frac,
    )


def make_loaders(args, train_task, val_task, tokenizer, T, rank, world_size, device):
    """-> (the endless shuffled training loader, a function that makes a fresh held-out loader for each eval)."""
    B = args.device_batch_size
    loader = SFTLoader(train_task, tokenizer, B, T, rank, world_size, seed=args.seed, device=device)
    # pool_size=1 packs in order: best-fit would put the longest conversations first, and an eval that stops after
    # eval_batches would then measure a length-biased subset
    val_loader = partial(
        SFTLoader, val_task, tokenizer, B, T, rank, world_size, shuffle=False, epochs=1, pool_size=1, device=device
    )
    return loader, val_loader


def checkpointer(args, stage, meta, model, optimizer, lora_base, rank, world_size):
    """-> (this run's checkpoint folder, checkpoint(step, loader state) that saves there). Under --fsdp every rank
    writes its shards; `python -m nanorl.fsdp consolidate` joins them."""
    output_tag = args.output_tag or meta.get("model_tag") or args.model_tag or "d"
    ckpt_dir = os.path.join(get_base_dir(), f"{stage}_checkpoints", output_tag)

    def checkpoint(step, loader_state):
        ck_meta = {**meta, "model_tag": output_tag, "step": step, "stage": stage, f"{stage}_args": vars(args)}
        ck_meta["world_size"] = world_size  # (not the source model's)
        if lora_base:  # the adapters alone, and where their base is
            ck_meta["lora"] = lora.checkpoint_meta(model, lora_base)
        save(ckpt_dir, step, model, optimizer, ck_meta, {"loader": loader_state}, rank, args.keep_last)

    return ckpt_dir, checkpoint


@dataclass
class Plan:
    """How the stage's tokens are laid out: this rank of world_size, rows of T tokens, `total` tokens per optimizer
    step in grad_accum micro-batches per rank."""

    rank: int
    world_size: int
    T: int
    total: int
    grad_accum: int


def train(args, stage, hub_mixture, offline_mixture):
    """Midtraining or SFT (stage "mid" or "sft") on the stage's mixture (build_data: --data picks hub_mixture or
    offline_mixture, the same on every rank); every rank calls it. -> {"step", "val_losses", "checkpoint_dir", "stats"}"""
    # CPU offload steps the optimizer on CPU tensors: those collectives need gloo beside NCCL
    _, rank, _, world_size, device = compute_init(args.device_type, seed=args.seed, cpu_collectives=args.cpu_offload)
    train_task, val_task, data_desc = build_data(args, hub_mixture, offline_mixture)
    # before the model: a wandb run that cannot log stops here, not after minutes of loading
    master = rank == 0
    logger = get_logger(
        args.run, project=f"nanorl-{stage}", config=vars(args), master_process=master, tensorboard_dir=args.tensorboard
    )
    autocast = autocast_ctx(device.type)
    model, tokenizer, meta = load_model_from_args(args, device, phase="train")
    lora_base = lora.setup(args, model, meta)  # --lora-rank: a frozen base and trained adapters (nanorl/lora.py)
    T = row_length(args, model)
    print0(
        f"{stage}: {len(train_task):,} training / {len(val_task):,} held-out conversations ({data_desc}), "
        f"{world_size} rank(s) on {device}, rows of {T} tokens"
    )
    compiled = shard_and_compile(model, args, device, world_size)
    optimizer = make_optimizer(model, args, lora_base)
    args.device_batch_size = fit_rows(args, compiled, model, optimizer, autocast, T, world_size, device)
    plan = Plan(rank, world_size, T, *batch_plan(args.device_batch_size, args.total_batch_size, T, world_size))
    loader, val_loader = make_loaders(args, train_task, val_task, tokenizer, T, rank, world_size, device)
    eval_batches = max(1, args.eval_tokens // (plan.total // plan.grad_accum))
    ckpt_dir, checkpoint = checkpointer(args, stage, meta, model, optimizer, lora_base, rank, world_size)

    step = 0
    if args.resume:  # model and optimizer (or their shards), this rank's data position beside them
        step, _, extra = resume(ckpt_dir, model, optimizer, rank, world_size)
        loader.load_state_dict(extra["loader"])
        print0(f"resumed from {ckpt_dir} step {step} (epoch {loader.epoch}, {loader.cursor} conversations in)")

    val_losses, t0, train_time, smooth = [], time.time(), 0.0, None
    # the loader runs one step ahead (below): `consumed` is its position after the steps done so far, what a checkpoint
    # resumes from and what the LR schedule reads; `batches` are the next step's rows, already packed
    consumed = loader.state_dict()
    batches = [loader.next_batch() for _ in range(plan.grad_accum)]  # an endless loader never returns None
    progress = agreed_progress(step, loader.progress_at(consumed), args, device)
    eta = ETA(progress)
    while True:
        last_step = progress >= 1.0
        if step % args.eval_every == 0 or last_step:
            vl = eval_loss(model, val_loader(), eval_batches, autocast, device)
            val_losses.append((step, vl))
            print0(f"step {step:5d} | val loss {vl:.4f}")
            logger.log({"step": step, "val/loss": vl})
        if last_step:
            break
        lrm = lr_multiplier(progress, args.warmdown_ratio)
        for g in optimizer.param_groups:
            g["lr"] = g["initial_lr"] * lrm
        t_step = time.time()
        loss = train_step(compiled, optimizer, batches, autocast, world_size)
        step += 1
        # pack the next step's rows on the host while the device still works through this one, as base_train does
        consumed = loader.state_dict()
        batches = [loader.next_batch() for _ in range(plan.grad_accum)]
        step_loss = loss.item()  # the step's one wait for the device
        dt = time.time() - t_step
        train_time += dt
        smooth = step_loss if smooth is None else 0.9 * smooth + 0.1 * step_loss
        # after the step: what the ETA and the stop rule see
        progress = agreed_progress(step, loader.progress_at(consumed), args, device)
        eta.step(dt, progress)
        if step % 10 == 0 or step == 1:
            print0(
                f"step {step:5d} | loss {step_loss:.4f} (ema {smooth:.4f}) | lrm {lrm:.3f} "
                f"| progress {progress:.3f} | {dt * 1000:.0f} ms | padding {padding_fraction(consumed):.1%} "
                f"| eta {eta}"
            )
        logger.log({"step": step, "train/loss": step_loss, "train/lrm": lrm, "train/progress": progress})
        if args.save_every > 0 and step % args.save_every == 0 and not progress >= 1.0:
            checkpoint(step, consumed)  # (the last step is saved below, once)
    checkpoint(step, consumed)
    times = (train_time, time.time() - t0)
    report(args, stage, meta, data_desc, train_task, val_task, consumed, plan, step, times, val_losses, ckpt_dir)
    logger.finish()
    compute_cleanup()
    return {"step": step, "val_losses": val_losses, "checkpoint_dir": ckpt_dir, "stats": consumed["stats"]}


def report(args, stage, meta, data_desc, train_task, val_task, consumed, plan, step, times, val_losses, ckpt_dir):
    """The closing line and the stage's report section; consumed is the loader's state after the last step, times is
    (train time, wall time) in seconds."""
    s, (train_time, wall_time) = consumed["stats"], times
    print0(
        f"done: {step} steps in {train_time:.0f}s, final val loss {val_losses[-1][1]:.4f}, "
        f"padding {padding_fraction(consumed):.1%}, truncated {s['truncated']} of {s['conversations']} "
        f"conversations; saved to {ckpt_dir}"
    )
    log_section(
        {"mid": "Midtraining", "sft": "Chat SFT"}[stage],
        [
            {
                "source": f"{args.source} ({meta.get('model_tag', args.model_tag)})",
                "data": data_desc,
                "train conversations": len(train_task),
                "held-out conversations": len(val_task),
                "ranks": plan.world_size,
                "row length": plan.T,
                "tokens per step": plan.total,
                "grad accumulation": plan.grad_accum,
                "init lr frac": args.init_lr_frac,
            },
            {
                "steps": step,
                "data seen": data_seen(s["conversations"] - len(consumed["pool"]), len(train_task), plan.world_size),
                "train time (s)": round(train_time, 1),
                "wall time (s)": round(wall_time, 1),
                "val loss (start)": val_losses[0][1],
                "val loss (end)": val_losses[-1][1],
                "padding fraction (rank 0)": padding_fraction(consumed),
                "truncated conversations (rank 0)": f"{s['truncated']} of {s['conversations']}",
                "conversations with nothing to train on (rank 0)": s["no_target"],
            },
        ],
        rank=plan.rank,
        config=vars(args),
    )
    log_json(
        f"{stage}_val_loss", {"step": [st for st, _ in val_losses], "loss": [v for _, v in val_losses]}, rank=plan.rank
    )


# -----------------------------------------------------------------------------------------------
# SFT's data: a small, clean mixture


def mixture(args, tasks, identity_copies=1):
    """A stage's training mixture: tasks and, with --identity-path, its conversations listed identity_copies times,
    shuffled with --seed."""
    identity = [CustomJSON(path=args.identity_path)] * identity_copies if args.identity_path else []
    return TaskMixture(tasks + identity, seed=args.seed)


def offline_val(args):
    """The held-out offline conversations SFT and midtraining both measure their loss on."""
    return TaskMixture(
        [OfflineProblems("test", n=300, levels=levels(args)), OfflineChat("test", n=200)], seed=args.seed
    )


def offline_mixture(args):
    n = args.num_examples
    train = mixture(
        args,
        [
            OfflineChat("train", n=n // 2),
            OfflineProblems("train", n=n, seed=2, levels=levels(args)),
            SpellingBee("train", size=n // 10),
        ],
    )
    return train, offline_val(args)


def hub_mixture(args, paths):
    # nanochat's SFT mixture (~23K conversations), plus the offline problems
    train = mixture(
        args,
        [
            ARC("ARC-Easy", "train", path=paths.get("arc-easy")),
            ARC("ARC-Challenge", "train", path=paths.get("arc-challenge")),
            GSM8K("train", path=paths.get("gsm8k")),
            SmolTalk("train", path=paths.get("smoltalk"), stop=10_000),
            SpellingBee("train", size=600),
            OfflineProblems("train", n=min(args.num_examples, 5000), seed=2),
        ],
    )
    val = TaskMixture(
        [SmolTalk("test", path=paths.get("smoltalk"), stop=2000), GSM8K("test", path=paths.get("gsm8k"), stop=500)],
        seed=args.seed,
    )
    return train, val


def main():
    parser = ArgumentParser(description="Supervised fine-tuning on packed conversations", aliases=SLIME_NAMES)
    add_train_args(parser, "sft", source="mid", init_lr_frac=0.02, warmdown_ratio=1.0, num_epochs=1)
    args = parser.parse_args()
    fsdp.check_args(args, "chat_sft")
    lora.check_args(args, parser)
    train(args, "sft", hub_mixture, offline_mixture)


if __name__ == "__main__":
    main()
