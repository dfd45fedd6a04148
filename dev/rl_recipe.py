"""
Experiments on the tiny speedrun's RL stage (dev/LOG.md, "RL recipe"): run chat_rl from the speedrun's SFT checkpoint
into an experiment folder of its own, evaluate the result like the card does, and compare per problem.

    # one RL run: the speedrun's RL flags, a seed, any extra chat_rl flags after --
    python dev/rl_recipe.py rl --base ~/.cache/nanorl/tiny --name lr02_s7 --seed 7 -- --lr-scale 0.02
    # the card's evals of a checkpoint (200 greedy, 200 x 4 at T=1), per problem, into <exp>/card_eval.json
    python dev/rl_recipe.py eval --base ~/.cache/nanorl/tiny --name lr02_s7          # --name sft: the SFT checkpoint
    # greedy on level 3,4 training problems: 200 the RL run of --seed was dealt, and 200 it was not
    python dev/rl_recipe.py seen --base ~/.cache/nanorl/tiny --name lr02_s7 --seed 7
    # right->wrong / wrong->right against another evaluation (default: the SFT checkpoint's)
    python dev/rl_recipe.py flips --base ~/.cache/nanorl/tiny lr02_s7 [other]
    # per-step entropy / reward / response length of a run, and a table of every evaluated run
    python dev/rl_recipe.py curves --base ~/.cache/nanorl/tiny lr02_s7
    python dev/rl_recipe.py table --base ~/.cache/nanorl/tiny

Each experiment lives in <base>/rl_exp/<name>: a NANORL_BASE_DIR whose tokenizer and SFT checkpoints are links to
<base>'s, so runs never overwrite each other's checkpoints, RL history or report. Run with OMP_NUM_THREADS=1.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the speedrun's RL stage (speedrun.sh, tiny branch) and its card evals (eval_rl, eval_rl_sampled)
SPEEDRUN_RL = [
    "--levels",
    "3,4",
    "--advantage-estimator",
    "rloo",
    "--num-rollouts",
    "24",
    "--rollout-batch-size",
    "16",
    "--n-samples-per-prompt",
    "8",
    "--max-new-tokens",
    "128",
    "--eval-every",
    "24",
    "--eval-max-problems",
    "64",
    "--n-samples-per-eval-prompt",
    "4",
    "--save-every",
    "8",
    "--run",
    "dummy",
]
# the prompts the speedrun's RL stage is dealt: its rollouts x its prompts per rollout
DEALT = int(SPEEDRUN_RL[SPEEDRUN_RL.index("--num-rollouts") + 1]) * int(
    SPEEDRUN_RL[SPEEDRUN_RL.index("--rollout-batch-size") + 1]
)
CARD = {
    "problems": 200,
    "max_tokens": 128,
    "levels": (1, 2),
    "hard_levels": (3, 4),
    "samples": 4,
    "temperature": 1.0,
    "seed": 0,
    "batch": 64,
}


def exp_dir(base, name):
    return os.path.join(base, "rl_exp", name)


def make_exp(base, name):
    d = exp_dir(base, name)
    os.makedirs(d, exist_ok=True)
    for sub in ("tokenizer", "sft_checkpoints"):
        link = os.path.join(d, sub)
        if not os.path.lexists(link):
            os.symlink(os.path.join(os.path.abspath(base), sub), link)
    return d


def cmd_rl(a, extra):
    d = make_exp(a.base, a.name)
    cmd = [sys.executable, "-m", "scripts.chat_rl", *SPEEDRUN_RL, "--seed", str(a.seed), "--output-tag", "exp", *extra]
    env = {**os.environ, "NANORL_BASE_DIR": d, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    t0 = time.time()
    with open(os.path.join(d, "rl.log"), "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        rc = subprocess.call(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    wall = time.time() - t0
    with open(os.path.join(d, "run.json"), "w") as f:
        json.dump({"seed": a.seed, "extra": extra, "rc": rc, "wall_s": round(wall, 1)}, f)
    print(f"{a.name}: chat_rl rc {rc} in {wall:.0f}s ({d}/rl.log)")
    if rc == 0 and a.eval:
        cmd_eval(a)
    return rc


def load_engine(a):
    """The checkpoint of run a.name in an Engine of the card's batch -> (engine, tokenizer, its metadata)."""
    os.environ["NANORL_BASE_DIR"] = a.base if a.name in ("sft", "card") else exp_dir(a.base, a.name)
    sys.path.insert(0, ROOT)
    from nanorl.common import compute_init
    from nanorl.engine import Engine
    from nanorl.model_loading import load_model

    _, _, _, _, device = compute_init("cpu")
    # sft: the SFT checkpoint itself; card: the RL checkpoint the speedrun wrote (its newest tag); else an experiment
    source, tag = {"sft": ("sft", None), "card": ("rl", None)}.get(a.name, ("rl", "exp"))
    model, tokenizer, meta = load_model(source, device, phase="eval", model_tag=tag, step=a.step)
    return Engine(model, tokenizer, batch_size=CARD["batch"]), tokenizer, meta


def cmd_eval(a):
    """The card's two evals of one checkpoint, per problem: exactly chat_eval's calls (engine batch, seeds)."""
    engine, tokenizer, meta = load_engine(a)
    from nanorl.rl import pass_at_k
    from scripts.chat_eval import run_generative
    from tasks import get_task

    task = get_task("offline", "test", levels=CARD["levels"])
    idx = list(range(min(len(task), CARD["problems"])))
    t0 = time.time()
    greedy, _ = run_generative(engine, tokenizer, task, idx, 1, CARD["max_tokens"], 0.0, None, CARD["seed"])
    hard = get_task("offline", "test", levels=CARD["hard_levels"])  # the card's levels 3,4 row: RL's room to improve
    hard_idx = list(range(min(len(hard), CARD["problems"])))
    greedy34, _ = run_generative(engine, tokenizer, hard, hard_idx, 1, CARD["max_tokens"], 0.0, None, CARD["seed"])
    sampled, texts = run_generative(
        engine, tokenizer, task, idx, CARD["samples"], CARD["max_tokens"], CARD["temperature"], None, CARD["seed"]
    )
    n = CARD["samples"]
    out = {
        "step": meta.get("step"),
        "greedy": [c or 0 for c in greedy],
        "sampled": [c or 0 for c in sampled],
        "accuracy": sum(c or 0 for c in greedy) / len(idx),
        "greedy34": [c or 0 for c in greedy34],
        "accuracy34": sum(c or 0 for c in greedy34) / len(hard_idx),
        "pass@1": sum(pass_at_k(n, c or 0, 1) for c in sampled) / len(idx),
        "pass@4": sum(pass_at_k(n, c or 0, 4) for c in sampled) / len(idx),
        "mean_response_chars": sum(len(t) for ts in texts for t in ts) / max(1, sum(len(ts) for ts in texts)),
        "eval_s": round(time.time() - t0, 1),
    }
    path = os.path.join(exp_dir(a.base, a.name), "card_eval.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f)
    print(
        f"{a.name}: greedy {out['accuracy']:.4f} | pass@1 {out['pass@1']:.4f} | pass@4 {out['pass@4']:.4f} "
        f"| levels 3,4 greedy {out['accuracy34']:.4f} "
        f"({out['eval_s']}s)"
    )


def cmd_seen(a):
    """Greedy accuracy (the card's decode) on level 3,4 TRAINING problems: the first 200 an RL run of --seed was dealt
    (its prompt order; --dealt, by default the speedrun's rollouts x prompts) and the 200 after those -> printed."""
    engine, tokenizer, _ = load_engine(a)
    from nanorl.prompts import PromptSource
    from scripts.chat_eval import run_generative
    from tasks import get_task

    task = get_task("offline", "train", levels=CARD["hard_levels"])
    order, _ = PromptSource(list(range(len(task))), seed=a.seed).get(a.dealt + CARD["problems"])
    for which, idx in (("seen", order[: CARD["problems"]]), ("unseen", order[a.dealt :])):
        right, _ = run_generative(engine, tokenizer, task, idx, 1, CARD["max_tokens"], 0.0, None, CARD["seed"])
        accuracy = sum(c or 0 for c in right) / len(idx)
        print(f"{a.name}: greedy on {len(idx)} {which} training problems of seed {a.seed}: {accuracy:.4f}")


def load_eval(base, name):
    with open(os.path.join(exp_dir(base, name), "card_eval.json")) as f:
        return json.load(f)


def flips(before, after):
    """Per problem: greedy right->wrong / wrong->right, and the sampled count of correct answers (of 4) going down
    / up, and the problems whose greedy answer was right but fewer than half the samples were."""
    g0, g1, s0, s1 = before["greedy"], after["greedy"], before["sampled"], after["sampled"]
    return {
        "greedy right->wrong": sum(a and not b for a, b in zip(g0, g1)),
        "greedy wrong->right": sum(b and not a for a, b in zip(g0, g1)),
        "sampled count down": sum(b < a for a, b in zip(s0, s1)),
        "sampled count up": sum(b > a for a, b in zip(s0, s1)),
        "sampled 0->some": sum(a == 0 and b > 0 for a, b in zip(s0, s1)),
        "sampled some->0": sum(a > 0 and b == 0 for a, b in zip(s0, s1)),
        "greedy right, sampled <= 1/4 (after)": sum(g and s <= 1 for g, s in zip(g1, s1)),
        # where the flips sit: by how many of the 4 samples were right before (a fragile greedy answer has few)
        "greedy right->wrong by sampled-right-before 0..4": [
            sum(a and not b and c == k for a, b, c in zip(g0, g1, s0)) for k in range(5)
        ],
        "greedy wrong->right by sampled-right-before 0..4": [
            sum(b and not a and c == k for a, b, c in zip(g0, g1, s0)) for k in range(5)
        ],
    }


def cmd_flips(a):
    before, after = load_eval(a.base, a.other), load_eval(a.base, a.name)
    for k, v in flips(before, after).items():
        print(f"{k}: {v}")


def cmd_curves(a):
    with open(os.path.join(exp_dir(a.base, a.name), "report", "rl_history.json")) as f:
        h = json.load(f)
    print("step | reward | entropy | len | pg | gnorm")
    for m in h["train"]:
        print(
            f"{m['step']} | {m['rollout/reward_mean']:.3f} | {m['train/entropy']:.3f} | "
            f"{m['rollout/response_len_mean']:.1f} | {m['train/pg_loss']:+.4f} | {m['train/grad_norm']:.3f}"
        )
    for e in h["eval"]:
        print("eval", e)


def standard_errors(e):
    """(greedy, pass@1, pass@4) standard errors over the problems: a binomial one for greedy accuracy and pass@4
    (one 0/1 outcome per problem; pass@4 from 4 samples is exactly "any of the 4 right"), and for pass@1 the spread
    of each problem's fraction of right samples (its 4 samples are not independent draws across problems)."""
    n, k = len(e["greedy"]), CARD["samples"]
    fractions = [c / k for c in e["sampled"]]
    mean = sum(fractions) / n
    var = sum((f - mean) ** 2 for f in fractions) / (n - 1)
    return (
        math.sqrt(e["accuracy"] * (1 - e["accuracy"]) / n),
        math.sqrt(var / n),
        math.sqrt(e["pass@4"] * (1 - e["pass@4"]) / n),
    )


def cmd_table(a):
    root = os.path.join(a.base, "rl_exp")
    sft = load_eval(a.base, "sft")
    print("| run | seed | extra flags | greedy | pass@1 | pass@4 | levels 3,4 greedy | greedy r->w / w->r | RL wall |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in sorted(os.listdir(root)):
        p = os.path.join(root, name, "card_eval.json")
        if not os.path.exists(p):
            continue
        e = load_eval(a.base, name)
        run = {}
        if os.path.exists(os.path.join(root, name, "run.json")):
            with open(os.path.join(root, name, "run.json")) as f:
                run = json.load(f)
        f, (sg, s1, s4) = flips(sft, e), standard_errors(e)
        print(
            f"| {name} | {run.get('seed', '')} | {' '.join(run.get('extra', []))} | {e['accuracy']:.3f} ± {sg:.3f} "
            f"({e['accuracy'] - sft['accuracy']:+.3f}) | {e['pass@1']:.3f} ± {s1:.3f} "
            f"({e['pass@1'] - sft['pass@1']:+.3f}) | {e['pass@4']:.3f} ± {s4:.3f} ({e['pass@4'] - sft['pass@4']:+.3f}) "
            f"| {e.get('accuracy34', float('nan')):.3f} ({e.get('accuracy34', 0) - sft.get('accuracy34', 0):+.3f}) "
            f"| {f['greedy right->wrong']} / {f['greedy wrong->right']} | {run.get('wall_s', '')} |"
        )


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    p.add_argument("command", choices=["rl", "eval", "seen", "flips", "curves", "table"])
    p.add_argument("names", nargs="*", help="flips: the run, then the one to compare with (default sft); curves: a run")
    p.add_argument(
        "--base",
        default=os.path.join(os.environ.get("NANORL_BASE_DIR") or os.path.expanduser("~/.cache/nanorl"), "tiny"),
        help="the tiny speedrun's directory, NANORL_BASE_DIR/tiny (its tokenizer and SFT checkpoint)",
    )
    p.add_argument("--name", default=None, help="the experiment's name (rl, eval)")
    p.add_argument("--seed", type=int, default=42, help="rl: chat_rl's --seed; seen: the run's seed")
    p.add_argument("--step", type=int, default=None, help="eval, seen: the checkpoint step (default: the last)")
    p.add_argument("--dealt", type=int, default=DEALT, help="seen: how many prompts the RL run was dealt")
    p.add_argument("--no-eval", dest="eval", action="store_false", help="rl: skip the card's evals after the run")
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    a = p.parse_intermixed_args(argv[: argv.index("--")] if "--" in argv else argv)
    if a.command in ("flips", "curves"):
        a.name = a.names[0] if a.names else None
        a.other = a.names[1] if len(a.names) > 1 else "sft"
    if a.command in ("rl", "eval", "seen", "flips", "curves") and not a.name:
        p.error(f"{a.command} needs a run name")
    return {
        "rl": lambda: cmd_rl(a, extra),
        "eval": lambda: cmd_eval(a),
        "seen": lambda: cmd_seen(a),
        "flips": lambda: cmd_flips(a),
        "curves": lambda: cmd_curves(a),
        "table": lambda: cmd_table(a),
    }[a.command]()


if __name__ == "__main__":
    sys.exit(main() or 0)
