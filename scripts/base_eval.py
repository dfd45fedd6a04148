"""
Evaluate a base checkpoint: bits per byte on the train and val text, a few greedy samples, and the CORE
metric (22 in-context tasks of the DCLM eval bundle; see nanorl/core_eval.py).

    python -m scripts.base_eval                                   # the newest base checkpoint, everything
    python -m scripts.base_eval --eval bpb,sample                 # no CORE (offline, or just quick)
    python -m scripts.base_eval --max-per-task 100 --bundle-dir /data/eval_bundle
    torchrun --standalone --nproc_per_node=8 -m scripts.base_eval -- --model-tag d20
"""

import time

from nanorl import mirror
from nanorl.common import compute_cleanup, compute_init, skipped_on_any_rank
from nanorl.core_eval import EVAL_BUNDLE_URL, evaluate_core, get_bundle, load_tasks
from nanorl.dataloader import PretrainLoader
from nanorl.dataset import describe_source
from nanorl.engine import Engine, Request
from nanorl.flags import ArgumentParser, int_or_off, positive_int
from nanorl.logger import print0
from nanorl.loss_eval import evaluate_bpb
from nanorl.model_loading import add_model_args, load_model_from_args
from nanorl.precision import autocast_ctx
from nanorl.report import log_section, record_metrics
from nanorl.tokenizer import get_token_bytes

# fmt: off
parser = ArgumentParser(description="Evaluate a base model: bpb, samples, CORE")
parser.add_argument("--eval", default="core,bpb,sample", help="comma-separated: core, bpb, sample")
add_model_args(parser, source=None, hf_model=False)  # base checkpoints only: --model-tag, --model-step
parser.add_argument("--device-batch-size", type=positive_int, default=32, help="rows per bpb forward")
parser.add_argument("--split-tokens", type=positive_int, default=20 * 524288, help="tokens of each split for bpb")
parser.add_argument("--data-dir", default=None, help="text for bpb (default: what the checkpoint was trained on)")
parser.add_argument("--max-per-task", type=int_or_off, default=-1, help="examples per CORE task (0 or -1 = all)")
parser.add_argument("--bundle-dir", default=None, help="an unzipped eval_bundle (default: <base>/eval_bundle, downloaded once)")
parser.add_argument("--bundle-url", default=mirror.url_for(mirror.BUNDLE, EVAL_BUNDLE_URL), help="where eval_bundle.zip is downloaded from (default: NANORL_MIRROR's when set)")
parser.add_argument("--device-type", default=None, choices=["cuda", "cpu", "mps"], help="default: autodetect")
args = parser.parse_args()
# fmt: on
modes = {m.strip() for m in args.eval.split(",") if m.strip()}
if not modes or modes - {"core", "bpb", "sample"}:
    parser.error(f"--eval {args.eval!r}: pick from core, bpb, sample")

ddp, rank, local_rank, world_size, device = compute_init(args.device_type)
master = rank == 0
model, tokenizer, meta = load_model_from_args(args, device, phase="eval", source="base")
seq_len = meta["model_config"]["sequence_len"]
autocast = autocast_ctx(device.type)
name = f"{meta['model_tag']} step {meta.get('step')}"
print0(f"evaluating base model {name}: {model.num_params():,} params, context {seq_len}")
t0 = time.time()
summary = {"model": name}
items = []

# --- bits per byte: the loss in a unit that does not depend on the tokenizer ---
if "bpb" in modes:
    data_dir = args.data_dir or meta.get("train_args", {}).get("data_dir")
    token_bytes = get_token_bytes(tokenizer, device)
    tokens_per_step = args.device_batch_size * seq_len * world_size
    steps = max(1, args.split_tokens // tokens_per_step)
    print0(f"bpb over {steps} x {tokens_per_step:,} tokens per split of {describe_source(data_dir)}")
    for split in ("train", "val"):
        loader = PretrainLoader(tokenizer, args.device_batch_size, seq_len, split, data_dir, device, rank, world_size)
        with autocast:
            bpb = evaluate_bpb(model, loader, steps, token_bytes)
        summary[f"{split} bpb"] = bpb
        print0(f"{split} bpb: {bpb:.4f}")

# --- a few greedy samples: a quick look at what the model has learned ---
if "sample" in modes and master:
    prompts = [
        "The capital of France is",
        "The chemical symbol of gold is",
        "If yesterday was Friday, then tomorrow will be",
        "The opposite of hot is",
        "Alice has 3 apples and",
        "The word banana is spelled",
    ]
    engine = Engine(model, tokenizer, batch_size=len(prompts), max_len=seq_len)
    new = min(24, seq_len // 2)
    requests = [
        Request(
            tokenizer.encode(p, prepend="<|bos|>")[-(seq_len - new) :],
            max_tokens=new,
            temperature=0.0,
            stop_tokens=[tokenizer.get_bos_token_id()],
            use_tools=False,
        )
        for p in prompts
    ]
    with autocast:
        groups = engine.submit_and_wait(requests)
    samples = {p: p + tokenizer.decode(g[0].tokens) for p, g in zip(prompts, groups)}
    for s in samples.values():
        print0(f"  sample: {s!r}")
    items.append("Samples (greedy):\n\n" + "\n".join(f"- `{s!r}`" for s in samples.values()))

# --- CORE ---
core = None
if "core" in modes:
    try:
        bundle, why = get_bundle(args.bundle_dir, args.bundle_url), None
    except (OSError, RuntimeError) as e:
        bundle, why = None, str(e)
        print0(
            f"CORE skipped: no eval bundle ({e}). Pass --bundle-dir DIR (an unzipped eval_bundle) to run it offline."
        )
    # each CORE task ends in an all-reduce: every rank runs CORE or none does (a rank that has no bundle says so)
    if "CORE" in skipped_on_any_rank({"CORE": why} if why else {}):
        bundle, summary["CORE"] = None, "skipped (no eval bundle)"
    if bundle is not None:
        tasks = load_tasks(bundle)
        print0(
            f"CORE: {len(tasks)} tasks from {bundle}"
            + (f", at most {args.max_per_task} examples each" if args.max_per_task > 0 else "")
        )
        with autocast:
            core = evaluate_core(model, tokenizer, tasks, device, seq_len, args.max_per_task, log=print0)
        summary["CORE"] = core["core"]
        print0(f"CORE: {core['core']:.4f}")
        items.append({f"{label} (centered)": v for label, v in core["centered"].items()})
else:
    summary["CORE"] = f"not run (--eval {args.eval})"

summary["eval time s"] = round(time.time() - t0, 1)
log_section("Base model evaluation", [summary, *items], rank=rank, config=vars(args))
# card rows name what they measured: base_train's val bpb row is the minimum during training, this one the final model's
metrics = {}
if "bpb" in modes:
    metrics[f"val bpb (final model, {steps * tokens_per_step} tokens)"] = summary["val bpb"]
if core:
    per_task = f", at most {args.max_per_task} examples each" if args.max_per_task > 0 else ""
    metrics[f"CORE ({len(tasks)} tasks{per_task})"] = core["core"]
record_metrics("BASE", metrics, rank=rank)
compute_cleanup()
