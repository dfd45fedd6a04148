"""End-to-end runs of scripts/chat_rl.py on a tiny random-weight model (CPU, fp32)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import warm_python
from rl_fixture_server import RewardHandler, reward_server
from test_bad_input import run_script
from tiny_checkpoints import save_random_sft, train_tokenizer

from nanorl import common

ROOT = Path(__file__).resolve().parents[1]
RM = f"{ROOT / 'tests' / 'rl_fixture_reward.py'}:vowel_reward"


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("rl")
    env = {**os.environ, "NANORL_BASE_DIR": str(d)}
    train_tokenizer(env)
    save_random_sft(env)
    save_random_sft(env, "teacher", seed=1, head_std=0.5)  # a different model to distil from
    return d


@pytest.fixture(scope="module")
def tool_model(base_dir):
    """A checkpoint "tools" that often writes <|python_start|>2+3<|python_end|>, and calls again after each output."""
    code = (
        "import sys; sys.path.insert(0, 'tests')\n"
        "from rl_fixture_tools import tool_user_model\n"
        "from nanorl.tokenizer import get_tokenizer\n"
        "from nanorl.checkpoint import save_checkpoint\n"
        "from nanorl.model_loading import checkpoint_root\n"
        "tok = get_tokenizer()\n"
        "m = tool_user_model(tok, '2+3', tok.encode_special('<|python_start|>'), tok.vocab_size, strength=10.0, noise=0.01)\n"
        "save_checkpoint(checkpoint_root('sft') + '/tools', 0, m.state_dict(), meta={'model_config': m.config.to_dict()})\n"
    )
    env = {**os.environ, "NANORL_BASE_DIR": str(base_dir)}
    warm_python.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, capture_output=True)
    return "tools"


def run_rl(base_dir, *extra, nproc=1, check=True, env=None, rm=RM):
    env = {**os.environ, "NANORL_BASE_DIR": str(base_dir), "OMP_NUM_THREADS": "1", **(env or {})}
    launch = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        if nproc > 1
        else [sys.executable]
    )
    cmd = launch + [
        "-m",
        "scripts.chat_rl",
        "--source",
        "sft",
        "--model-tag",
        "t",
        "--levels",
        "1",
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "4",
        "--max-new-tokens",
        "12",
        "--eval-every",
        "100",
        "--eval-max-problems",
        "4",
        "--n-samples-per-eval-prompt",
        "2",
        "--pass-k",
        "1,2",
        "--lr-scale",
        "1.0",
        "--engine-batch-size",
        "16",
        "--device-type",
        "cpu",
        *(["--custom-rm-path", rm] if rm else []),
        *extra,
    ]
    # a new process without a new interpreter's imports (tests/warm_python.py); torchrun's ranks are new interpreters
    out = warm_python.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if not check:
        return out
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    with open(base_dir / "report" / "rl_history.json") as f:
        return json.load(f), out.stdout


def final_weights(base_dir, tag):
    from nanorl.checkpoint import load_checkpoint

    return load_checkpoint(str(base_dir / "rl_checkpoints" / tag))[0]


def test_first_step_is_exactly_on_policy(base_dir):
    # at a rollout temperature != 1 too: the engine records the log-probs of the distribution it samples from, the
    # trainer computes them at the same temperature, so TIS weights are 1; and on every step, not only the first:
    # the engine's own copy of the weights is refreshed after each optimizer step
    tb = base_dir / "tb_onpolicy"
    hist, log = run_rl(
        base_dir,
        "--num-rollouts",
        "2",
        "--output-tag",
        "onpolicy",
        "--temperature",
        "0.7",
        "--use-tis",
        "--tensorboard",
        str(tb),
    )
    first = hist["train"][0]
    assert first["train/first_step_ppo_kl"] == 0.0 and first["train/clipfrac"] == 0.0
    for h in hist["train"]:
        assert h["train/train_rollout_logprob_abs_diff"] < 1e-4  # engine log-probs == trainer log-probs
        assert abs(h["train/tis_mean"] - 1.0) < 1e-4 and h["train/tis_clipfrac"] == 0.0
    assert first["rollout/reward_std"] > 0 and first["train/grad_norm"] > 0
    assert "eval/pass@1" in hist["eval"][0] and len(hist["eval"]) == 2  # before the first and after the last
    # the run explains itself: the step line's legend first, the summary last; one rank prints no idle fractions
    ev, ck = hist["eval"], base_dir / "rl_checkpoints" / "onpolicy"
    assert "step line: reward = " in log.split("step 00001/")[0] and "idle fraction" not in log
    assert log.rstrip().endswith(
        f"  pass@1: {ev[0]['eval/pass@1']:.4f} -> {ev[1]['eval/pass@1']:.4f} "
        f"({100 * (ev[1]['eval/pass@1'] - ev[0]['eval/pass@1']):+.1f} pts, step 0 -> 2)\n"
        f"  pass@2: {ev[0]['eval/pass@2']:.4f} -> {ev[1]['eval/pass@2']:.4f} "
        f"({100 * (ev[1]['eval/pass@2'] - ev[0]['eval/pass@2']):+.1f} pts, step 0 -> 2)\n"
        f"  saved: step 2 in {ck}\n  chat with it: python -m scripts.chat_cli -i rl -g onpolicy"
    )
    assert f"loaded sft checkpoint t step 0 from {base_dir / 'sft_checkpoints' / 't'}" in log
    # the report's RL section names the held-out problems as chat_eval's card rows do: the offline task's levels
    section = (base_dir / "report" / "chat-rl.md").read_text()
    assert "- offline levels 1 pass@1 (T=1, 4 problems x 2 samples) after (step 2): " in section
    # the logger's curves start at a "before" point: the step-0 eval
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb))
    acc.Reload()
    points = acc.Scalars("eval/pass@1")
    assert [e.step for e in points] == [0, 2]
    assert [e.value for e in points] == pytest.approx([ev[0]["eval/pass@1"], ev[1]["eval/pass@1"]])
    # a fresh run into the same tag would hide behind step 2: refused in one line, before any rollout
    out = run_rl(base_dir, "--num-rollouts", "1", "--output-tag", "onpolicy", check=False)
    assert out.returncode == 1 and "step 00001" not in out.stdout, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == (
        f"{ck} already holds step 2 of an earlier run, which would hide this "
        "run's steps: pass --resume to continue it, another --output-tag, "
        "or --overwrite to move it aside"
    )


def test_two_processes_equal_one(base_dir):
    run_rl(base_dir, "--num-rollouts", "2", "--output-tag", "one")
    run_rl(base_dir, "--num-rollouts", "2", "--output-tag", "two", nproc=2)
    one, two = final_weights(base_dir, "one"), final_weights(base_dir, "two")
    # same samples, same advantages, same global loss: the weights agree to float summation order. Adam
    # divides by sqrt(v), so an embedding row with a near-zero gradient can turn a 1e-9 difference into a
    # visible one: allow a handful of such elements, never a real disagreement.
    n_bad, n_all = 0, 0
    for k in one:
        close = torch.isclose(one[k], two[k], atol=2e-5, rtol=1e-4)
        n_bad, n_all = n_bad + int((~close).sum()), n_all + close.numel()
        assert (one[k] - two[k]).abs().max() < 1e-2, k
    assert n_bad <= 1e-3 * n_all, (n_bad, n_all)


def test_dynamic_sampling_when_the_ranks_filters_disagree(base_dir):
    # rank 1 drops every group, rank 0 none: the ranks hold different metric names (dropped_all_correct) and the
    # step's metrics are still averaged over both. Per rank and step: 2 groups to fill, 3 prompts a round, 2 rounds.
    # rank 0: step 1 keeps 3 (1 to the buffer), step 2 takes 1 from the buffer + 3 new; drops nothing.
    # rank 1: 2 rounds drop 6 groups (all correct), 2 of them fill the batch: dropped 4, unfiltered fill 2.
    rm = f"{ROOT / 'tests' / 'rl_fixture_reward.py'}:constant_on_rank1_reward"
    hist, log = run_rl(
        base_dir,
        "--num-rollouts",
        "2",
        "--output-tag",
        "filters",
        "--over-sampling-batch-size",
        "6",
        "--max-sampling-rounds",
        "2",
        nproc=2,
        rm=rm,
    )
    assert len(hist["train"]) == 2 and log.count("| dropped 2 |") == 2
    for h, from_buffer in zip(hist["train"], (0 + 0, 1 + 0)):  # (rank 0 + rank 1) / 2
        want = {
            "groups_dropped": (0 + 4) / 2,
            "dropped_all_correct": (0 + 6) / 2,
            "rounds": (1 + 2) / 2,
            "groups_unfiltered_fill": (0 + 2) / 2,
            "groups_generated": (3 + 6) / 2,
            "groups_from_buffer": from_buffer / 2,
        }
        assert {k for k in h if k.startswith("rollout/dropped_")} == {"rollout/dropped_all_correct"}
        assert {k: h[f"rollout/{k}"] for k in want} == want


@pytest.mark.parametrize(
    "flags",
    [
        [
            "--advantage-estimator",
            "rloo",
            "--loss-aggregation",
            "seq_mean_token_mean",
            "--use-kl-loss",
            "--kl-loss-coef",
            "0.1",
        ],
        [
            "--advantage-estimator",
            "reinforce_plus_plus_baseline",
            "--kl-coef",
            "0.05",
            "--loss-aggregation",
            "seq_mean_token_sum_norm",
        ],
        [
            "--disable-grpo-std-normalization",
            "--eps-clip-high",
            "0.28",
            "--eps-clip-c",
            "3",
            "--num-steps-per-rollout",
            "2",
            "--normalize-advantages",
            "--entropy-coef",
            "0.01",
            "--overlong-buffer-len",
            "4",
            "--mask-truncated-samples",
        ],
        ["--over-sampling-batch-size", "8", "--max-sampling-rounds", "2"],
        [
            "--advantage-estimator",
            "gspo",
            "--num-steps-per-rollout",
            "2",
            "--eps-clip",
            "0.0003",
            "--eps-clip-high",
            "0.0004",
        ],
        ["--advantage-estimator", "cispo", "--eps-clip-high", "0.28", "--use-tis", "--tis-mode", "icepop"],
        ["--advantage-estimator", "reinforce_plus_plus", "--gamma", "0.99", "--kl-coef", "0.01", "--use-tis"],
        [
            "--advantage-estimator",
            "ppo",
            "--critic-lr",
            "1e-3",
            "--lambd",
            "0.95",
            "--num-steps-per-rollout",
            "2",
            "--normalize-advantages",
            "--kl-coef",
            "0.01",
        ],
        ["--use-opd", "--opd-teacher-load", "sft:teacher", "--opd-kl-coef", "0.5"],
    ],
)
def test_estimators_and_options_run(base_dir, flags):
    hist, log = run_rl(
        base_dir, "--num-rollouts", "2", "--output-tag", "opts", "--overwrite", *flags
    )  # one tag for all
    for h in hist["train"]:
        assert all(v == v for v in h.values() if isinstance(v, float))  # no NaN anywhere
    if "--num-steps-per-rollout" in flags:
        assert hist["train"][0]["train/first_step_ppo_kl"] == 0.0  # old log-probs come from a pass before the update
    if "ppo" in flags:  # the critic trains: a value loss and a nonzero critic gradient every step
        assert all(h["train/critic_grad_norm"] > 0 and "train/vf_clipfrac" in h for h in hist["train"])
    if "--use-opd" in flags:  # a different teacher: the student-teacher gap is measured and nonzero
        assert all(abs(h["train/opd_student_teacher_kl"]) > 1e-3 for h in hist["train"])


def test_broken_rewards_are_counted_not_trained_on(base_dir):
    rm = f"{ROOT / 'tests' / 'rl_fixture_reward.py'}:broken_reward"
    hist, _ = run_rl(base_dir, "--num-rollouts", "1", "--output-tag", "broken", "--custom-rm-path", rm)
    assert hist["train"][0]["rollout/reward_failures"] > 0


@pytest.mark.parametrize("mode", ["drop", "zero"])
def test_remote_rewards_survive_a_failing_server(base_dir, mode):
    # the server answers some responses, and fails the others with a 500, a hang past --rm-timeout or bad JSON
    with reward_server() as url:
        RewardHandler.payloads.clear()
        hist, log = run_rl(
            base_dir,
            "--num-rollouts",
            "1",
            "--output-tag",
            f"remote_{mode}",
            "--rm-type",
            "remote",
            "--rm-url",
            url + "/mixed",
            "--rm-timeout",
            "0.5",
            "--rm-retries",
            "1",
            "--rm-failure",
            mode,
            rm=None,
        )
        payload = RewardHandler.payloads[0]
    first = hist["train"][0]
    assert first["rollout/reward_failures"] > 0 and f"rewards failed ({mode})" in log
    assert first["train/grad_norm"] > 0 and first["rollout/reward_std"] > 0  # the good answers still train
    assert (
        set(payload) == {"prompt", "response", "label", "metadata"}
        and payload["prompt"]["messages"][0]["role"] == "user"
    )
    assert payload["metadata"]["task"] == "offline" and isinstance(payload["response"], str)


def test_multi_turn_tool_rl(base_dir, tool_model):
    hist, log = run_rl(
        base_dir,
        "--model-tag",
        tool_model,
        "--num-rollouts",
        "2",
        "--output-tag",
        "multiturn",
        "--multi-turn",
        "--max-turns",
        "2",
        "--max-new-tokens",
        "24",
    )
    first = hist["train"][0]
    assert first["rollout/tool_calls_mean"] > 0 and first["rollout/max_turns_hit_mean"] > 0 and "| tools " in log
    assert first["rollout/tool_errors_mean"] < first["rollout/tool_calls_mean"]  # mostly 2+3, sometimes a sampled typo
    # engine log-probs over several turns (tool outputs masked out) are the trainer's: exactly on-policy
    assert first["train/train_rollout_logprob_abs_diff"] < 1e-4 and first["train/first_step_ppo_kl"] == 0.0
    assert first["train/grad_norm"] > 0


# refused once the ranks are known (after compute_init); every other bad flag is refused before it
CHECKED_WITH_THE_RANKS = ("--num-steps-per-rollout", "--global-batch-size", "--async")


@pytest.mark.parametrize(
    "flags,msg",
    [
        (["--custom-rm-path", "no_such_mod:fn"], "could not import"),
        (["--rollout-batch-size", "3", "--num-steps-per-rollout", "5"], "--num-steps-per-rollout"),
        (["--global-batch-size", "7"], "--global-batch-size"),
        (["--rm-type", "bogus", "--custom-rm-path", ""], "bogus"),
        (["--advantage-estimator", "ppo"], "--critic-lr"),
        (["--critic-lr", "1e-3"], "--critic-lr"),
        (["--use-opd"], "--opd-teacher-load"),
        (["--rollout-num-gpus", "1"], "--async"),
        (["--partial-rollout"], "--over-sampling-batch-size"),
        (["--rm-type", "remote", "--custom-rm-path", ""], "--rm-type remote needs --rm-url"),
        (["--rm-type", "remote", "--rm-url", "http://127.0.0.1:1/r"], "--custom-rm-path both pick the reward"),
        (["--rm-type", "remote", "--rm-url", "127.0.0.1:1", "--custom-rm-path", ""], "must start with http://"),
        (["--rm-url", "http://127.0.0.1:1/r"], "only used with --rm-type remote"),
        (["--max-turns", "3"], "only used with --multi-turn"),
        (["--multi-turn", "--max-turns", "0"], "argument --max-turns: 0 is out of range: must be an integer >= 1"),
        # print takes any arguments, so it passes the signature check and the clash is what fails
        (
            ["--multi-turn", "--custom-generate-function-path", "builtins:print"],
            "--multi-turn and --custom-generate-function-path",
        ),
        (
            ["--rm-type", "remote", "--rm-url", "http://127.0.0.1:1/r", "--custom-rm-path", "", "--rm-timeout", "0"],
            "argument --rm-timeout: 0 is out of range: must be a number > 0",
        ),
        (
            ["--multi-turn", "--partial-rollout", "--rollout-batch-size", "4", "--over-sampling-batch-size", "8"],
            "--multi-turn and --partial-rollout",
        ),
        # numbers out of range are refused by argparse, naming the flag and the range, before any work
        (["--rollout-batch-size", "0"], "argument --rollout-batch-size: 0 is out of range: must be an integer >= 1"),
        (["--n-samples-per-prompt", "0"], "argument --n-samples-per-prompt: 0 is out of range"),
        (["--pass-k", "0"], "argument --pass-k: 0 must hold integers >= 1"),
        (
            ["--temperature", "-1"],
            "argument --temperature: -1 is out of range: must be a number > 0",
        ),
        (["--temperature", "nan"], "argument --temperature: nan is out of range"),
        (["--eps-clip-c", "0.5"], "argument --eps-clip-c: 0.5 is out of range: must be a number > 1"),
    ],
)
def test_bad_flags_fail_early(base_dir, flags, msg, monkeypatch):
    argv = ["--source", "sft", "--model-tag", "t", "--custom-rm-path", RM, *flags]
    if msg in CHECKED_WITH_THE_RANKS:  # a real process, as torchrun starts one
        env = {**os.environ, "NANORL_BASE_DIR": str(base_dir)}
        cmd = [sys.executable, "-m", "scripts.chat_rl", *argv]
        out = warm_python.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        code, stdout, stderr = out.returncode, out.stdout, out.stderr
    else:
        code, stdout, stderr = refused_before_setup(base_dir, argv, monkeypatch)
    assert code == 2 and msg in stderr and "saved checkpoint" not in stdout, stderr[-2000:]


def refused_before_setup(base_dir, argv, monkeypatch):
    """chat_rl with flags it must refuse before it sets up its ranks, run in this process (a new one would spend
    ~3 s on imports) -> (exit code, stdout, stderr). Reaching the setup fails the test."""

    def reached_setup(*a, **k):
        raise AssertionError("these flags were not refused before the ranks were set up")

    monkeypatch.setattr(common, "compute_init", reached_setup)
    return run_script("scripts.chat_rl", argv, {"NANORL_BASE_DIR": str(base_dir)})


@pytest.mark.parametrize("mode,nproc,flags", [("raise", 1, []), ("hang", 2, []), ("raise", 2, ["--async"])])
def test_failed_or_hung_rollout_saves_exits_nonzero_and_resumes(base_dir, mode, nproc, flags):
    # the 3rd call of the rollout function (eval, rollout 1, rollout 2) fails on the last sampling rank; a hang is cut
    # by --rollout-timeout. Every rank stops, the state after step 1 is saved, and the report names what was in
    # flight. The same command with --resume then redoes rollout 2 and finishes.
    gen = f"{ROOT / 'tests' / 'rl_fixture_reward.py'}:failing_generate"
    failing = 0 if flags else nproc - 1  # --async: rank 0 samples, rank 1 trains
    # SLOW_META: the lead's meta comes 2 s after the others have saved; no rank may exit before it is written
    env = {"FAIL_AT": "3", "FAIL_RANK": str(failing), "FAIL_MODE": mode, "SLOW_META": "2"}
    tag = f"fail_{mode}{'_async' if flags else ''}"
    cmd = ["--num-rollouts", "4", "--output-tag", tag, "--custom-generate-function-path", gen, "--rollout-timeout", "5"]
    out = run_rl(base_dir, *cmd, *flags, nproc=nproc, check=False, env=env)
    assert out.returncode != 0
    err = out.stdout + out.stderr
    assert f"rank {failing}: rollout 2 failed" in err and "in flight" in err and "'row':" in err, err[-3000:]
    assert ("RolloutTimeout" if mode == "hang" else "the sandbox crashed") in err
    assert (base_dir / "rl_checkpoints" / tag / "meta_000001.json").exists()
    hist, log = run_rl(base_dir, *cmd, *flags, "--resume", nproc=nproc, env={**env, "FAIL_AT": "1000"})
    assert "resumed from" in log and [h["step"] for h in hist["train"]] == [1, 2, 3, 4]


def test_async_two_processes_trains_and_ships_weights_every_step(base_dir):
    # rank 0 samples rollout k+1 while rank 1 trains on rollout k, then receives the new weights: the sampler's version
    # counts up every step, its weights equal the trainer's (checksums), and no sample is more than one version stale
    hist, log = run_rl(base_dir, "--num-rollouts", "3", "--output-tag", "async", "--async", "--use-tis", nproc=2)
    steps = hist["train"]
    assert [h["step"] for h in steps] == [1, 2, 3]
    assert [h["async/sampler_weight_version"] for h in steps] == [1, 2, 3]
    for h in steps:
        assert h["async/sampler_weight_checksum"] == h["async/trainer_weight_checksum"]
        assert h["train/grad_norm"] > 0 and h["train/tis_mean"] > 0
    assert [h["rollout/max_staleness"] for h in steps] == [0, 1, 1]
    assert len(hist["eval"]) == 2 and set(hist["idle"]) == {"idle_frac_sampling_ranks", "idle_frac_training_ranks"}
    assert (base_dir / "rl_checkpoints" / "async" / "model_000003.safetensors").exists()


def test_tis_without_rollout_logprobs_fails_naming_both_flags(base_dir):
    gen = f"{ROOT / 'tests' / 'rl_fixture_reward.py'}:no_logprob_generate"
    out = run_rl(
        base_dir,
        "--num-rollouts",
        "1",
        "--output-tag",
        "nolp",
        "--use-tis",
        "--custom-generate-function-path",
        gen,
        check=False,
    )
    assert (
        out.returncode != 0
        and "--use-tis needs the rollout's log-probs" in out.stderr
        and "--custom-generate-function-path" in out.stderr
    )


def test_slime_style_prompt_data_and_flags(base_dir, tmp_path):
    # a slime command line ports with its own flag names: a jsonl of prompts + labels, the chat template, slime's
    # names for the response length, the temperature, the number of rollouts and the eval and save intervals (as
    # `--flag value` and `--flag=value`); the built-in math grader scores it
    data = tmp_path / "prompts.jsonl"
    rows = [
        {"question": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in [(1, 2), (3, 4), (2, 2), (5, 1), (6, 2)]
    ]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    env = {**os.environ, "NANORL_BASE_DIR": str(base_dir), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "scripts.chat_rl",
        "--source",
        "sft",
        "--model-tag",
        "t",
        "--prompt-data",
        str(data),
        "--input-key",
        "question",
        "--label-key",
        "answer",
        "--apply-chat-template",
        "--rollout-max-response-len",
        "8",
        "--rollout-temperature",
        "0.9",
        "--num-rollout",
        "2",
        "--eval-interval=1",
        "--save-interval",
        "1",
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "2",
        "--rm-type",
        "math",
        "--eval-max-problems",
        "2",
        "--n-samples-per-eval-prompt",
        "2",
        "--pass-k",
        "1",
        "--output-tag",
        "slime",
        "--device-type",
        "cpu",
        "--engine-batch-size",
        "8",
    ]
    out = warm_python.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    hist = json.loads((base_dir / "report" / "rl_history.json").read_text())
    assert [h["step"] for h in hist["train"]] == [1, 2] and hist["train"][0]["rollout/response_len_mean"] <= 8
    assert [e["step"] for e in hist["eval"]] == [0, 1, 2]  # --eval-interval=1
    assert (base_dir / "rl_checkpoints" / "slime" / "model_000001.safetensors").exists()  # --save-interval 1
    assert "RL on 5 prompts" in out.stdout and "not held out" in out.stdout
    # a row without the prompt key is named by file and line
    data.write_text(json.dumps({"q": "x"}) + "\n")
    bad = warm_python.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and f"--prompt-data {data} line 1" in bad.stderr


def test_rollout_timeout_holds_whatever_the_reward_workers_do(base_dir):
    # the reward server never answers and each attempt may take 60 s, but --rollout-timeout 3 ends the eval (and so
    # the run) on time: the worker threads still blocked in their HTTP calls must not hold the exit. Timed from the
    # line printed just before the first eval, so a slow start-up on a busy machine does not count.
    import time

    env = {**os.environ, "NANORL_BASE_DIR": str(base_dir), "OMP_NUM_THREADS": "1"}
    with reward_server() as url:
        cmd = [
            sys.executable,
            "-u",
            "-m",
            "scripts.chat_rl",
            "--source",
            "sft",
            "--model-tag",
            "t",
            "--levels",
            "1",
            "--rollout-batch-size",
            "4",
            "--n-samples-per-prompt",
            "2",
            "--max-new-tokens",
            "8",
            "--eval-max-problems",
            "4",
            "--n-samples-per-eval-prompt",
            "2",
            "--pass-k",
            "1",
            "--device-type",
            "cpu",
            "--num-rollouts",
            "1",
            "--output-tag",
            "timeout",
            "--rm-type",
            "remote",
            "--rm-url",
            url + "/hang",
            "--rm-timeout",
            "60",
            "--rm-retries",
            "0",
            "--rollout-timeout",
            "3",
        ]
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines, t_ready = [], None
        for line in p.stdout:
            lines.append(line)
            if line.startswith("RL on "):
                t_ready = time.time()
        p.wait(timeout=120)
        took = time.time() - t_ready
    out = "".join(lines)
    assert p.returncode != 0 and "the eval ran past --rollout-timeout 3s" in out, out[-2000:]
    assert took < 3 + 8, took  # 3 s and the exit, far below the 60 s a blocked worker would hold it


def test_python_tool_rl_names_its_sandbox(base_dir, tool_model):
    # with the python tool the log says which sandbox runs the model's code (bubblewrap namespaces, or the guard)
    hist, log = run_rl(
        base_dir,
        "--model-tag",
        tool_model,
        "--num-rollouts",
        "1",
        "--output-tag",
        "pytool",
        "--multi-turn",
        "--tool",
        "python",
        "--max-turns",
        "1",
        "--max-new-tokens",
        "16",
    )
    from nanorl.execution import sandbox_mode

    assert f"python sandbox: {sandbox_mode()}" in log
    assert hist["train"][0]["rollout/tool_calls_mean"] > 0


def test_eval_reward_failures_are_not_the_rollouts(base_dir):
    # the eval's grader fails on every held-out prompt: the eval scores them as failures, but the training rollout's
    # failure counter only counts the training rollout's own rewards
    rm = f"{ROOT / 'tests' / 'rl_fixture_reward.py'}:eval_broken_reward"
    hist, log = run_rl(base_dir, "--num-rollouts", "1", "--output-tag", "evalbroken", rm=rm)
    assert "rewards failed" in log and hist["eval"][0]["eval/pass@1"] == 0.0
    assert hist["train"][0]["rollout/reward_failures"] == 0


@pytest.mark.slow
def test_fsdp_two_processes_equal_replicated_and_sample_the_trained_weights(base_dir):
    ref, _ = run_rl(base_dir, "--num-rollouts", "3", "--output-tag", "rep2", nproc=2)
    sharded, log = run_rl(
        base_dir, "--num-rollouts", "3", "--save-every", "2", "--output-tag", "fsdp2", "--fsdp", nproc=2
    )
    assert (base_dir / "rl_checkpoints" / "fsdp2" / "dcp_000002").is_dir()  # saved as shards
    assert [h["step"] for h in sharded["train"]] == [1, 2, 3]
    for a, b in zip(ref["train"], sharded["train"]):
        # fp32 on the CPU: the same samples (rewards, lengths exactly), losses to the order of the gradient sums
        for k in ("rollout/reward_mean", "rollout/response_len_mean"):
            assert a[k] == b[k], (k, a[k], b[k])
        for k in ("train/pg_loss", "train/grad_norm", "train/entropy"):
            assert abs(a[k] - b[k]) <= 1e-5 + 1e-4 * abs(a[k]), (k, a[k], b[k])
        # the sampler's weights are the trainer's: gathered from the shards before every rollout after the first
        assert b["train/train_rollout_logprob_abs_diff"] < 1e-5 and b["time/weight_gather"] > 0
    assert "time/weight_sync" not in sharded["train"][0]
    # "killed" after step 2: drop step 3's files, resume on 2 ranks from the DCP shards of step 2; step 3 is the same
    # bit for bit, and the processes exit cleanly (gloo's worker threads once aborted a resumed run at exit)
    ckpt = base_dir / "rl_checkpoints"
    shutil.copytree(ckpt / "fsdp2", ckpt / "fsdp2_resumed")
    for f in (ckpt / "fsdp2_resumed").glob("*000003*"):
        shutil.rmtree(f) if f.is_dir() else f.unlink()
    resumed, log = run_rl(
        base_dir,
        "--num-rollouts",
        "3",
        "--save-every",
        "2",
        "--output-tag",
        "fsdp2_resumed",
        "--fsdp",
        "--resume",
        nproc=2,
    )
    assert "resumed from" in log and [h["step"] for h in resumed["train"]] == [1, 2, 3]
    assert resumed["train"][2] == {
        **sharded["train"][2],
        **{k: v for k, v in resumed["train"][2].items() if k.startswith(("time/", "perf/"))},
    }
    # each rank's place in the prompt order is its own: another number of ranks is refused before anything loads
    out = run_rl(base_dir, "--num-rollouts", "4", "--output-tag", "fsdp2_resumed", "--resume", check=False)
    assert (
        out.returncode != 0 and "was written by 2 rank(s), this run has 1; resume with --nproc_per_node=2" in out.stderr
    ), out.stderr[-2000:]


@pytest.mark.parametrize(
    "flags,msg",
    [
        (["--fsdp", "--use-kl-loss", "--kl-loss-coef", "0.1"], "--fsdp does not work with --use-kl-loss / --kl-coef"),
        (["--fsdp", "--async"], "--fsdp does not work with --async"),
        (["--fsdp"], "--fsdp needs torchrun"),
        (["--cpu-offload"], "--activation-checkpointing and --cpu-offload only apply with --fsdp"),
    ],
)
def test_fsdp_flags_fail_early(base_dir, flags, msg, monkeypatch):
    argv = ["--source", "sft", "--model-tag", "t", "--custom-rm-path", RM, *flags]
    code, _, stderr = refused_before_setup(base_dir, argv, monkeypatch)
    assert code != 0 and msg in stderr, stderr[-2000:]
