"""
The run report: every stage writes its own section (a small markdown file under <base>/report/), and
`generate()` stitches them into report.md. Sections are written atomically, so a crash never leaves a
half-written one, and a rerun of a stage replaces only its own section.
"""
import datetime
import os

from nanorl.common import get_base_dir


def report_dir():
    d = os.path.join(get_base_dir(), "report")
    os.makedirs(d, exist_ok=True)
    return d


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def log_section(name, items, rank=0):
    """items: a list of dicts (key -> value) and/or markdown strings. Only rank 0 writes."""
    if rank != 0:
        return None
    lines = [f"## {name}", f"timestamp: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M:%S')}", ""]
    for item in items:
        if isinstance(item, dict):
            lines += [f"- {k}: {_fmt(v)}" for k, v in item.items()]
        else:
            lines.append(str(item))
        lines.append("")
    slug = name.lower().replace(" ", "-").replace("/", "-")
    path = os.path.join(report_dir(), f"{slug}.md")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("\n".join(lines))
    os.replace(tmp, path)
    return path


def _atomic_write_json(obj, path):
    import json
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=float)
    os.replace(tmp, path)


def log_json(name, obj, rank=0):
    """Raw data for plots (loss curves, RL history), next to the sections."""
    if rank == 0:
        _atomic_write_json(obj, os.path.join(report_dir(), f"{name}.json"))


def load_json(name, default=None):
    import json
    path = os.path.join(report_dir(), f"{name}.json")
    if not os.path.exists(path):
        return default
    with open(path) as f:
        return json.load(f)


def record_metrics(stage, metrics, rank=0):
    """Numbers for the report card: stage is BASE / MID / SFT / RL, metrics maps a row name to a value."""
    if rank != 0:
        return
    card = load_json("report_card", {})
    card.setdefault(stage.upper(), {}).update(metrics)
    log_json("report_card", card)


STAGES = ["BASE", "MID", "SFT", "RL"]
CARD_ROWS = ["val bpb", "CORE", "ARC-Easy", "ARC-Challenge", "MMLU", "GSM8K", "HumanEval", "ChatCORE", "offline", "spellingbee"]


def _environment():
    import platform
    import subprocess
    import torch
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return {"git commit": commit, "GPUs": f"{len(gpus)} x {gpus[0]}" if gpus else "none (CPU run)",
            "CPU": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores", "python": platform.python_version(),
            "torch": torch.__version__, "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M")}


def _plots(out_dir):
    """PNG plots referenced from the markdown; matplotlib is imported lazily and its absence is said plainly."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ["(plots skipped: matplotlib is not installed)"]
    lines = []
    base = load_json("base_train_loss")
    if base:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(base["step"], base["loss"])
        ax.set(xlabel="step", ylabel="train loss", title="Base model training loss")
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "plot_base_loss.png"), dpi=100)
        plt.close(fig)
        lines.append("![base loss](plot_base_loss.png)")
    rl = load_json("rl_history")
    if rl and rl.get("train"):
        steps = [h["step"] for h in rl["train"]]
        fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
        axes[0].plot(steps, [h["rollout/reward_mean"] for h in rl["train"]])
        axes[0].set(xlabel="rollout", ylabel="mean reward", title="RL reward")
        axes[1].plot(steps, [h["rollout/response_len_mean"] for h in rl["train"]])
        axes[1].set(xlabel="rollout", ylabel="tokens", title="Response length")
        ev = rl.get("eval", [])
        for key in sorted({k for e in ev for k in e if k.startswith("eval/pass@")}):
            axes[2].plot([e["step"] for e in ev], [e[key] for e in ev], marker="o", label=key[5:])
        axes[2].set(xlabel="rollout", ylabel="held-out", title="Eval pass@k")
        axes[2].legend()
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "plot_rl.png"), dpi=100)
        plt.close(fig)
        lines.append("![rl](plot_rl.png)")
    return lines


def generate(out_path="report.md", wall_time_s=None, gpu_hourly_usd=3.0):
    """Stitch every stage's section into report.md with the environment, the report card and the plots."""
    out_dir = os.path.dirname(os.path.abspath(out_path))
    env = _environment()
    lines = ["# nanorl report", "", "## Environment", ""] + [f"- {k}: {v}" for k, v in env.items()] + [""]
    card = load_json("report_card", {})
    rows = [r for r in CARD_ROWS if any(r in card.get(s, {}) for s in STAGES)]
    rows += sorted({r for s in card.values() for r in s} - set(rows))
    lines += ["## Report card", "", "| metric | " + " | ".join(STAGES) + " |", "|---" * (len(STAGES) + 1) + "|"]
    for r in rows:
        vals = [card.get(s, {}).get(r) for s in STAGES]
        lines.append(f"| {r} | " + " | ".join("-" if v is None else f"{v:.4f}" for v in vals) + " |")
    lines.append("")
    rl = load_json("rl_history")
    if rl and rl.get("eval"):
        first, last = rl["eval"][0], rl["eval"][-1]
        keys = sorted(k for k in first if k.startswith("eval/"))
        lines += ["## RL: held-out pass@k before and after", "", "| metric | before (step %d) | after (step %d) |" % (first["step"], last["step"]),
                  "|---|---|---|"] + [f"| {k[5:]} | {first[k]:.4f} | {last.get(k, float('nan')):.4f} |" for k in keys] + [""]
    if wall_time_s is not None:
        ngpu = int(env["GPUs"].split(" x ")[0]) if " x " in env["GPUs"] else 0
        cost = f"${ngpu * gpu_hourly_usd * wall_time_s / 3600:.2f} at ${gpu_hourly_usd}/GPU-hour" if ngpu else "$0 (CPU only)"
        lines += ["## Time and cost", "", f"- total wall time: {wall_time_s / 60:.1f} min", f"- estimated cost: {cost}", ""]
    plots = _plots(out_dir)
    if plots:
        lines += ["## Plots", ""] + plots + [""]
    order = ["tokenizer-training", "tokenizer-evaluation", "base-model-training", "base-model-evaluation", "midtraining",
             "chat-eval-mid", "chat-sft", "sft", "chat-eval-sft", "chat-rl", "chat-eval-rl"]
    files = sorted(f[:-3] for f in os.listdir(report_dir()) if f.endswith(".md"))
    for name in [o for o in order if o in files] + [f for f in files if f not in order]:
        with open(os.path.join(report_dir(), name + ".md")) as f:
            lines += [f.read().replace("\n## ", "\n### ").replace("## ", "## ", 1), ""]
    tmp = out_path + ".tmp"
    with open(tmp, "w") as f:
        f.write("\n".join(lines))
    os.replace(tmp, out_path)
    return out_path


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description="Write report.md from the stages' sections")
    parser.add_argument("--out", default="report.md")
    parser.add_argument("--wall-time", type=float, default=None, help="total wall time in seconds")
    a = parser.parse_args()
    print(f"wrote {generate(a.out, a.wall_time)}")
