"""
Conversations -> packed (B, T) training rows for midtraining and SFT, and the training loop both share.

Each conversation is rendered with its loss mask (only what the assistant wrote is trained on) and
shifted into (inputs, targets) of its own: a target is -1 wherever the mask is 0, so no document ever
predicts into the next one. Whole conversations are then packed best-fit into rows of T tokens with a
document id per token, which nanorl.gpt turns into block-diagonal attention with positions restarting
per document. Only a row's tail is padding. Too-long conversations are truncated and counted.
"""
import os
import random
import time

import torch
import torch.distributed as dist


def render_example(tokenizer, conversation, seq_len):
    """(inputs, targets, truncated): at most seq_len positions, targets -1 where the assistant did not write."""
    ids, mask = tokenizer.render_conversation(conversation)
    truncated = len(ids) > seq_len + 1
    ids, mask = ids[:seq_len + 1], mask[:seq_len + 1]
    targets = [t if m else -1 for t, m in zip(ids[1:], mask[1:])]
    return ids[:-1], targets, truncated


class SFTLoader:
    """
    Packed batches from a Task, this rank's strided share of a per-epoch shuffle. Best-fit packing: each
    row takes the longest pending conversation that still fits, from a pool of `pool_size`, so little is
    padded. epochs=None loops forever; otherwise next_batch() returns None once the data is used up.
    state_dict() holds the epoch, the cursor and the pending pool, so a resumed run sees the same rows.
    """
    def __init__(self, task, tokenizer, batch_size, seq_len, rank=0, world_size=1, seed=0, shuffle=True,
                 epochs=None, pool_size=64, device="cpu"):
        if len(task) < world_size:
            raise ValueError(f"the data has {len(task)} conversations, fewer than the {world_size} ranks")
        self.task, self.tokenizer = task, tokenizer
        self.B, self.T = batch_size, seq_len
        self.rank, self.world_size, self.seed, self.shuffle = rank, world_size, seed, shuffle
        self.epochs, self.pool_size, self.device = epochs, pool_size, device
        self.pad_id = tokenizer.get_bos_token_id()  # any real token: padded positions have target -1
        self.epoch, self.cursor, self.pool = 0, 0, []
        self.order = self._make_order()
        self.stats = dict(conversations=0, truncated=0, no_target=0, positions=0, padding=0, loss_tokens=0)

    def _make_order(self):
        order = list(range(len(self.task)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order[self.rank::self.world_size]

    def _render(self, index):
        inputs, targets, truncated = render_example(self.tokenizer, self.task.get_example(index), self.T)
        return {"index": index, "inputs": inputs, "targets": targets, "truncated": truncated}

    def _next_doc(self):
        """The next conversation with something to learn, or None when the last epoch is done."""
        skipped = 0
        while True:
            if self.cursor >= len(self.order):
                if self.epochs is not None and self.epoch + 1 >= self.epochs:
                    return None
                self.epoch, self.cursor = self.epoch + 1, 0
                self.order = self._make_order()
            doc = self._render(self.order[self.cursor])
            self.cursor += 1
            self.stats["conversations"] += 1
            self.stats["truncated"] += doc["truncated"]
            if all(t == -1 for t in doc["targets"]):
                self.stats["no_target"] += 1  # e.g. a prompt longer than the context: nothing to train on
                skipped += 1
                if skipped > len(self.order):  # a whole epoch of them: looping would never end
                    raise ValueError(f"no conversation has an assistant token within the first {self.T + 1} tokens")
                continue
            return doc

    def _fill_pool(self):
        while len(self.pool) < self.pool_size:
            doc = self._next_doc()
            if doc is None:
                return
            self.pool.append(doc)

    @property
    def progress(self):
        """Epochs done, fractional: the LR schedule and the stopping rule follow it."""
        return self.epoch + self.cursor / len(self.order)

    def next_batch(self):
        """(inputs, targets, doc_ids), each (B, T) long tensors on the device; None when the data is used up."""
        B, T = self.B, self.T
        inputs = torch.full((B, T), self.pad_id, dtype=torch.long)
        targets = torch.full((B, T), -1, dtype=torch.long)
        doc_ids = torch.zeros((B, T), dtype=torch.long)
        placed = 0
        for b in range(B):
            pos, doc_id = 0, 0
            while True:
                self._fill_pool()
                fits = [j for j, d in enumerate(self.pool) if len(d["inputs"]) <= T - pos]
                if not fits:
                    break
                doc = self.pool.pop(max(fits, key=lambda j: len(self.pool[j]["inputs"])))
                n = len(doc["inputs"])
                inputs[b, pos:pos + n] = torch.tensor(doc["inputs"])
                targets[b, pos:pos + n] = torch.tensor(doc["targets"])
                doc_ids[b, pos:pos + n] = doc_id
                pos, doc_id, placed = pos + n, doc_id + 1, placed + 1
            doc_ids[b, pos:] = doc_id  # the tail is one more "document" of padding
            self.stats["padding"] += T - pos
        if placed == 0:
            return None
        self.stats["positions"] += B * T
        self.stats["loss_tokens"] += int((targets >= 0).sum())
        return inputs.to(self.device), targets.to(self.device), doc_ids.to(self.device)

    def __iter__(self):
        while (batch := self.next_batch()) is not None:
            yield batch

    def padding_fraction(self):
        return self.stats["padding"] / max(self.stats["positions"], 1)

    def state_dict(self):
        return {"epoch": self.epoch, "cursor": self.cursor, "pool": [d["index"] for d in self.pool], "stats": dict(self.stats)}

    def load_state_dict(self, state):
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self.order = self._make_order()
        self.pool = [self._render(i) for i in state["pool"]]
        self.stats = dict(state["stats"])


# -----------------------------------------------------------------------------------------------
# the training loop shared by scripts/mid_train.py and scripts/chat_sft.py

def add_train_args(parser, stage, source, init_lr_frac, warmdown_ratio, num_epochs):
    """The flags both scripts take; `stage` is "mid" or "sft", the rest are that stage's defaults."""
    a = parser.add_argument
    a("--source", default=source, choices=["base", "mid", "sft", "rl"], help="checkpoint to start from")
    a("--model-tag", default=None, help="checkpoint subdirectory of the source (default: newest)")
    a("--model-step", type=int, default=None, help="checkpoint step of the source (default: last)")
    a("--hf-model", default=None, metavar="DIR", help="start from a Hugging Face model directory (Qwen2.5, Qwen3, Llama-3) instead of --source")
    a("--output-tag", default=None, help=f"save under {stage}_checkpoints/<tag> (default: the source's tag)")
    a("--data", default="offline", choices=["offline", "hub"],
      help="offline: the synthetic curriculum (no download); hub: the Hugging Face datasets (or --task-path files)")
    a("--task-path", action="append", default=[], metavar="NAME=PATH",
      help="a local jsonl/parquet file or directory for a Hub task, e.g. gsm8k=/data/gsm8k (repeatable)")
    a("--identity-path", default=None, help="jsonl of identity conversations (CustomJSON), mixed in twice")
    a("--num-examples", type=int, default=20000, help="offline curriculum: number of training problems")
    a("--levels", default="1,2,3,4", help="offline curriculum: difficulty levels of the problems (e.g. 1,2 to start easy)")
    a("--num-epochs", type=float, default=num_epochs, help="passes over the data (ignored with --num-iterations)")
    a("--num-iterations", type=int, default=-1, help="optimizer steps (-1: as many as --num-epochs takes)")
    a("--device-batch-size", type=int, default=16, help="rows per micro-batch per rank")
    a("--max-seq-len", type=int, default=None, help="row length T (default: the model's context)")
    a("--total-batch-size", type=int, default=None, help="tokens per optimizer step, all ranks (default: one micro-batch per rank)")
    a("--matrix-lr", type=float, default=0.02)
    a("--embedding-lr", type=float, default=0.2)
    a("--unembedding-lr", type=float, default=0.004)
    a("--weight-decay", type=float, default=0.0)
    a("--init-lr-frac", type=float, default=init_lr_frac, help="multiplier on the LRs above (the base model's LRs)")
    a("--warmdown-ratio", type=float, default=warmdown_ratio, help="fraction of training over which the LR decays to 0")
    a("--eval-every", type=int, default=100, help="eval loss every N steps (and at the start and end)")
    a("--eval-tokens", type=int, default=200_000, help="tokens of held-out conversations per eval")
    a("--save-every", type=int, default=-1, help="checkpoint every N steps (-1: only at the end)")
    a("--keep-last", type=int, default=2, help="keep only the newest N checkpoints of this run")
    a("--resume", action="store_true", help=f"continue from the latest checkpoint in {stage}_checkpoints/<tag>")
    a("--seed", type=int, default=42)
    a("--run", default="dummy", help="wandb run name ('dummy' = no wandb)")
    a("--device-type", default=None, help="cuda | cpu | mps (default: autodetect)")


def levels(args):
    return tuple(int(l) for l in args.levels.split(","))


def task_paths(args):
    out = {}
    for item in args.task_path:
        if "=" not in item:
            raise SystemExit(f"--task-path {item!r}: expected NAME=PATH, e.g. gsm8k=/data/gsm8k")
        name, path = item.split("=", 1)
        out[name.lower()] = path
    return out


def build_data(args, hub_mixture, offline_mixture):
    """(train task, val task, description). --data hub that cannot load (no network, no path) says why and
    falls back to the offline curriculum, so a run without network still does something useful."""
    if args.data == "hub":
        try:
            train, val = hub_mixture(task_paths(args))
            return train, val, "hub"
        except RuntimeError as e:
            print(f"warning: --data hub could not load its datasets:\n  {e}\nfalling back to the offline curriculum")
            train, val = offline_mixture()
            return train, val, f"offline (fallback: {str(e).splitlines()[0][:200]})"
    train, val = offline_mixture()
    return train, val, "offline"


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
    for i, (x, y, d) in enumerate(loader):
        if i >= max_batches:
            break
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
    from nanorl.checkpoint import find_last_step, load_checkpoint, load_model, save_checkpoint
    from nanorl.common import autocast_ctx, eta_min, compute_cleanup, compute_init, get_base_dir, get_logger, print0
    from nanorl.gpt import attention_backend
    from nanorl.optim import build_optimizer
    from nanorl.report import log_section

    ddp, rank, _, world_size, device = compute_init(args.device_type, seed=args.seed)
    master = rank == 0
    autocast = autocast_ctx(device.type)
    model, tokenizer, meta = load_model(args.source, device, phase="train", model_tag=args.model_tag, step=args.model_step, hf_model=args.hf_model)
    T = args.max_seq_len or model.config.sequence_len
    if T > model.config.sequence_len:
        raise SystemExit(f"--max-seq-len {T} exceeds the model's context {model.config.sequence_len}")
    train_task, val_task, data_desc = build_data(args, hub_mixture, offline_mixture)
    print0(f"{stage}: {len(train_task):,} training / {len(val_task):,} held-out conversations ({data_desc}), "
           f"{world_size} rank(s) on {device}, rows of {T} tokens")
    print0(attention_backend(device))  # packed rows: document-masked attention

    tokens_per_micro = args.device_batch_size * T * world_size
    total = args.total_batch_size or tokens_per_micro
    if total % tokens_per_micro:
        raise SystemExit(f"--total-batch-size {total} is not a multiple of device batch x T x ranks = {tokens_per_micro}")
    grad_accum = total // tokens_per_micro
    optimizer = build_optimizer(model, matrix_lr=args.matrix_lr, embedding_lr=args.embedding_lr,
                                unembedding_lr=args.unembedding_lr, weight_decay=args.weight_decay)
    for g in optimizer.param_groups:
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
        last = find_last_step(ckpt_dir)
        if last is None:
            raise SystemExit(f"--resume: no {stage} checkpoint in {ckpt_dir}")
        model_state, optim_state, _, extra = load_checkpoint(ckpt_dir, last, device=device, load_optimizer=True, rank=rank)
        model.load_state_dict(model_state)
        optimizer.load_state_dict(optim_state)
        loader.load_state_dict(extra["loader"])
        step = last
        print0(f"resumed from {ckpt_dir} step {step} (epoch {loader.epoch}, {loader.cursor} conversations in)")

    def save(step):
        save_checkpoint(ckpt_dir, step, model.state_dict(), optimizer.state_dict(),
                        meta={**meta, "model_tag": output_tag, "step": step, "stage": stage, f"{stage}_args": vars(args)},
                        extra={"loader": loader.state_dict()}, rank=rank, keep_last=args.keep_last)

    def get_progress():
        # every rank must agree on the LR and on when to stop: take the furthest rank's progress
        p = step / args.num_iterations if args.num_iterations > 0 else loader.progress / args.num_epochs
        if ddp:
            t = torch.tensor(p, dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            p = t.item()
        return p

    logger = get_logger(args.run, project=f"nanorl-{stage}", config=vars(args), master_process=master)
    val_losses, t0, train_time, smooth = [], time.time(), 0.0, None
    while True:
        progress = get_progress()
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
                loss = model(x, y, doc_ids=d, loss_reduction="sum")
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
        if step % 10 == 0 or step == 1:
            print0(f"step {step:5d} | loss {step_loss:.4f} (ema {smooth:.4f}) | lrm {lrm:.3f} | progress {progress:.3f} "
                   f"| {dt * 1000:.0f} ms | padding {loader.padding_fraction():.1%} | eta {eta_min(train_time, progress):.1f}m")
        logger.log({"step": step, "train/loss": step_loss, "train/lrm": lrm, "train/progress": progress})
        if args.save_every > 0 and step % args.save_every == 0 and not get_progress() >= 1.0:
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
