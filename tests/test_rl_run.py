"""nanorl/rl_run.py: an RL run driven in this process (a step, a save, a resume), one default step traced against
docs/rl.md's tables of it, the held-out pass@k against hand values, and what the run prints (the step line from its
one table of fields, the summary)."""

import re
import sys
from pathlib import Path

import pytest
import torch
import warm_python  # pytest puts tests/ on sys.path
from test_chat_rl import RM, base_dir  # noqa: F401 (the tiny tokenizer and checkpoint)

from nanorl.rl_config import GroupSpec
from nanorl.rl_run import STEP_FIELDS, idle_line, local_pass_at_k, reduce_pass_at_k, rl_summary, step_legend, step_line

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--source", "sft", "--model-tag", "t", "--levels", "1", "--rollout-batch-size", "4", "--n-samples-per-prompt",
        "4", "--max-new-tokens", "12", "--eval-max-problems", "4", "--n-samples-per-eval-prompt", "2", "--pass-k",
        "1,2", "--lr-scale", "1.0", "--engine-batch-size", "16", "--device-type", "cpu", "--custom-rm-path", RM]  # fmt: skip


class FakeLogger:
    def __init__(self):
        self.calls = []

    def log(self, m, step=None):
        self.calls.append((step, dict(m)))


def build(base, monkeypatch, *flags):
    from scripts import chat_rl

    monkeypatch.setenv("NANORL_BASE_DIR", str(base))
    parser = chat_rl.make_parser()
    run, _ = chat_rl.build_run(parser.parse_args([*TINY, *flags]), parser)
    run.logger = FakeLogger()
    return run


def steady(m):
    return {k: v for k, v in m.items() if not k.startswith(("time/", "perf/"))}


def test_a_run_steps_saves_and_resumes_in_process(base_dir, monkeypatch, capsys):  # noqa: F811
    flags = ["--num-rollouts", "3", "--output-tag", "inproc", "--temperature", "0.8"]
    run = build(base_dir, monkeypatch, *flags)
    before = run.evaluate(0)
    assert run.logger.calls == [(0, before)] and run.eval_history == [{"step": 0, **before}]  # the curves' first point
    first = run.step(0)
    assert first["train/first_step_ppo_kl"] == 0.0 and first["train/train_rollout_logprob_abs_diff"] < 1e-4
    run.save(1)
    second = run.step(1)
    weights = [p.detach().clone() for p in run.model.parameters()]
    assert [h["step"] for h in run.history] == [1, 2] and run.source.state_dict()["offset"] == 8

    # a new run object of the same flags resumes after step 1 and takes step 2 exactly as the first one did
    resumed = build(base_dir, monkeypatch, *flags, "--resume")
    capsys.readouterr()
    assert resumed.resume() == 1
    out = capsys.readouterr().out
    assert "warning" not in out and "resumed from" in out  # the same flags: nothing to warn about
    assert [h["step"] for h in resumed.history] == [1] and resumed.eval_history == run.eval_history[:1]
    assert steady(resumed.step(1)) == steady(second)
    assert all(torch.equal(a, b) for a, b in zip(weights, resumed.model.parameters()))
    # the engine samples the trained weights: on-policy again at the next step
    assert resumed.step(2)["train/train_rollout_logprob_abs_diff"] < 1e-4


def test_rl_keeps_its_newest_checkpoints_by_default(base_dir, monkeypatch):  # noqa: F811
    """A GPU run saves every 60 rollouts and each save is ~3x the weights: by default only the newest 2 stay (the
    latest always), each with one optimizer file."""
    from nanorl.checkpoint import complete_steps

    run = build(base_dir, monkeypatch, "--output-tag", "kept")
    for step in (1, 2, 3):
        run.save(step)
    assert complete_steps(run.ckpt["dir"]) == [2, 3]
    assert sorted(p.name for p in Path(run.ckpt["dir"]).glob("optim_*")) == ["optim_000002.pt", "optim_000003.pt"]


def test_resuming_with_other_flags_names_them_in_one_line(base_dir, monkeypatch, capsys):  # noqa: F811
    # (the same flags warn about nothing: the test above)
    run = build(base_dir, monkeypatch, "--num-rollouts", "2", "--output-tag", "inproc_flags", "--overwrite")
    run.save(0)
    flags = ["--num-rollouts", "5", "--output-tag", "inproc_flags", "--resume", "--lr-scale", "0.5"]
    resumed = build(base_dir, monkeypatch, *flags)
    capsys.readouterr()
    assert resumed.resume() == 0
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning")]
    # --overwrite and --resume say how the run starts, not what it does: no warning about them
    assert warnings == ["warning: resuming with changed RL flags: num_rollouts: 2 -> 5, lr_scale: 1.0 -> 0.5"]


def test_a_step_and_an_eval_render_no_prompt_and_rebuild_no_example(base_dir, monkeypatch):  # noqa: F811
    """The prompts are rendered once, when the run is built, and the task's own grader (--rm-type task, the default)
    reads the examples loaded then: a step, an eval and the graders render no prompt and rebuild no example, yet
    sample from exactly the rendered prompt and pay exactly the verdict of a freshly built example of that row."""
    from nanorl import synthetic
    from scripts import chat_rl
    from tasks.common import Task
    from tasks.offline import OfflineProblems

    monkeypatch.setenv("NANORL_BASE_DIR", str(base_dir))
    parser = chat_rl.make_parser()
    flags = [*TINY[: TINY.index("--custom-rm-path")], "--output-tag", "rendered"]  # the task's own grader
    run, info = chat_rl.build_run(parser.parse_args(flags), parser)
    run.logger = FakeLogger()
    assert info["rm_name"] == "task:OfflineProblems"
    worker, tok = run.worker, run.worker.tokenizer
    calls = {"render_for_completion": 0, "get_example": 0, "problem_to_conversation": 0}

    def counted(name, fn):
        def wrapper(*args, **kw):
            calls[name] += 1
            return fn(*args, **kw)

        return wrapper

    monkeypatch.setattr(tok, "render_for_completion", counted("render_for_completion", tok.render_for_completion))
    monkeypatch.setattr(Task, "get_example", counted("get_example", Task.get_example))
    to_conversation = counted("problem_to_conversation", synthetic.problem_to_conversation)
    monkeypatch.setattr(synthetic, "problem_to_conversation", to_conversation)
    scored, score = [], worker.score
    monkeypatch.setattr(worker, "score", lambda groups, **kw: scored.extend(score(groups, **kw)) or groups)
    run.step(0)
    run.evaluate(1)
    paid = {}  # each split's grader on the right and a wrong answer to row 3, by the label its prompt holds
    for split, items in (("train", run.source.items), ("test", run.eval_items)):
        label = items[3]["label"]
        answers = (label, str(int(label) + 1))
        paid[split] = [worker.graders[split](f"so\n#### {a}", label, {"split": split, "row": 3}) for a in answers]
    assert calls == {"render_for_completion": 0, "get_example": 0, "problem_to_conversation": 0}
    assert paid == {"train": [1.0, 0.0], "test": [1.0, 0.0]}
    monkeypatch.undo()
    # what was sampled and paid, against the prompt rendered now and a freshly built task's example of its row
    assert [len(g) for g in scored] == [4] * 4 + [2] * 4  # the step's 4 groups, then the eval's
    tasks = {split: OfflineProblems(split, levels=(1,)) for split in ("train", "test")}
    for s in (s for g in scored for s in g):
        example = tasks[s.metadata["split"]].get_example(s.metadata["row"])
        assert s.prompt == example and s.tokens[: s.prompt_length] == tok.render_for_completion(example)
        assert s.reward == float(tasks["train"].evaluate(example, worker.response_text(s)))


# -----------------------------------------------------------------------------------------------
# one default GRPO step, traced (dev/trace_step.py), against docs/rl.md's tables of it


def documented_step():
    """docs/rl.md's tables of the traced step -> ({file: (lines, functions)}, {(file, caller, file, callee)})."""
    text = (ROOT / "docs" / "rl.md").read_text()
    files = {f: (int(n), int(k)) for f, n, k in re.findall(r"^\| `([\w/]+\.py)` \| (\d+) \| (\d+) \|$", text, re.M)}
    calls = set()
    for a, b, pairs in re.findall(r"^\| `([\w/]+\.py)` \| `([\w/]+\.py)` \| (.+) \|$", text, re.M):
        calls |= {(a, f, b, g) for f, g in re.findall(r"`([^`]+)` -> `([^`]+)`", pairs)}
    return files, calls


@pytest.mark.fp32("docs/rl.md's tables are the default fp32 step's; CUDA's dtype layout also runs precision.py")
def test_one_default_grpo_step_executes_what_docs_rl_md_tables_say(base_dir, monkeypatch):  # noqa: F811
    monkeypatch.syspath_prepend(ROOT / "dev")
    from trace_step import FLAGS, build_run, tables, trace_step, widest_returns

    monkeypatch.setenv("NANORL_BASE_DIR", str(base_dir))
    # chat_rl's defaults and the offline task's own grader, nothing exempt ("t": the fixture also holds a teacher)
    trace = trace_step(build_run([*FLAGS, "--model-tag", "t"]))
    files, calls = documented_step()
    assert len(files) >= 5 and len(calls) >= 10  # the tables were found
    regenerate = f"rerun python dev/trace_step.py and paste its tables into docs/rl.md:\n{tables(trace)}"
    assert trace["lines"].keys() == files.keys(), regenerate
    assert trace["calls"] == calls, regenerate
    for f, (n, k) in files.items():  # the counts move a little with the sampled answers
        assert abs(trace["lines"][f] - n) <= max(10, 0.1 * n), (f, trace["lines"][f], n, regenerate)
        assert abs(len(trace["functions"][f]) - k) <= max(2, 0.1 * k), (f, len(trace["functions"][f]), k, regenerate)
    # no function on the step's path takes more than 8 parameters or gives back more than 3 values: a group that
    # belongs together travels as one
    wide = {fn: n for fn, n in trace["parameters"].items() if n > 8}
    assert not wide and len(trace["parameters"]) == sum(len(q) for q in trace["functions"].values()), wide
    returns = widest_returns(trace["functions"])
    unread = {(f, q) for f, names in trace["functions"].items() for q in names} - returns.keys()
    assert all(q.rsplit(".", 1)[-1].startswith("<") for _, q in unread), unread  # only comprehensions and lambdas
    assert {fn: n for fn, n in returns.items() if n > 3} == {}
    assert returns["nanorl/rl.py", "policy_loss"] == 2 and returns["nanorl/engine.py", "SlotRecords.lists"] == 3
    # one meaning per name: no executed line calls anything `m` (it once meant the model, the metrics, the minutes)
    named_m = [
        (f, n)
        for f, numbers in trace["executed"].items()
        for n, text in enumerate((ROOT / f).read_text().splitlines(), 1)
        if n in numbers and re.search(r"(?<![\w.'\"])m(?![\w'\"])", text.split("#")[0])
    ]
    assert named_m == []


# -----------------------------------------------------------------------------------------------
# the held-out pass@k


class Sample:
    def __init__(self, reward):
        self.reward = reward

    def scalar_reward(self):
        return self.reward


class FakeWorker:
    """Two prompts x 4 samples: 1 and 4 correct (reward >= 0.5 counts as correct)."""

    def __init__(self, fail=False):
        self.fail, self.inflight, self.calls = fail, {}, []

    def sample_groups(self, items, seeds, version, group=None):
        self.calls.append((items, seeds, version, group))
        self.inflight["generating"] = items
        if self.fail:
            raise RuntimeError("boom")
        return [[Sample(r) for r in rs] for rs in ([1.0, 0.0, 0.2, 0.4], [0.5, 1.0, 0.9, 0.7])]

    def score(self, groups, count_failures=True):
        assert count_failures is False  # the eval's reward failures are not the rollout's
        return groups


def test_local_sums_and_reduce_match_hand_values():
    w, group = FakeWorker(), GroupSpec(n_samples_per_prompt=4, temperature=0.7)
    local = local_pass_at_k(w, ["a", "b"], [7, 8], group, [1, 2], 3, 0, "rank 0: the eval at step 3")
    assert w.calls == [(["a", "b"], [7, 8], 3, group)] and w.inflight == {}
    # pass@1 = c/n: 1/4 + 4/4; pass@2 = 1 - C(n-c, 2)/C(4, 2): (1 - 3/6) + 1
    assert local == pytest.approx([1.25, 1.5, 2, 0.0])
    out, n_prompts, n_failed = reduce_pass_at_k(local, [1, 2], torch.device("cpu"))
    assert out == pytest.approx({"eval/pass@1": 0.625, "eval/pass@2": 0.75}) and (n_prompts, n_failed) == (2, 0)


def test_a_failed_eval_is_counted_not_raised(capsys):
    w = FakeWorker(fail=True)
    local = local_pass_at_k(w, ["a"], [7], GroupSpec(), [1], 0, 0, "rank 1: the eval at step 0")
    assert local == [0.0, 0.0, 1.0] and w.inflight == {}
    assert "rank 1: the eval at step 0 failed: RuntimeError: boom" in capsys.readouterr().err
    out, n_prompts, n_failed = reduce_pass_at_k(local, [1], torch.device("cpu"))
    assert out == {"eval/pass@1": 0.0} and (n_prompts, n_failed) == (0, 1)


# -----------------------------------------------------------------------------------------------
# what the run prints

METRICS = {
    "rollout/reward_mean": 0.25, "rollout/response_len_mean": 31.5, "train/pg_loss": -0.0123, "train/clipfrac": 0.0625,
    "train/ppo_kl": 0.00012, "train/entropy": 1.5, "train/grad_norm": 0.75, "train/train_rollout_logprob_abs_diff": 3e-7,
    "train/padding_frac": 0.125, "rollout/groups_dropped": 2.0, "time/rollout": 1.25, "perf/idle_frac": 0.1,
    "dt": 2.5, "eta": "1.2m",
}  # fmt: skip


def test_the_step_line_is_its_table_of_fields():
    assert step_line(0, 60, METRICS) == (
        "step 00001/60 | reward 0.250 | len 31.5 | pg -0.0123 | clip 0.062 | ppo_kl +1.20e-04 | ent 1.500 "
        "| gnorm 0.750 | lp_diff 3.0e-07 | pad 12% | dropped 2 | dt 2.5s (rollout 1.2s, waiting 10%) | eta 1.2m"
    )
    tools = {"rollout/tool_calls_mean": 1.25, "rollout/tool_errors_mean": 0.5, "rollout/max_turns_hit_mean": 0.0}
    assert step_line(9, 60, {**METRICS, **tools}).endswith("| eta 1.2m | tools 1.25 err 0.50 max_turns 0.00")
    legend = step_legend()
    assert legend.startswith("step line: reward = mean reward") and "\n" not in legend
    for name, *_ in STEP_FIELDS:
        assert legend.count(f"{name} = ") == 1


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


def test_chat_rl_help_ends_with_the_legend_and_lists_one_name_per_flag():
    out = warm_python.run(
        [sys.executable, "-m", "scripts.chat_rl", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    text = "".join(out.stdout.split())  # argparse rewraps the epilog (at spaces and hyphens)
    assert text.endswith("".join(step_legend().split())) and "--overwrite" in text
    # slime's spellings are accepted (tests/test_chat_rl.py runs them) but --help shows our names only
    assert "--num-rollouts" in text and "--rollout-temperature" not in text and "--eval-interval" not in text
