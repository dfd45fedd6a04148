import re
from pathlib import Path

from nanorl.rl_progress import STEP_FIELDS, idle_line, log_eval, rl_summary, step_legend

ROOT = Path(__file__).resolve().parents[1]


def test_legend_explains_every_field_of_chat_rls_step_line_once():
    # wherever log_step lives (chat_rl, or a module it moved to)
    src = next(
        t
        for p in [ROOT / "scripts" / "chat_rl.py", *sorted((ROOT / "nanorl").glob("*.py"))]
        if "def log_step" in (t := p.read_text())
    )
    body = src[src.index("def log_step") :]
    body = body[: body.index("\ndef ", 1)]
    # the step line's fields: "| name value" (the multi-turn tail "tools/err/max_turns" is its own, not in the legend)
    fields = [f for f in re.findall(r"\| (\w+) ", body) if f not in ("tools",)]
    assert fields == [name for name, _ in STEP_FIELDS]
    legend = step_legend()
    assert legend.startswith("step line: reward = mean reward") and "\n" not in legend
    for name in ("pg", "clip", "ppo_kl", "ent", "gnorm", "lp_diff", "pad"):
        assert legend.count(f"; {name} = ") == 1


class FakeLogger:
    def __init__(self):
        self.calls = []

    def log(self, m, step=None):
        self.calls.append((step, dict(m)))


def test_log_eval_gives_the_logger_a_step_0_point():
    logger, history = FakeLogger(), []
    log_eval(logger, history, 0, {"eval/pass@1": 0.25, "eval/pass@4": 0.5})
    log_eval(logger, history, 10, {"eval/pass@1": 0.375, "eval/pass@4": 0.625})
    assert logger.calls == [
        (0, {"eval/pass@1": 0.25, "eval/pass@4": 0.5}),
        (10, {"eval/pass@1": 0.375, "eval/pass@4": 0.625}),
    ]
    assert history == [
        {"step": 0, "eval/pass@1": 0.25, "eval/pass@4": 0.5},
        {"step": 10, "eval/pass@1": 0.375, "eval/pass@4": 0.625},
    ]


def test_idle_line_only_when_there_are_other_ranks():
    assert idle_line({"idle_frac_both_ranks": 0.0}, "cpu", 1) is None
    assert idle_line({"idle_frac_sampling_ranks": 0.125, "idle_frac_training_ranks": 0.5}, "cuda", 2) == (
        "idle fraction (time a CUDA rank waited on other ranks): idle_frac_sampling_ranks 12.5%, "
        "idle_frac_training_ranks 50.0%"
    )


def test_rl_summary_before_after_saved_step_and_chat_command():
    hist = [
        {"step": 0, "eval/pass@1": 0.40625, "eval/pass@4": 0.785, "eval/greedy": 0.76},
        {"step": 10, "eval/pass@1": 0.5, "eval/pass@4": 0.77, "eval/greedy": 0.7},
        {"step": 24, "eval/pass@1": 0.5225, "eval/pass@4": 0.775, "eval/greedy": 0.795},
    ]
    out = rl_summary(hist, "/b/rl_checkpoints/d4", 24, "d4")
    assert out.splitlines() == [
        "RL summary:",
        "  pass@1: 0.4062 -> 0.5225 (+11.6 pts, step 0 -> 24)",  # 100 * (0.5225 - 0.40625) = 11.625
        "  pass@4: 0.7850 -> 0.7750 (-1.0 pts, step 0 -> 24)",
        "  greedy: 0.7600 -> 0.7950 (+3.5 pts, step 0 -> 24)",
        "  saved: step 24 in /b/rl_checkpoints/d4",
        "  chat with it: python -m scripts.chat_cli -i rl -g d4",
    ]
    assert rl_summary([], "/x", None, "t").splitlines() == ["RL summary:", "  no eval ran", "  nothing saved in /x"]


def test_chat_rl_help_ends_with_the_legend():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "scripts.chat_rl", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    text = "".join(out.stdout.split())  # argparse rewraps the epilog (at spaces and hyphens)
    assert text.endswith("".join(step_legend().split())) and "--overwrite" in text
