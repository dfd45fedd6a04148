"""The report card, read back from real stage outputs: a tokenizer trained by tok_train, tiny MID/SFT checkpoints,
chat_eval run greedily and sampled, then nanorl.report stitching report.md."""

import json
import os
import re
import sys
from pathlib import Path

import pytest
import warm_python  # pytest puts tests/ on sys.path

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("report")
    env = {**os.environ, "NANORL_BASE_DIR": str(d), "OMP_NUM_THREADS": "1"}
    warm_python.run(
        [sys.executable, "-m", "scripts.tok_train", "--vocab-size", "600", "--max-chars", "300000"],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
    )
    import torch

    from nanorl.checkpoint import save_checkpoint
    from nanorl.gpt import GPTConfig, build_model
    from nanorl.tokenizer import get_tokenizer

    cfg = GPTConfig(
        sequence_len=256, vocab_size=get_tokenizer(str(d)).vocab_size, n_layer=1, n_head=1, n_kv_head=1, n_embd=32
    )
    for seed, source in enumerate(["mid", "sft"]):  # two different untrained models: what matters here is the labels
        torch.manual_seed(seed)
        save_checkpoint(
            str(d / f"{source}_checkpoints" / "t"),
            0,
            build_model(cfg, "cpu").state_dict(),
            meta={"model_config": cfg.to_dict()},
        )
    return d


def chat_eval(base_dir, *flags, monkeypatch, capsys):
    """Run scripts.chat_eval in this process (no interpreter start per run) -> (exit code, stdout, stderr)."""
    from scripts import chat_eval as script

    monkeypatch.setenv("NANORL_BASE_DIR", str(base_dir))
    monkeypatch.setattr(sys, "argv", ["chat_eval", *flags])
    try:
        script.main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
        if not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_report_card_from_stage_outputs_has_no_mislabelled_row(base_dir, tmp_path, monkeypatch, capsys):
    common = ["-a", "offline", "-x", "6", "-m", "6", "--levels", "1,2"]
    for flags in (["-i", "mid"], ["-i", "sft"], ["-i", "sft", "-n", "2", "-t", "1.0"], ["-i", "mid", "-t", "0.7"]):
        code, out, err = chat_eval(base_dir, *flags, *common, monkeypatch=monkeypatch, capsys=capsys)
        assert code == 0, out[-2000:] + err[-2000:]
        # per-problem progress with the running accuracy, the last line at 6/6
        assert re.search(r"^\[offline\] 6/6 problems, running accuracy \d\.\d{4}$", out, re.M), out
        assert "ChatCORE" not in out  # computed over its own six tasks only, never over the offline one
    from nanorl import report

    # the RL stage's rows, as chat_rl writes them with the helper (its own held-out eval: 5 prompts x 4 samples)
    history = [
        {"step": 0, "eval/pass@1": 0.25, "eval/pass@4": 0.5},
        {"step": 8, "eval/pass@1": 0.5, "eval/pass@4": 0.75},
    ]
    report.log_section(
        "Chat RL",
        [{"reward": "task:OfflineProblems"}, report.rl_eval_rows(history, "offline levels 1,2", 5, 4, 1.0)],
        config={"num_rollouts": 8},
    )
    out_path = tmp_path / "out" / "report.md"
    out_path.parent.mkdir()
    report.generate(str(out_path), wall_time_s=90)
    text = out_path.read_text()

    card = json.loads((base_dir / "report" / "report_card.json").read_text())
    assert set(card) == {"MID", "SFT"}  # each number under the stage that measured it
    rows = re.findall(r"^\| (.+?) \| (.+) \|$", text.split("## Report card")[1].split("\n## ")[0], re.M)
    labels = {r[0]: r[1].split(" | ") for r in rows if r[0] not in ("metric",) and not r[0].startswith("---")}
    greedy = "offline levels 1,2 accuracy (greedy, 6 problems)"
    sampled = [f"offline levels 1,2 pass@{k} (T=1, 6 problems x 2 samples)" for k in (1, 2)]
    one_sampled = "offline levels 1,2 pass@1 (T=0.7, 6 problems x 1 samples)"  # one sample at T > 0 is not greedy
    assert set(labels) == {greedy, *sampled, one_sampled}, labels
    assert labels[one_sampled][1] != "-" and labels[one_sampled][2] == "-"
    # greedy: MID and SFT; sampled: only SFT ran it; BASE and RL measured nothing here
    assert (
        labels[greedy][0] == "-"
        and labels[greedy][3] == "-"
        and all(re.fullmatch(r"\d\.\d{4}", v) for v in labels[greedy][1:3])
    )
    for row in sampled:
        assert labels[row][:2] == ["-", "-"] and re.fullmatch(r"\d\.\d{4}", labels[row][2]) and labels[row][3] == "-"
        assert float(labels[row][2]) == pytest.approx(card["SFT"][row], abs=5e-5)
    assert "ChatCORE" not in text
    # the RL section's pass@k figures carry their sizes
    assert "- offline levels 1,2 pass@1 (T=1, 5 problems x 4 samples) before (step 0): 0.25" in text
    assert "- offline levels 1,2 pass@4 (T=1, 5 problems x 4 samples) after (step 8): 0.75" in text
    # nanochat's environment header
    env = text.split("## Environment")[1].split("\n## ")[0]
    assert re.search(r"- git commit: [0-9a-f]{4,} \((clean|dirty: uncommitted changes)\)", env), env
    for key in ("- RAM: ", "- torch: ", "- GPUs: ", "- python: "):
        assert key in env, key
    # sections in pipeline order, each with its stage's flags
    heads = re.findall(r"^## (.+)$", text, re.M)
    order = [
        "Environment",
        "Report card",
        "Tokenizer training",
        "Chat eval mid",
        "Chat eval mid sampled",
        "Chat eval sft",
        "Chat eval sft sampled",
        "Chat RL",
        "Time and cost",
    ]
    assert [h for h in heads if h in order] == order, heads
    for section in ("Tokenizer training", "Chat eval mid", "Chat eval sft sampled"):
        body = text.split(f"## {section}\n")[1].split("\n## ")[0]
        assert "hyperparameters:" in body, section
    assert (
        "- max_problems: 6" in text.split("## Chat eval mid\n")[1]
        and "- num_samples: 2" in text.split("## Chat eval sft sampled\n")[1]
    )
    assert "- graded by: task:OfflineProblems" in text
    assert "- total wall time: 1.5 min (the sum of the stages' own times)" in text
    # plots live beside the sections, not loose next to report.md
    assert not list(out_path.parent.glob("*.png"))
    for link in re.findall(r"!\[[^]]*\]\(([^)]+)\)", text):
        assert (out_path.parent / link).resolve().parent == (base_dir / "report").resolve(), link


@pytest.mark.parametrize(
    "flags,msg",
    [
        (["-x", "0"], "argument -x/--max-problems: 0 is out of range: must be an integer >= 1"),
        (["-x", "-1"], "argument -x/--max-problems: -1 is out of range"),
        (["-n", "0"], "argument -n/--num-samples: 0 is out of range"),
    ],
)
def test_chat_eval_rejects_bad_counts(base_dir, flags, msg, monkeypatch, capsys):
    code, _, err = chat_eval(base_dir, "-i", "sft", *flags, monkeypatch=monkeypatch, capsys=capsys)
    assert code == 2 and msg in err, err


def test_chat_eval_names_the_bad_gsm8k_row(base_dir, tmp_path, monkeypatch, capsys):
    rows = [{"question": "1+1?", "answer": "1+1=2\n#### 2"}, {"question": "2+2?"}]
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, _, err = chat_eval(
        base_dir, "-i", "sft", "-a", "gsm8k", "--task-path", f"gsm8k={tmp_path}", monkeypatch=monkeypatch, capsys=capsys
    )
    assert code == 1 and err.startswith(f"gsm8k: {tmp_path / 'test.jsonl'}: row 2 has no 'answer'"), (
        err
    )  # one line, no traceback


def test_eval_labels_and_section_order():
    from nanorl.report import SECTION_ORDER, _order, eval_label

    assert eval_label("GSM8K", "accuracy", 1319) == "GSM8K accuracy (greedy, 1319 problems)"
    assert eval_label("offline", "pass@4", 200, 4, 1.0) == "offline pass@4 (T=1, 200 problems x 4 samples)"
    assert eval_label("offline", "pass@1", 200, 1, 0.7) == "offline pass@1 (T=0.7, 200 problems x 1 samples)"
    names = [
        "chat-rl",
        "chat-eval-sft-sampled",
        "zzz-other",
        "chat-eval-sft",
        "midtraining",
        "tokenizer-training",
        "chat-eval-mid-sampled",
        "base-model-training",
        "chat-sft",
        "chat-eval-rl",
    ]
    assert sorted(names, key=lambda n: _order(n, SECTION_ORDER)) == [
        "tokenizer-training",
        "base-model-training",
        "midtraining",
        "chat-eval-mid-sampled",
        "chat-sft",
        "chat-eval-sft",
        "chat-eval-sft-sampled",
        "chat-rl",
        "chat-eval-rl",
        "zzz-other",
    ]


def test_adhoc_runs_leave_the_pipelines_report_alone(tmp_path, monkeypatch, capsys):
    from nanorl import report

    monkeypatch.setenv("NANORL_BASE_DIR", str(tmp_path))
    monkeypatch.delenv("NANORL_PIPELINE", raising=False)
    # no finished stage yet: nothing to protect, a hand-run stage writes to report/ itself
    assert report.log_section("Chat eval sft", [{"a": 1}]) == str(tmp_path / "report" / "chat-eval-sft.md")
    # speedrun.sh's stages (NANORL_PIPELINE=1), each leaving its seconds in done/
    monkeypatch.setenv("NANORL_PIPELINE", "1")
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "base_train").write_text("30\n")
    (tmp_path / "done" / "tok_train").write_text("120\n")
    os.utime(tmp_path / "done" / "base_train", (2e9, 2e9))  # finished last: listed last, not alphabetically
    report.log_section("Chat eval sft", [{"pipeline accuracy": 0.5}])
    report.record_metrics("SFT", {"offline accuracy (greedy, 200 problems)": 0.5})
    report.log_json("rl_history", {"train": [], "eval": [], "who": "pipeline"})
    # the same stage by hand: its section, card row and plot data go apart, and it says where
    monkeypatch.delenv("NANORL_PIPELINE")
    capsys.readouterr()
    path = report.log_section("Chat eval sft", [{"adhoc accuracy": 0.25}])
    assert path == str(tmp_path / "report" / "adhoc" / "chat-eval-sft.md")
    assert f"outside speedrun.sh, so its section went to {path}" in capsys.readouterr().out
    report.record_metrics("SFT", {"offline accuracy (greedy, 100 problems)": 0.25})
    report.log_json("rl_history", {"train": [], "eval": [], "who": "adhoc"})
    assert report.load_json("rl_history")["who"] == "adhoc"  # an ad-hoc resume reads its own data
    assert report.load_json("rl_history", folder=report.report_dir())["who"] == "pipeline"
    out = tmp_path / "report.md"
    report.generate(str(out))  # no --wall-time: summed from done/
    text = out.read_text()
    main, adhoc = text.split("\n## Ad-hoc runs\n")
    assert "- pipeline accuracy: 0.5" in main and "adhoc accuracy" not in main
    assert "| offline accuracy (greedy, 200 problems) | - | - | 0.5000 | - |" in main
    assert "100 problems" not in main
    assert (
        "Total wall time: 2.5 min in the stages (setup and installs not included)."
        in main.split("## Report card")[1].split("\n## ")[0]
    )
    assert "- total wall time: 2.5 min (the sum of the stages' own times)" in main
    assert "- per stage: tok_train 2.0 min, base_train 0.5 min" in main
    assert "### Chat eval sft\n" in adhoc and "- adhoc accuracy: 0.25" in adhoc
    assert "| offline accuracy (greedy, 100 problems) | - | - | 0.2500 | - |" in adhoc


def test_flag_values_in_words_and_data_seen(tmp_path, monkeypatch):
    from nanorl import report

    monkeypatch.setenv("NANORL_BASE_DIR", str(tmp_path))
    config = {
        "run": "dummy",
        "device_type": None,
        "model_tag": None,
        "num_iterations": 80,
        "num_epochs": 1.0,
        "no_compile": True,
        "resume": False,
        "lr": 0.02,
        "other": None,
    }
    text = open(report.log_section("Chat SFT", [{"data seen": report.data_seen(700, 20000, 2)}], config=config)).read()
    for line in (
        "- run: dummy (no wandb logging)",
        "- device_type: autodetect (CUDA if available, else CPU)",
        "- model_tag: the tag saved most recently",
        "- num_epochs: 1 (not used: --num-iterations 80 sets the length)",
        "- no_compile: yes",
        "- resume: no",
        "- lr: 0.02",
        "- other: not set (the default)",
        "- data seen: 1,400 conversations, 7.0% of an epoch of 20,000",
    ):
        assert line in text, line
    assert "None" not in text
    # with --num-iterations 0 the epochs do set the length
    assert report.config_value("num_epochs", 2, {"num_iterations": 0}) == "2"
    assert report.config_value("run", "sft-1", {}) == "sft-1"


def test_environment_names_cpu_os_and_threads(tmp_path, monkeypatch):
    from nanorl import report

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R)  Platinum 8480+\n")
    assert report._cpu_model(str(info)) == "Intel(R) Xeon(R) Platinum 8480+"
    assert report._cpu_model(str(tmp_path / "missing")) is None
    import platform

    import torch

    monkeypatch.setattr(report, "_cpu_model", lambda: "Intel(R) Xeon(R) Platinum 8480+")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    env = report._environment()
    assert env["CPU"] == f"Intel(R) Xeon(R) Platinum 8480+, {os.cpu_count()} logical cores"
    assert env["torch threads"] == f"{torch.get_num_threads()} (OMP_NUM_THREADS=3)"
    assert (
        env["OS"].endswith(f"({platform.system()} {platform.release()}-{platform.machine()})")
        or env["OS"] == f"{platform.system()} {platform.release()}-{platform.machine()}"
    )


def test_sft_section_says_how_much_data_it_saw(base_dir, tmp_path):
    """A short SFT run (2 steps of 4 rows) reports the conversations it went through, not just num_epochs: 1."""
    import shutil

    for d in ("tokenizer", "mid_checkpoints"):
        shutil.copytree(base_dir / d, tmp_path / d)
    env = {**os.environ, "NANORL_BASE_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    env.pop("NANORL_PIPELINE", None)
    out = warm_python.run(
        [
            sys.executable,
            "-m",
            "scripts.chat_sft",
            "--source",
            "mid",
            "--num-iterations",
            "2",
            "--num-examples",
            "200",
            "--device-batch-size",
            "4",
            "--max-seq-len",
            "64",
            "--eval-every",
            "1000",
            "--eval-tokens",
            "256",
            "--device-type",
            "cpu",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    text = (tmp_path / "report" / "chat-sft.md").read_text()
    m = re.search(r"^- data seen: (\d+) conversations, (\d+\.\d)% of an epoch of ([\d,]+)$", text, re.M)
    assert m, text
    train = int(re.search(r"^- train conversations: (\d+)$", text, re.M).group(1))
    assert int(m.group(3).replace(",", "")) == train
    seen = int(m.group(1))
    assert 1 <= seen < train and float(m.group(2)) == pytest.approx(100 * seen / train, abs=0.05)
    assert "- num_epochs: 1 (not used: --num-iterations 2 sets the length)" in text
    assert f"report: section written to {tmp_path / 'report' / 'chat-sft.md'}" in out.stdout
    curve = json.loads((tmp_path / "report" / "sft_val_loss.json").read_text())  # for its loss plot
    assert curve["step"] == [0, 2] and len(curve["loss"]) == 2 and all(v > 0 for v in curve["loss"])


def test_loss_plots_and_their_links_survive_moving_the_report(tmp_path, monkeypatch):
    from nanorl import report

    monkeypatch.setenv("NANORL_BASE_DIR", str(tmp_path / "base"))
    report.log_json("base_train_loss", {"step": [1, 2, 3], "loss": [9.0, 8.0, 7.5]})
    report.log_json("mid_val_loss", {"step": [0, 40, 80], "loss": [3.0, 2.5, 2.2]})
    report.log_json("sft_val_loss", {"step": [0, 80], "loss": [2.2, 2.0]})
    first = tmp_path / "a" / "report.md"
    first.parent.mkdir()
    report.generate(str(first))
    moved = tmp_path / "elsewhere" / "deeper" / "report.md"
    moved.parent.mkdir(parents=True)
    first.rename(moved)
    links = re.findall(r"!\[([^]]*)\]\(([^)]+)\)", moved.read_text())
    assert [alt for alt, _ in links] == ["Base model training loss", "Midtraining held-out loss", "SFT held-out loss"]
    for _, link in links:
        png = (moved.parent / link).resolve()
        assert png.parent == (tmp_path / "base" / "report").resolve() and png.stat().st_size > 1000, link
    assert "Total wall time" not in moved.read_text()  # no done/ markers, no --wall-time: no made-up time


def test_tokenizer_row_explains_a_smaller_vocab(tmp_path):
    from nanorl.report import vocab_words

    assert vocab_words(4096, 4096) == "4,096"
    env = {**os.environ, "NANORL_BASE_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    env.pop("NANORL_PIPELINE", None)
    out = warm_python.run(
        [sys.executable, "-m", "scripts.tok_train", "--vocab-size", "30000", "--max-chars", "20000"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    got = int(re.search(r"vocab (\d+), saved", out.stdout).group(1))
    assert got < 30000
    text = (tmp_path / "report" / "tokenizer-training.md").read_text()
    assert (
        f"- vocab_size: {got:,} (asked for 30,000: the training text ran out of byte pairs to merge before that; "
        "more text, --max-chars, gives a larger one)"
    ) in text, text


def test_a_later_report_keeps_the_runs_environment_and_says_what_was_outside_it(tmp_path, monkeypatch, capsys):
    """The pipeline's stages record their environment, and a report stitched later in another shell (other threads,
    no NANORL_PIPELINE) shows theirs; a hand-run stage says which command puts it in report.md; the setup time
    (venv, installs) given once is shown beside the stages' time and kept for later reports."""
    from nanorl import report

    monkeypatch.setenv("NANORL_BASE_DIR", str(tmp_path))
    monkeypatch.setenv("NANORL_PIPELINE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "chat_rl").write_text("840\n")
    report.log_section("Chat RL", [{"reward": 0.5}])
    out = tmp_path / "report.md"
    report.generate(str(out), setup_time_s=90)
    monkeypatch.setenv("OMP_NUM_THREADS", "7")  # another shell, later
    monkeypatch.delenv("NANORL_PIPELINE")
    capsys.readouterr()
    report.log_section("Chat eval rl", [{"accuracy": 0.25}])
    said = capsys.readouterr().out
    assert "`python -m nanorl.report` rewrites report.md with it under 'Ad-hoc runs'" in said
    report.generate(str(out))
    text = out.read_text()
    env = text.split("## Environment")[1].split("\n## ")[0]
    assert "(OMP_NUM_THREADS=3)" in env and "OMP_NUM_THREADS=7" not in env and "- recorded: by the stages" in env
    card = text.split("## Report card")[1].split("\n## ")[0]
    assert (
        "Total wall time: 14.0 min in the stages (the last speedrun.sh's setup (venv, installs) took 1.5 min more)."
        in card
    )
    assert (
        "- total wall time: 14.0 min (the sum of the stages' own times; the last setup (venv, installs): 1.5 min"
        in text
    )
