"""
Fixed-seed chat_rl runs on tiny random-weight models, one per feature, reduced to what a change that only moves code
must leave bit-identical: every step's metrics (times and speeds left out), every eval, and hashes of the final
weights, optimizer state and extra state (prompt position, buffer, RNGs) of the last checkpoint.

    python dev/rl_fingerprint.py record before.json                    # all runs: a few minutes on 2 CPU cores
    python dev/rl_fingerprint.py record after.json --only grpo,async
    python dev/rl_fingerprint.py compare before.json after.json        # exit 1 unless identical, naming what differs

The models are tests/test_chat_rl.py's (a 1-layer GPT, a teacher, a tool-calling bigram model); --base-dir keeps them
(and the tokenizer) between calls.
"""

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RM = f"{Path(__file__).resolve()}:reward"
COMMON = [
    "--source", "sft", "--model-tag", "t", "--levels", "1", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
    "--max-new-tokens", "12", "--eval-every", "2", "--eval-max-problems", "4", "--n-samples-per-eval-prompt", "2",
    "--pass-k", "1,2", "--lr-scale", "1.0", "--engine-batch-size", "16", "--device-type", "cpu", "--seed", "7",
    "--custom-rm-path", RM, "--num-rollouts", "3",
]  # fmt: skip
# name -> (ranks, flags); "resume" runs 2 steps, then resumes to 4
RUNS = {
    "grpo": (1, ["--temperature", "0.7"]),
    "rloo": (1, ["--advantage-estimator", "rloo", "--loss-aggregation", "seq_mean_token_sum_norm"]),
    "reinforce_pp": (1, ["--advantage-estimator", "reinforce_plus_plus", "--gamma", "0.99", "--kl-coef", "0.01"]),
    "reinforce_pp_baseline": (
        1,
        ["--advantage-estimator", "reinforce_plus_plus_baseline", "--use-kl-loss", "--kl-loss-coef", "0.1"],
    ),
    "gspo": (1, ["--advantage-estimator", "gspo", "--num-steps-per-rollout", "2", "--eps-clip", "3e-4"]),
    "cispo": (1, ["--advantage-estimator", "cispo", "--eps-clip-high", "0.28", "--use-tis", "--tis-mode", "icepop"]),
    "ppo": (
        1,
        ["--advantage-estimator", "ppo", "--critic-lr", "1e-3", "--lambd", "0.9", "--num-steps-per-rollout", "2"],
    ),
    "options": (
        1,
        [
            "--disable-grpo-std-normalization",
            "--eps-clip-high",
            "0.28",
            "--eps-clip-c",
            "3",
            "--num-steps-per-rollout",
            "2",
            "--entropy-coef",
            "0.01",
            "--overlong-buffer-len",
            "4",
            "--mask-truncated-samples",
            "--warmup-rollouts",
            "2",
            "--normalize-advantages",
        ],
    ),  # fmt: skip
    "tis": (1, ["--use-tis", "--tis-clip", "1.5", "--temperature", "0.9"]),
    "dynamic": (1, ["--over-sampling-batch-size", "8", "--max-sampling-rounds", "2"]),
    "opd": (1, ["--use-opd", "--opd-teacher-load", "sft:teacher", "--opd-kl-coef", "0.5"]),
    "partial": (1, ["--partial-rollout", "--over-sampling-batch-size", "8", "--use-tis", "--max-new-tokens", "24"]),
    "multiturn": (1, ["--model-tag", "tools", "--multi-turn", "--max-turns", "2", "--max-new-tokens", "24"]),
    "lora": (1, ["--lora-rank", "4", "--lora-lr", "3e-2", "--use-kl-loss", "--kl-loss-coef", "0.1"]),
    "ranks2": (2, []),
    "async": (2, ["--async", "--use-tis"]),
    "fsdp": (2, ["--fsdp", "--temperature", "0.8"]),
    "resume": (1, ["--save-every", "2", "--advantage-estimator", "ppo", "--critic-lr", "1e-3"]),
    "resume_async": (2, ["--save-every", "2", "--async", "--use-tis"]),
    "resume_partial": (
        1,
        ["--save-every", "2", "--partial-rollout", "--over-sampling-batch-size", "8", "--max-new-tokens", "24"],
    ),
}

MODELS = """
import sys; sys.path.insert(0, 'tests')
import torch
from nanorl.gpt import GPTConfig, build_model
from nanorl.tokenizer import get_tokenizer
from nanorl.checkpoint import save_checkpoint
from nanorl.model_loading import checkpoint_root
from rl_fixture_tools import tool_user_model
tok = get_tokenizer(); torch.manual_seed(0)
cfg = GPTConfig(sequence_len=256, vocab_size=tok.vocab_size, n_layer=1, n_head=1, n_kv_head=1, n_embd=32)
def save(tag, m):
    save_checkpoint(checkpoint_root('sft') + '/' + tag, 0, m.state_dict(), meta={'model_config': m.config.to_dict()})
m = build_model(cfg, 'cpu')
with torch.no_grad():
    m.lm_head.weight.normal_(0, 0.2)
save('t', m)
torch.manual_seed(1); teacher = build_model(cfg, 'cpu')
with torch.no_grad():
    teacher.lm_head.weight.normal_(0, 0.5)
save('teacher', teacher)
sp = tok.encode_special('<|python_start|>')
save('tools', tool_user_model(tok, '2+3', sp, tok.vocab_size, strength=10.0, noise=0.01))
"""


def reward(response, label, metadata):
    """Twice the share of vowels: rewards spread within a group, and some reach 0.5, so pass@k is not all zeros."""
    return 2 * sum(c in "aeiou" for c in response) / max(len(response), 1)


def build_models(base):
    env = {**os.environ, "NANORL_BASE_DIR": str(base), "OMP_NUM_THREADS": "1"}
    if not (base / "sft_checkpoints" / "tools").is_dir():
        tok = [sys.executable, "-m", "scripts.tok_train", "--vocab-size", "600", "--max-chars", "300000"]
        subprocess.run(tok, cwd=ROOT, env=env, check=True, capture_output=True)
        subprocess.run([sys.executable, "-c", MODELS], cwd=ROOT, env=env, check=True, capture_output=True)


def chat_rl(base, nproc, flags):
    env = {**os.environ, "NANORL_BASE_DIR": str(base), "OMP_NUM_THREADS": "1"}
    launch = [sys.executable]
    if nproc > 1:
        launch += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    out = subprocess.run([*launch, "-m", "scripts.chat_rl", *COMMON, *flags], cwd=ROOT, env=env, capture_output=True)
    if out.returncode != 0:
        raise SystemExit(
            f"chat_rl {' '.join(flags)} failed:\n{out.stdout.decode()[-2000:]}{out.stderr.decode()[-3000:]}"
        )
    return json.loads((base / "report" / "rl_history.json").read_text()), printed(out.stdout.decode())


def printed(stdout):
    """What the run printed about its steps and evals, and its summary, with the clock's figures masked."""
    keep, tail = [], False
    for line in stdout.splitlines():
        tail = tail or line.startswith("RL summary:")
        if line.startswith("step ") or tail:
            keep.append(re.sub(r"\| dt .*? \| eta \S+", "| dt * | eta *", line))
    return keep


def tensor_hash(obj):
    """sha256 of a (nested) state: tensors by their bytes, in sorted key order."""
    import torch

    h = hashlib.sha256()

    def walk(x):
        if torch.is_tensor(x):
            h.update(f"{x.dtype}{tuple(x.shape)}".encode())
            h.update(x.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                h.update(str(k).encode())
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        else:
            h.update(repr(x).encode())

    walk(obj)
    return h.hexdigest()[:16]


def last_checkpoint(ckpt):
    """Hashes of the last step: the weights, and every rank's optimizer and extra state (by key)."""
    import torch

    sys.path.insert(0, str(ROOT))
    from nanorl.checkpoint import find_last_step, load_checkpoint

    step = find_last_step(str(ckpt))
    if (ckpt / f"dcp_{step:06d}").is_dir():  # --fsdp: the weights consolidated into one file (optimizer: shards)
        subprocess.run(
            [sys.executable, "-m", "nanorl.fsdp", "consolidate", str(ckpt)], cwd=ROOT, check=True, capture_output=True
        )
    out = {"step": step, "weights": tensor_hash(load_checkpoint(str(ckpt), step)[0])}
    for path in sorted(ckpt.glob(f"*_{step:06d}_rank*.pt")):  # optim_<step>_rank<r>.pt, extra_<step>_rank<r>.pt
        kind, rank = path.name.split("_")[0], path.stem.split("_rank")[1]
        state = torch.load(path, weights_only=False)
        if kind == "optim":
            out[f"optim/rank{rank}"] = tensor_hash(state)
        else:
            out.update({f"extra/rank{rank}/{k}": tensor_hash(v) for k, v in state.items()})
    return out


def steady(history, lines):
    """The history and the printed lines without what depends on the clock."""
    drop = ("time/", "perf/")
    return {
        "train": [{k: v for k, v in h.items() if not k.startswith(drop)} for h in history["train"]],
        "eval": history["eval"],
        "printed": lines,
    }


def record(base, names):
    build_models(base)
    out = {}
    for name in names:
        nproc, flags = RUNS[name]
        tag = f"fp_{name}"
        t0 = time.time()
        if name.startswith("resume"):
            chat_rl(base, nproc, [*flags, "--num-rollouts", "2", "--output-tag", tag, "--overwrite"])
            hist, lines = chat_rl(base, nproc, [*flags, "--num-rollouts", "4", "--output-tag", tag, "--resume"])
        else:
            hist, lines = chat_rl(base, nproc, [*flags, "--output-tag", tag, "--overwrite"])
        out[name] = {**steady(hist, lines), "checkpoint": last_checkpoint(base / "rl_checkpoints" / tag)}
        print(
            f"{name}: {len(hist['train'])} steps, weights {out[name]['checkpoint']['weights']} ({time.time() - t0:.0f}s)"
        )
    return out


def compare(a, b):
    diffs = []
    for name in sorted(a.keys() | b.keys()):
        if name not in a or name not in b:
            diffs.append(f"{name}: only in {'the first' if name in a else 'the second'}")
            continue
        x, y = a[name], b[name]
        for k in sorted(x["checkpoint"].keys() | y["checkpoint"].keys()):
            if x["checkpoint"].get(k) != y["checkpoint"].get(k):
                diffs.append(f"{name}: final {k} differ")
        for i, (p, q) in enumerate(zip(x["printed"], y["printed"])):
            if p != q:
                diffs.append(f"{name} printed line {i}:\n  {p}\n  {q}")
        if len(x["printed"]) != len(y["printed"]):
            diffs.append(f"{name}: {len(x['printed'])} vs {len(y['printed'])} printed lines")
        for part in ("train", "eval"):
            if len(x[part]) != len(y[part]):
                diffs.append(f"{name}: {len(x[part])} vs {len(y[part])} {part} entries")
            for i, (p, q) in enumerate(zip(x[part], y[part])):
                for k in sorted(p.keys() | q.keys()):
                    if p.get(k, "missing") != q.get(k, "missing"):
                        diffs.append(f"{name} {part}[{i}] {k}: {p.get(k, 'missing')} vs {q.get(k, 'missing')}")
    return diffs


def main():
    p = argparse.ArgumentParser(
        description=__doc__.strip().split("\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="run chat_rl once per feature and write the fingerprint")
    r.add_argument("out", help="json to write")
    r.add_argument("--only", default=",".join(RUNS), help=f"comma-separated runs (default all: {', '.join(RUNS)})")
    r.add_argument("--base-dir", default=None, help="keep the tokenizer, models and runs here (default: a temp dir)")
    c = sub.add_parser("compare", help="exit 1 unless two fingerprints are identical")
    c.add_argument("a")
    c.add_argument("b")
    args = p.parse_args()
    if args.cmd == "compare":
        diffs = compare(json.loads(Path(args.a).read_text()), json.loads(Path(args.b).read_text()))
        print("\n".join(diffs[:50]) if diffs else f"identical: {args.a} and {args.b}")
        sys.exit(1 if diffs else 0)
    names = args.only.split(",")
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        p.error(f"unknown runs {unknown}: pick from {', '.join(RUNS)}")
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(args.base_dir or tmp).resolve()
        base.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record(base, names), indent=1, sort_keys=True))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
