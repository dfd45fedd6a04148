"""
The training loop of midtraining and SFT: scripts/mid_train.py and scripts/chat_sft.py differ only in their
data mixture and a few defaults, so both call train() here. Load the source checkpoint, train on packed
conversations (nanorl/sft_data.py) with a token-mean loss over the whole step, evaluate the held-out loss,
save, resume, write the report section.
"""
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from nanorl import fsdp, lora
from nanorl.checkpoint import load_checkpoint, load_model, load_weights, model_path, resume_point, save_checkpoint
from nanorl.common import (ETA, add_logging_args, autocast_ctx, compute_cleanup, compute_init, fraction, get_base_dir,
                           get_logger, int_or_off, nonneg_float, nonneg_int, positive_float, positive_int, print0)
from nanorl.gpt import attention_backend
from nanorl.optim import build_optimizer
from nanorl.report import log_section
from nanorl.sft_data import SFTLoader, build_data


def add_train_args(parser, stage, source, init_lr_frac, warmdown_ratio, num_epochs):
    """The flags both scripts take; `stage` is "mid" or "sft", the rest are that stage's defaults."""
    a = parser.add_argument
    a("--source", default=source, choices=["base", "mid", "sft", "rl"], help="checkpoint to start from")
    a("--model-tag", default=None, help="checkpoint subdirectory of the source (default: newest)")
    a("--hf-model", default=None, metavar="DIR", help="start from a Hugging Face model directory (Qwen2.5, Qwen3, Llama-3) instead of --source")
    a("--model-step", "--step", type=nonneg_int, default=None, help="checkpoint step of the source (default: last)")
    a("--output-tag", default=None, help=f"save under {stage}_checkpoints/<tag> (default: the source's tag)")
    a("--data", default="offline", choices=["offline", "hub"],
      help="offline: the synthetic curriculum (no download); hub: the Hugging Face datasets (or --task-path files)")
    a("--task-path", action="append", default=[], metavar="NAME=PATH",
      help="a local jsonl/parquet file or directory for a Hub task, e.g. gsm8k=/data/gsm8k (repeatable)")
    a("--identity-path", default=None, help="jsonl of identity conversations (CustomJSON), mixed in twice")
    a("--num-examples", type=positive_int, default=20000, help="offline curriculum: number of training problems")
    a("--levels", default="1,2,3,4", help="offline curriculum: difficulty levels of the problems (e.g. 1,2 to start easy)")
    a("--num-epochs", type=positive_float, default=num_epochs, help="passes over the data (ignored with --num-iterations)")
    a("--num-iterations", type=int_or_off, default=-1, help="optimizer steps (-1: as many as --num-epochs takes)")
    a("--device-batch-size", type=positive_int, default=16, help="rows per micro-batch per rank")
    a("--max-seq-len", type=positive_int, default=None, help="row length T (default: the model's context)")
    a("--total-batch-size", type=positive_int, default=None, help="tokens per optimizer step, all ranks (default: one micro-batch per rank)")
    a("--matrix-lr", type=nonneg_float, default=0.02, help="Muon LR of the transformer's matrices")
    a("--embedding-lr", type=nonneg_float, default=0.2, help="AdamW LR of the token embedding")
    a("--unembedding-lr", type=nonneg_float, default=0.004, help="AdamW LR of the output head")
    a("--weight-decay", type=nonneg_float, default=0.0, help="AdamW weight decay")
    a("--init-lr-frac", type=nonneg_float, default=init_lr_frac, help="multiplier on the LRs above (the base model's LRs)")
    a("--warmdown-ratio", type=fraction, default=warmdown_ratio, help="fraction of training over which the LR decays to 0")
    a("--eval-every", "--eval-interval", type=positive_int, default=100, help="eval loss every N steps (and at the start and end)")
    a("--eval-tokens", type=positive_int, default=200_000, help="tokens of held-out conversations per eval")
    a("--save-every", "--save-interval", type=int_or_off, default=-1, help="checkpoint every N steps (-1: only at the end)")
    a("--keep-last", type=positive_int, default=2, help="keep only the newest N checkpoints of this run")
    a("--resume", action="store_true", help=f"continue from the latest checkpoint in {stage}_checkpoints/<tag>")
    a("--seed", type=nonneg_int, default=42, help="seed of the weights' RNG and the data order")
    add_logging_args(parser)
    a("--device-type", default=None, choices=["cuda", "cpu", "mps"], help="default: autodetect")
    a("--no-compile", action="store_true", help="train eagerly on CUDA (default: torch.compile of the model, one graph: every batch is B x T)")
    fsdp.add_args(parser)
    lora.add_args(parser)


def lr_multiplier(progress, warmdown_ratio, final_frac=0.0):
    """Constant, then a linear decay to final_frac over the last warmdown_ratio of training (1.0: decay all along)."""
    if warmdown_ratio <= 0 or progress < 1 - warmdown_ratio:
        return 1.0
    left = max(0.0, 1.0 - progress) / warmdown_ratio
    return final_frac + (1.0 - final_frac) * left


@torch.no_grad()
def eval_loss(model, loader, max_batches, autocast):
    """Token-mean loss over held-out batches, summed over every rank first."""
    model.eval()
    dev = model.lm_head.weight.device
    total, count = torch.zeros((), device=dev, dtype=torch.float64), torch.zeros((), device=dev, dtype=torch.float64)
    batches = iter(loader)
    for _ in range(max_batches):
        batch = next(batches, None)
        if isinstance(model, FSDPModule):  # each forward gathers weights with the other ranks: stop when any rank runs dry
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


def train(args, stage, hub_mixture, offline_mixture):
    """Load the source checkpoint, train on packed conversations, evaluate, save, write the report section."""
    fsdp.check_args(args, {"mid": "mid_train", "sft": "chat_sft"}[stage])
    lora.check_args(args)
    # CPU offload steps the optimizer on CPU tensors: those collectives need gloo beside NCCL
    ddp, rank, _, world_size, device = compute_init(args.device_type, seed=args.seed, cpu_collectives=args.cpu_offload)
    master = rank == 0
    # before the model: a wandb run that cannot log stops here, not after minutes of loading
    logger = get_logger(args.run, project=f"nanorl-{stage}", config=vars(args), master_process=master, tensorboard_dir=args.tensorboard)
    autocast = autocast_ctx(device.type)
    model, tokenizer, meta = load_model(args.source, device, phase="train", model_tag=args.model_tag, step=args.model_step, hf_model=args.hf_model)
    lora_base = lora.setup(args, model, meta)  # --lora-rank: a frozen base and trained adapters (nanorl/lora.py)
    T = args.max_seq_len or model.config.sequence_len
    if T > model.config.sequence_len:
        raise SystemExit(f"--max-seq-len {T} exceeds the model's context {model.config.sequence_len}")
    train_task, val_task, data_desc = build_data(args, hub_mixture, offline_mixture)
    print0(f"{stage}: {len(train_task):,} training / {len(val_task):,} held-out conversations ({data_desc}), "
           f"{world_size} rank(s) on {device}, rows of {T} tokens")
    print0(attention_backend(device))  # packed rows: document-masked attention
    if args.fsdp:  # after loading the whole model, before the optimizer: it is built on the shards
        fsdp.shard_model(model, device, args.activation_checkpointing, args.cpu_offload)
        print0(f"FSDP2 over {world_size} ranks: each holds 1/{world_size} of the parameters, gradients and optimizer state")
    # every training batch is (B, T) with T fixed: one compiled graph on CUDA (flex attention compiles with it)
    compiled = torch.compile(model, dynamic=False) if device.type == "cuda" and not args.no_compile else model

    tokens_per_micro = args.device_batch_size * T * world_size
    total = args.total_batch_size or tokens_per_micro
    if total % tokens_per_micro:
        raise SystemExit(f"--total-batch-size {total} is not a multiple of device batch x T x ranks = {tokens_per_micro}")
    grad_accum = total // tokens_per_micro
    optimizer = build_optimizer(model, matrix_lr=args.matrix_lr, embedding_lr=args.embedding_lr,
                                unembedding_lr=args.unembedding_lr, weight_decay=args.weight_decay) if not lora_base \
        else lora.build_lora_optimizer(model, args.lora_lr, args.weight_decay)
    for g in optimizer.param_groups if not lora_base else []:
        g["initial_lr"] = g["initial_lr"] * args.init_lr_frac
        g["lr"] = g["initial_lr"]
    loader = SFTLoader(train_task, tokenizer, args.device_batch_size, T, rank, world_size, seed=args.seed, device=device)

    def val_loader():
        # pool_size=1 packs in order: best-fit would put the longest conversations first, and an eval that
        # stops after eval_batches would then measure a length-biased subset
        return SFTLoader(val_task, tokenizer, args.device_batch_size, T, rank, world_size, shuffle=False, epochs=1,
                         pool_size=1, device=device)
    eval_batches = max(1, args.eval_tokens // tokens_per_micro)

    output_tag = args.output_tag or meta.get("model_tag") or args.model_tag or "d"
    ckpt_dir = os.path.join(get_base_dir(), f"{stage}_checkpoints", output_tag)
    step = 0
    if args.resume:
        last, _ = resume_point(ckpt_dir, world_size, args.fsdp)
        if args.fsdp:  # the DCP shards of model and optimizer, this rank's data position beside them
            extra = fsdp.load_sharded(ckpt_dir, last, model, optimizer, rank)
        else:
            model_state, optim_state, _, extra = load_checkpoint(ckpt_dir, last, device=device, load_optimizer=True, rank=rank)
            if lora_base:
                lora.load_lora_state_dict(model, model_state, model_path(ckpt_dir, last))
            else:
                load_weights(model, model_state, model_path(ckpt_dir, last))
            optimizer.load_state_dict(optim_state)
        loader.load_state_dict(extra["loader"])
        step = last
        print0(f"resumed from {ckpt_dir} step {step} (epoch {loader.epoch}, {loader.cursor} conversations in)")

    def save(step):
        m = {**meta, "model_tag": output_tag, "step": step, "stage": stage, f"{stage}_args": vars(args), "world_size": world_size,
             "sharded": bool(args.fsdp)}  # (not the source model's)
        if lora_base:  # the adapters alone, and where their base is
            m["lora"] = lora.checkpoint_meta(model, lora_base)
        if args.fsdp:  # every rank writes its shards; `python -m nanorl.fsdp consolidate` makes the single file
            fsdp.save_sharded(ckpt_dir, step, model, optimizer, m, {"loader": loader.state_dict()}, rank, args.keep_last)
        else:
            save_checkpoint(ckpt_dir, step, lora.trained_state(model), optimizer.state_dict(), meta=m,
                            extra={"loader": loader.state_dict()}, rank=rank, keep_last=args.keep_last)

    def get_progress():
        # every rank must agree on the LR and on when to stop: take the furthest rank's progress
        p = step / args.num_iterations if args.num_iterations > 0 else loader.progress / args.num_epochs
        if ddp:
            t = torch.tensor(p, dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            p = t.item()
        return p

    val_losses, t0, train_time, smooth = [], time.time(), 0.0, None
    progress = get_progress()
    eta = ETA(progress)
    while True:
        last_step = progress >= 1.0
        if step % args.eval_every == 0 or last_step:
            vl = eval_loss(model, val_loader(), eval_batches, autocast)
            val_losses.append((step, vl))
            print0(f"step {step:5d} | val loss {vl:.4f}")
            logger.log({"step": step, "val/loss": vl})
        if last_step:
            break
        lrm = lr_multiplier(progress, args.warmdown_ratio)
        for g in optimizer.param_groups:
            g["lr"] = g["initial_lr"] * lrm
        t_step = time.time()
        batches = [loader.next_batch() for _ in range(grad_accum)]  # an endless loader never returns None
        # token-mean over the whole step on all ranks: each micro-batch's summed loss over the global token count
        # (times world size, since the optimizer averages gradients across ranks)
        n_tok = torch.tensor(float(sum(int((y >= 0).sum()) for _, y, _ in batches)), device=device)
        if ddp:
            dist.all_reduce(n_tok)
        loss_sum = torch.zeros((), device=device)
        for x, y, d in batches:
            with autocast:
                loss = compiled(x, y, doc_ids=d, loss_reduction="sum")
            (loss * world_size / n_tok.clamp(min=1)).backward()
            loss_sum += loss.detach()
        if ddp:
            dist.all_reduce(loss_sum)  # the logged loss is the whole step's, not rank 0's share
        step_loss = (loss_sum / n_tok.clamp(min=1)).item()
        optimizer.step()
        model.zero_grad(set_to_none=True)
        step += 1
        dt = time.time() - t_step
        train_time += dt
        smooth = step_loss if smooth is None else 0.9 * smooth + 0.1 * step_loss
        progress = get_progress()  # after the step: what the ETA and the stopping rule see
        eta.step(dt, progress)
        if step % 10 == 0 or step == 1:
            print0(f"step {step:5d} | loss {step_loss:.4f} (ema {smooth:.4f}) | lrm {lrm:.3f} | progress {progress:.3f} "
                   f"| {dt * 1000:.0f} ms | padding {loader.padding_fraction():.1%} | eta {eta}")
        logger.log({"step": step, "train/loss": step_loss, "train/lrm": lrm, "train/progress": progress})
        if args.save_every > 0 and step % args.save_every == 0 and not progress >= 1.0:
            save(step)  # (the last step is saved below, once)
    save(step)

    s = loader.stats
    print0(f"done: {step} steps in {train_time:.0f}s, final val loss {val_losses[-1][1]:.4f}, padding {loader.padding_fraction():.1%}, "
           f"truncated {s['truncated']} of {s['conversations']} conversations; saved to {ckpt_dir}")
    log_section({"mid": "Midtraining", "sft": "Chat SFT"}[stage], [
        {"source": f"{args.source} ({meta.get('model_tag', args.model_tag)})", "data": data_desc,
         "train conversations": len(train_task), "held-out conversations": len(val_task), "ranks": world_size,
         "row length": T, "tokens per step": total, "grad accumulation": grad_accum, "init lr frac": args.init_lr_frac},
        {"steps": step, "train time (s)": round(train_time, 1), "wall time (s)": round(time.time() - t0, 1),
         "val loss (start)": val_losses[0][1], "val loss (end)": val_losses[-1][1],
         "padding fraction (rank 0)": loader.padding_fraction(),
         "truncated conversations (rank 0)": f"{s['truncated']} of {s['conversations']}",
         "conversations with nothing to train on (rank 0)": s["no_target"]},
    ], rank=rank, config=vars(args))
    logger.finish()
    compute_cleanup()
    return {"step": step, "val_losses": val_losses, "checkpoint_dir": ckpt_dir, "stats": s}
