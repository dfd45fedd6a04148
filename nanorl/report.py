"""
The run report: every stage writes its own section (a small markdown file under <base>/report/), and
`generate()` stitches them into report.md. Sections are written atomically, so a crash never leaves a
half-written one, and a rerun of a stage replaces only its own section.

The pipeline's report stays the pipeline's: once speedrun.sh has finished a stage (a marker in <base>/done/), a
run outside it (NANORL_PIPELINE unset) writes its section, card numbers and plot data to <base>/report/adhoc/
instead, says so, and report.md lists it under "Ad-hoc runs", apart from the card.
"""

import datetime
import os
import tempfile

from nanorl.common import get_base_dir
from nanorl.errors import BadValue
from nanorl.logger import write_json

REPORT_TITLE = "# nanorl report"  # report.md's first line: how --out knows a file it may replace


def report_dir():
    d = os.path.join(get_base_dir(), "report")
    os.makedirs(d, exist_ok=True)
    return d


def _stage_seconds():
    """{stage: seconds} from speedrun.sh's markers in <base>/done/ (each holds its stage's own run time)."""
    d = os.path.join(get_base_dir(), "done")
    out = {}
    # in the order they finished (the markers' times), i.e. pipeline order
    names = os.listdir(d) if os.path.isdir(d) else []
    for name in sorted(names, key=lambda n: (os.path.getmtime(os.path.join(d, n)), n)):
        try:
            with open(os.path.join(d, name)) as f:
                out[name] = float(f.read().strip() or 0)
        except (OSError, ValueError):  # an unreadable or hand-made marker counts as a finished stage of unknown time
            out[name] = 0.0
    return out


def is_adhoc():
    """A run outside speedrun.sh while the pipeline has finished stages here: it must not replace their sections.
    Without any finished stage there is no pipeline report to protect, and every run writes to report/ itself."""
    return os.environ.get("NANORL_PIPELINE", "") != "1" and bool(_stage_seconds())


def write_dir():
    """Where this run's sections, card numbers and plot data go: report/, or report/adhoc/ for an ad-hoc run."""
    d = os.path.join(report_dir(), "adhoc") if is_adhoc() else report_dir()
    os.makedirs(d, exist_ok=True)
    return d


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


# flags whose unset value (None) means something a reader should not have to look up
_UNSET = {
    "device_type": "autodetect (CUDA if available, else CPU)",
    "model_tag": "the tag saved most recently",
    "model_step": "the last step",
    "step": "the last step",
    "output_tag": "the source model's tag",
    "tensorboard": "off",
    "data_dir": "the default data",
    "max_seq_len": "the model's context",
    "max_new_tokens": "the task's own (offline 128, others 256)",
}


def config_value(key, value, config):
    """A flag's value in words: `run: dummy` -> 'dummy (no wandb logging)', None -> what the default does, and
    --num-epochs marked unused when --num-iterations sets the length."""
    if key == "run" and value == "dummy":
        return "dummy (no wandb logging)"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if value is None:
        return _UNSET.get(key, "not set (the default)")
    if key == "num_epochs" and (config.get("num_iterations") or 0) > 0:
        return f"{_fmt(value)} (not used: --num-iterations {config['num_iterations']} sets the length)"
    return _fmt(value)


def data_seen(conversations, dataset_size, ranks=1):
    """How much of the training data a run went through: conversations read by one rank, times the ranks ->
    '1,400 conversations, 7.0% of an epoch of 20,000' (so a one-epoch setting that stopped early says so)."""
    seen = conversations * ranks
    return f"{seen:,} conversations, {100 * seen / max(dataset_size, 1):.1f}% of an epoch of {dataset_size:,}"


def vocab_words(got, asked):
    """The tokenizer's vocabulary, explained when it is smaller than --vocab-size asked for."""
    if got >= asked:
        return f"{got:,}"
    return (
        f"{got:,} (asked for {asked:,}: the training text ran out of byte pairs to merge before that; "
        f"more text, --max-chars, gives a larger one)"
    )


def eval_label(task, metric, problems, samples=1, temperature=0.0):
    """The name of a measured number: task, metric, how many problems and greedy or sampled, e.g.
    'offline accuracy (greedy, 200 problems)' or 'offline pass@1 (T=1, 200 problems x 4 samples)'."""
    if samples == 1 and temperature == 0:
        return f"{task} {metric} (greedy, {problems} problems)"
    return f"{task} {metric} (T={temperature:g}, {problems} problems x {samples} samples)"


def rl_eval_rows(eval_history, task, problems, samples, temperature):
    """The RL stage's held-out pass@k before and after training, each row labelled by eval_label:
    eval_history is a list of {"step", "eval/pass@k": value, ...}; -> a dict for log_section."""
    if not eval_history:
        return {}
    rows = {}
    for when, e in (("before", eval_history[0]), ("after", eval_history[-1])):
        for k, v in e.items():
            if k.startswith("eval/"):
                rows[f"{eval_label(task, k[5:], problems, samples, temperature)} {when} (step {e['step']})"] = v
    return rows


def log_section(name, items, rank=0, config=None):
    """items: a list of dicts (key -> value) and/or markdown strings; config: the stage's flags (vars(args)),
    listed first as its hyperparameters. Only rank 0 writes."""
    if rank != 0:
        return None
    lines = [f"## {name}", f"timestamp: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M:%S')}", ""]
    if config:
        lines += ["hyperparameters:"] + [f"- {k}: {config_value(k, v, config)}" for k, v in config.items()] + [""]
    for item in items:
        if isinstance(item, dict):
            lines += [f"- {k}: {_fmt(v)}" for k, v in item.items()]
        else:
            lines.append(str(item))
        lines.append("")
    slug = name.lower().replace(" ", "-").replace("/", "-")
    path = os.path.join(write_dir(), f"{slug}.md")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("\n".join(lines))
    os.replace(tmp, path)
    if is_adhoc():
        print(
            f"report: this run is outside speedrun.sh, so its section went to {path} (the pipeline's sections "
            f"and card are untouched; `python -m nanorl.report` rewrites report.md with it under 'Ad-hoc runs')"
        )
    else:
        # the environment of the run the report is about: a report stitched later, from another shell, keeps it
        log_json("environment", _environment())
        print(f"report: section written to {path}")
    return path


def log_json(name, obj, rank=0):
    """Raw data for plots (loss curves, RL history), next to the sections."""
    if rank == 0:
        write_json(obj, os.path.join(write_dir(), f"{name}.json"))


def load_json(name, default=None, folder=None):
    """folder: where to read (default: where this run writes, so an ad-hoc run resumes from its own data)."""
    import json

    path = os.path.join(folder or write_dir(), f"{name}.json")
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
# the card's row order: rows starting with one of these come in this order, the rest after them
CARD_ROWS = [
    "val bpb",
    "CORE",
    "ARC-Easy",
    "ARC-Challenge",
    "MMLU",
    "GSM8K",
    "HumanEval",
    "SpellingBee",
    "ChatCORE",
    "offline",
]
# the stages' sections in pipeline order; a section whose slug starts with one of these goes there
SECTION_ORDER = [
    "tokenizer-training",
    "tokenizer-evaluation",
    "base-model-training",
    "base-model-evaluation",
    "midtraining",
    "chat-eval-mid",
    "chat-sft",
    "chat-eval-sft",
    "chat-rl",
    "chat-eval-rl",
]


def _order(name, order):
    """Position of name in order by its longest matching prefix (so 'chat-eval-sft-sampled' follows 'chat-eval-sft')."""
    hits = [i for i, o in enumerate(order) if name.startswith(o)]
    return (max(hits, key=lambda i: len(order[i])) if hits else len(order), name)


def _cpu_model(cpuinfo="/proc/cpuinfo"):
    """The CPU's marketing name from Linux's cpuinfo ('model name'), or None where there is none."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("model name") and ":" in line:
                    return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def _os_name():
    """e.g. 'Ubuntu 22.04.4 LTS (Linux 5.15.0-x86_64)': the distribution where it says, then the kernel."""
    import platform

    try:
        distro = platform.freedesktop_os_release().get("PRETTY_NAME")
    except (OSError, AttributeError):  # not Linux, or Python < 3.10
        distro = None
    kernel = f"{platform.system()} {platform.release()}-{platform.machine()}"
    return f"{distro} ({kernel})" if distro else kernel


def _environment():
    import platform
    import subprocess

    import torch

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*cmd):
        try:
            return subprocess.run(["git", *cmd], capture_output=True, text=True, cwd=repo, timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = bool(git("status", "--porcelain", "--untracked-files=no")) if commit != "unknown" else None
    try:
        ram = f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.1f} GiB"
    except (ValueError, OSError, AttributeError):  # not every OS has these
        ram = "unknown"
    env = {"git commit": commit + {True: " (dirty: uncommitted changes)", False: " (clean)", None: ""}[dirty]}
    if torch.cuda.is_available():
        props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
        env["GPUs"] = f"{len(props)} x {props[0].name}"
        env["GPU memory"] = f"{props[0].total_memory / 2**30:.1f} GiB each"
        env["CUDA"] = torch.version.cuda or "unknown"
    else:
        env["GPUs"] = "none (CPU run)"
    env.update(
        {
            "CPU": f"{_cpu_model() or platform.processor() or platform.machine()}, {os.cpu_count()} logical cores",
            "torch threads": f"{torch.get_num_threads()} (OMP_NUM_THREADS="
            f"{os.environ.get('OMP_NUM_THREADS', 'unset')})",
            "OS": _os_name(),
            "RAM": ram,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        }
    )
    return env


# the loss curves: (data written by the stage, its plot, title, y label)
LOSS_PLOTS = [
    ("base_train_loss", "plot_base_loss", "Base model training loss", "train loss"),
    ("mid_val_loss", "plot_mid_loss", "Midtraining held-out loss", "val loss"),
    ("sft_val_loss", "plot_sft_loss", "SFT held-out loss", "val loss"),
]


def _plots():
    """PNG plots, written next to the sections (report_dir()) and linked by their absolute path, so the links
    still work wherever report.md is moved on this machine; matplotlib is imported lazily and its absence is said
    plainly."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ["(plots skipped: matplotlib is not installed)"]
    lines = []
    for data, name, title, ylabel in LOSS_PLOTS:
        curve = load_json(data, folder=report_dir())
        if not curve:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(curve["step"], curve["loss"], marker="o" if len(curve["step"]) < 30 else None)
        ax.set(xlabel="step", ylabel=ylabel, title=title)
        fig.tight_layout()
        fig.savefig(os.path.join(report_dir(), f"{name}.png"), dpi=100)
        plt.close(fig)
        lines.append(f"![{title}]({os.path.join(report_dir(), name + '.png')})")
    rl = load_json("rl_history", folder=report_dir())
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
        fig.savefig(os.path.join(report_dir(), "plot_rl.png"), dpi=100)
        plt.close(fig)
        lines.append(f"![rl]({os.path.join(report_dir(), 'plot_rl.png')})")
    return lines


def _card_lines(card):
    rows = sorted({r for st in card.values() for r in st}, key=lambda r: _order(r, CARD_ROWS))
    lines = ["| metric | " + " | ".join(STAGES) + " |", "|---" * (len(STAGES) + 1) + "|"]
    for r in rows:
        vals = [card.get(st, {}).get(r) for st in STAGES]
        lines.append(f"| {r} | " + " | ".join("-" if v is None else f"{v:.4f}" for v in vals) + " |")
    return lines


def _sections(folder, out_path):
    """The sections' markdown in folder, in pipeline order."""
    names = sorted(
        (
            f[:-3]
            for f in os.listdir(folder)
            if f.endswith(".md") and os.path.join(folder, f) != os.path.abspath(out_path)
        ),
        key=lambda f: _order(f, SECTION_ORDER),
    )
    texts = []
    for name in names:
        with open(os.path.join(folder, name + ".md")) as f:
            texts.append(f.read())
    return texts


def _total_line(wall_time_s, setup_time_s):
    """The card's time: the stages' own times, and the setup before them (venv, installs) apart, when known: a rerun
    skips finished stages but sets up again, so the two may come from different runs of speedrun.sh."""
    setup = (
        "setup and installs not included"
        if setup_time_s is None
        else f"the last speedrun.sh's setup (venv, installs) took {setup_time_s / 60:.1f} min more"
    )
    return f"Total wall time: {wall_time_s / 60:.1f} min in the stages ({setup})."


def _wall_time_lines(wall_time_s, setup_time_s, stages, ngpu, gpu_hourly_usd):
    cost = (
        f"${ngpu * gpu_hourly_usd * wall_time_s / 3600:.2f} at ${gpu_hourly_usd}/GPU-hour" if ngpu else "$0 (CPU only)"
    )
    setup = "" if setup_time_s is None else f"; the last setup (venv, installs): {setup_time_s / 60:.1f} min more"
    lines = [
        f"- total wall time: {wall_time_s / 60:.1f} min (the sum of the stages' own times{setup})",
        f"- estimated cost: {cost}",
    ]
    if stages:
        lines.append("- per stage: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in stages.items()))
    return lines


def generate(out_path="report.md", wall_time_s=None, gpu_hourly_usd=3.0, setup_time_s=None):
    """Stitch report.md: the environment, the report card, every stage's section in pipeline order, time and
    cost, plots, then the ad-hoc runs apart. The environment is the one the stages recorded (this shell's only when
    none did). wall_time_s: the sum of the stages' own times (default: summed from speedrun.sh's markers in
    <base>/done/); setup_time_s: speedrun.sh's setup before them (venv, installs), kept for later reports."""
    recorded = load_json("environment", folder=report_dir())
    env = recorded or _environment()
    stages = _stage_seconds()
    if wall_time_s is None and stages:
        wall_time_s = sum(stages.values())
    if setup_time_s is None:
        setup_time_s = load_json("setup_time", {}, folder=report_dir()).get("seconds")
    else:
        write_json({"seconds": setup_time_s}, os.path.join(report_dir(), "setup_time.json"))
    lines = [REPORT_TITLE, "", "## Environment", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()] + [f"- recorded: {'by the stages' if recorded else 'now'}", ""]
    lines += ["## Report card", ""] + _card_lines(load_json("report_card", {}, folder=report_dir())) + [""]
    if wall_time_s is not None:
        lines += [_total_line(wall_time_s, setup_time_s), ""]
    for text in _sections(report_dir(), out_path):
        lines += [text, ""]
    if wall_time_s is not None:
        ngpu = int(env["GPUs"].split(" x ")[0]) if " x " in env["GPUs"] else 0
        times = _wall_time_lines(wall_time_s, setup_time_s, stages, ngpu, gpu_hourly_usd)
        lines += ["## Time and cost", ""] + times + [""]
    plots = _plots()
    if plots:
        lines += ["## Plots", ""] + plots + [""]
    adhoc = os.path.join(report_dir(), "adhoc")
    card = load_json("report_card", {}, folder=adhoc) if os.path.isdir(adhoc) else {}
    sections = _sections(adhoc, out_path) if os.path.isdir(adhoc) else []
    if card or sections:
        lines += ["## Ad-hoc runs", "", f"Runs outside speedrun.sh, kept apart from the card above ({adhoc}).", ""]
        lines += (_card_lines(card) + [""]) if card else []
        lines += [line for text in sections for line in (text.replace("## ", "### ", 1), "")]
    _replace_report(out_path, "\n".join(lines))
    return out_path


def _replace_report(path, text):
    """Write report.md through a temp file beside it; a file there that is not a report of ours (its first line) is
    refused in one line and kept: --out names where the report goes, never what may be lost."""
    if os.path.lexists(path):
        try:
            with open(path) as f:
                first = f.readline().rstrip("\n")
        except (OSError, UnicodeDecodeError):
            first = None
        if first != REPORT_TITLE:
            raise BadValue(f"--out {path} exists and is not a nanorl report: it is never replaced; name another file")
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".report.tmp-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Write report.md from the stages' sections")
    parser.add_argument("--out", default="report.md", help="where to write the report")
    parser.add_argument(
        "--wall-time",
        type=float,
        default=None,
        help="the sum of the stages' own times, in seconds (default: summed from <base>/done/)",
    )
    parser.add_argument(
        "--setup-time",
        type=float,
        default=None,
        help="seconds of setup before the stages (venv, installs), shown beside them (default: as last recorded)",
    )
    a = parser.parse_args()
    print(f"wrote {generate(a.out, a.wall_time, setup_time_s=a.setup_time)}")
