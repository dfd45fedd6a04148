import json
from pathlib import Path

import pytest

import tasks.common
from nanorl import synthetic
from nanorl.tokenizer import validate_conversation
from tasks import (
    ARC,
    GSM8K,
    MMLU,
    CustomJSON,
    HumanEval,
    OfflineProblems,
    SmolTalk,
    SpellingBee,
    TaskMixture,
    TaskSequence,
    get_task,
)
from tasks.common import extract_answer
from tasks.gsm8k import answer_to_parts, parts_to_answer
from tasks.humaneval import build_program

GSM8K_DIR = Path(__file__).resolve().parents[1].parent / "shared/data/gsm8k"


def reference_text(conversation):
    """What a model that reproduced the reference would have written (tool parts included)."""
    content = conversation["messages"][-1]["content"]
    return content if isinstance(content, str) else "".join(p["text"] for p in content)


def write_jsonl(path, lines):
    path.write_text("\n".join(l if isinstance(l, str) else json.dumps(l) for l in lines) + "\n")
    return str(path)


# --- the Task interface ------------------------------------------------------------------------


def test_slicing_mixture_and_sequence():
    t = SpellingBee("train", size=10)
    assert len(t) == 10
    s = SpellingBee("train", size=10, start=2, stop=9, step=3)  # physical 2, 5, 8
    assert len(s) == 3 and s.get_example(1) == t.get_example(5) and s.get_example(2) == t.get_example(8)
    with pytest.raises(IndexError):
        s.get_example(3)
    a, b = SpellingBee("train", size=5), OfflineProblems("train", n=7)
    seq = TaskSequence([a, b])
    assert len(seq) == 12 and seq.get_example(0) == a.get_example(0) and seq.get_example(5) == b.get_example(0)
    mix = TaskMixture([a, b], seed=1)
    got = [json.dumps(mix.get_example(i), sort_keys=True) for i in range(len(mix))]
    want = [json.dumps(t.get_example(i), sort_keys=True) for t in (a, b) for i in range(len(t))]
    assert sorted(got) == sorted(want) and got != want  # everything once, interleaved
    assert got == [json.dumps(TaskMixture([a, b], seed=1).get_example(i), sort_keys=True) for i in range(12)]


def test_bad_task_name_lists_the_valid_ones():
    with pytest.raises(ValueError) as e:
        get_task("gsm8", "test")
    for name in ("gsm8k", "offline", "mmlu", "arc-easy", "humaneval", "spellingbee", "customjson", "smoltalk"):
        assert name in str(e.value)
    assert get_task("SpellingBee", "test").eval_type == "generative"  # case-insensitive


# --- GSM8K ---------------------------------------------------------------------------------------


def test_gsm8k_annotation_round_trip_on_a_made_up_answer():
    answer = "She sold 48/2 = <<48/2=24>>24 clips.\nIn all 48+24 = <<48+24=72>>72.\n#### 72"
    parts = answer_to_parts(answer)
    assert [p["type"] for p in parts] == ["text", "python", "python_output", "text", "python", "python_output", "text"]
    assert parts[1]["text"] == "48/2" and parts[2]["text"] == "24" and parts[3]["text"] == "24 clips.\nIn all 48+24 = "
    assert parts_to_answer(parts) == answer
    assert extract_answer("so #### 1,080 dollars") == "1080" and extract_answer("#### -3.0") == "-3"
    assert extract_answer("no marker 12") is None


@pytest.mark.parametrize(
    "text,want",
    [
        ("#### 18", "18"),
        ("#### 18.5", "18.5"),
        ("#### 18.50", "18.5"),
        ("#### 18.0", "18"),
        ("#### $1,080.", "1080"),
        ("#### 007", "7"),
        ("#### -0", "0"),
        ("####18", "18"),
        ("#### 18\nHope it helps: 5", "18"),
        ("#### 3\n#### 4", "4"),
        ("The answer is 18.", None),
        ("#### eighteen", None),
        ("#### 3/4", None),
        ("#### 18%", None),
        ("#### 12,34", None),
        ("####", None),
        (None, None),
        ("#### " + "9" * 400, "9" * 400),  # exact strings: no float, no OverflowError
    ],
)
def test_gsm8k_answer_convention(text, want):
    # the number right after the last ####, whole; anything else is no answer (wrong)
    assert extract_answer(text) == want


def test_gsm8k_row_without_an_answer_names_file_and_row(tmp_path):
    good = {"question": "1+1?", "answer": "1+1 = <<1+1=2>>2\n#### 2"}
    path = write_jsonl(tmp_path / "test.jsonl", [good, good, {"question": "no answer"}])
    with pytest.raises(ValueError, match=r"test\.jsonl: row 3 has no 'answer'"):
        GSM8K("test", path=path)
    path = write_jsonl(tmp_path / "train.jsonl", [good, {"question": "q", "answer": "no final line"}])
    with pytest.raises(ValueError, match=r"train\.jsonl: row 2 has an 'answer' without a final '#### N'"):
        GSM8K("train", path=str(tmp_path))


@pytest.mark.skipif(not GSM8K_DIR.is_dir(), reason=f"GSM8K not found at {GSM8K_DIR} (shared test data)")
@pytest.mark.parametrize("split", ["train", "test"])
def test_gsm8k_loader_and_grader_on_real_data(split):
    task = GSM8K(split, path=str(GSM8K_DIR))
    assert len(task) == {"train": 7473, "test": 1319}[split]
    raw = [json.loads(l) for l in (GSM8K_DIR / f"{split}.jsonl").read_text().splitlines()]
    n_tool_calls = 0
    for i in range(len(task)):
        conv = task.get_example(i)
        validate_conversation(conv)
        parts = conv["messages"][-1]["content"]
        n_tool_calls += sum(p["type"] == "python" for p in parts)
        assert parts_to_answer(parts) == raw[i]["answer"]  # the tool-call conversion loses nothing
        ref = reference_text(conv)
        assert task.evaluate(conv, ref), i  # every reference answer grades as correct
        assert task.reward(conv, ref) == 1.0
        wrong = str(int(float(conv["label"])) + 1)
        assert not task.evaluate(conv, ref.rsplit("####", 1)[0] + "#### " + wrong)
        assert not task.evaluate(conv, ref.rsplit("####", 1)[0])  # no final answer, no credit
    assert n_tool_calls > len(task)  # the calculator annotations did become tool calls


def test_hub_task_without_network_or_path_says_what_to_do(monkeypatch):
    import datasets

    def offline(*a, **k):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub")

    monkeypatch.setattr(tasks.common, "hub_reachable", lambda *a, **k: False)
    monkeypatch.setattr(datasets, "load_dataset", offline)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RuntimeError) as e:
        GSM8K("test")
    assert "openai/gsm8k" in str(e.value) and "--task-path" in str(e.value)
    with pytest.raises(RuntimeError, match="--task-path"):
        get_task("mmlu", "test")


# --- local files for Hub tasks -------------------------------------------------------------------


def test_mmlu_and_arc_from_local_files(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {"question": "2+2?", "subject": "math", "choices": ["3", "4", "5", "6"], "answer": 1},
        {"question": "Sky?", "subject": "misc", "choices": ["green", "red", "blue", "black"], "answer": 2},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "test.parquet")
    mmlu = MMLU("test", path=str(tmp_path))
    assert mmlu.eval_type == "categorical" and len(mmlu) == 2
    conv = mmlu.get_example(1)
    assert conv["letters"] == ["A", "B", "C", "D"] and conv["label"] == "C"
    assert "\nC. blue" in conv["messages"][0]["content"] and conv["messages"][1]["content"] == "C"
    assert mmlu.evaluate(conv, " C") and mmlu.evaluate(conv, "C. blue") and not mmlu.evaluate(conv, "B")
    aux = tmp_path / "aux.jsonl"  # auxiliary_train nests each row under "train" on the Hub
    write_jsonl(aux, [{"train": rows[0]}])
    assert MMLU("train", subset="auxiliary_train", path=str(aux)).get_example(0)["label"] == "B"
    arc_rows = [
        {
            "id": "x",
            "question": "Which?",
            "choices": {"text": ["a", "b", "c"], "label": ["1", "2", "3"]},
            "answerKey": "3",
        }
    ]
    arc = ARC("ARC-Challenge", "train", path=write_jsonl(tmp_path / "train.jsonl", arc_rows))
    assert arc.get_example(0)["label"] == "C" and arc.get_example(0)["letters"] == ["A", "B", "C"]


def test_local_directory_without_the_split_is_a_clear_error(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"question": "q", "answer": "#### 1"}])
    with pytest.raises(FileNotFoundError, match="test.jsonl"):
        GSM8K("test", path=str(tmp_path))


def test_smoltalk_skips_conversations_that_do_not_alternate(tmp_path, capsys):
    good = {
        "messages": [
            {"role": "system", "content": "be nice"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
        ]
    }
    bad = {"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}]}
    task = SmolTalk("train", path=write_jsonl(tmp_path / "s.jsonl", [good, bad, good, "{oops"]))
    assert len(task) == 2 and task.bad.count == 1 and task.bad.first_line == 2
    out = capsys.readouterr().out
    assert "skipped 1 malformed row(s)" in out and "first at line 2" in out and "first at line 4: not JSON" in out


# --- CustomJSON -----------------------------------------------------------------------------------


def test_customjson_counts_malformed_rows_with_the_first_bad_line(tmp_path, capsys):
    ok = {"messages": [{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "nanorl."}]}
    lines = [
        ok,
        [{"role": "user", "content": "bare list"}, {"role": "assistant", "content": "fine"}],
        '{"messages": [{"role": "user", "content": "cut off"',  # line 3: not JSON
        "",  # blank lines are not errors
        {"messages": [{"role": "assistant", "content": "I speak first"}]},  # line 5: wrong order
        {
            "messages": [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": [{"type": "sql", "text": "x"}]},
            ]
        },
        ok,
    ]
    task = CustomJSON(path=write_jsonl(tmp_path / "identity.jsonl", lines))
    assert len(task) == 3 and task.skipped == 3 and task.first_bad_line == 3
    assert "line 3" in capsys.readouterr().out
    # only role faults: the first bad line is the first non-alternating conversation
    task = CustomJSON(path=write_jsonl(tmp_path / "b.jsonl", [ok, ok, lines[4], ok]))
    assert task.skipped == 1 and task.first_bad_line == 3
    with pytest.raises(ValueError, match="no valid conversations"):
        CustomJSON(path=write_jsonl(tmp_path / "c.jsonl", ["nope"]))
    with pytest.raises(ValueError, match="path"):
        get_task("customjson", "train")


# --- generated tasks ------------------------------------------------------------------------------


def test_spellingbee_references_are_right_and_splits_disjoint():
    pairs = {}
    for split in ("train", "test"):
        task = SpellingBee(split, size=300)
        pairs[split] = set()
        for i in range(len(task)):
            conv = task.get_example(i)
            validate_conversation(conv)
            q = conv["messages"][0]["content"]
            word, letter = conv["word"], conv["letter"]
            assert word in synthetic.WORDS and word in q and (f" {letter}" in q or f"'{letter}'" in q)
            text = reference_text(conv)
            assert conv["label"] == str(word.count(letter))
            assert task.evaluate(conv, text) and not task.evaluate(conv, text.rsplit("####", 1)[0] + "#### 99")
            pairs[split].add((word, letter))
    assert pairs["train"].isdisjoint(pairs["test"])


def test_offline_problems_grade_their_references():
    for split in ("train", "test"):
        task = get_task("offline", split, n=200)
        for i in range(len(task)):
            conv = task.get_example(i)
            validate_conversation(conv)
            assert task.evaluate(conv, reference_text(conv))
            assert not task.evaluate(conv, "#### " + str(int(conv["label"]) + 1))
    # every other problem solved with tool calls by default
    kinds = [isinstance(task.get_example(i)["messages"][1]["content"], list) for i in range(4)]
    assert kinds == [True, False, True, False]
    assert {p["question"] for p in OfflineProblems("train", n=500).problems}.isdisjoint(
        {p["question"] for p in OfflineProblems("test", n=200).problems}
    )


# --- HumanEval (grading runs the sandbox) -----------------------------------------------------------

FAKE_HUMANEVAL = {
    "task_id": "fake/0",
    "entry_point": "add",
    "prompt": 'from typing import List\n\n\ndef add(xs: List[int]) -> int:\n    """Sum of xs."""\n',
    "canonical_solution": "    return sum(xs)\n",
    "test": "def check(candidate):\n    assert candidate([1, 2, 3]) == 6\n    assert candidate([]) == 0\n",
}


def test_humaneval_program_assembly():
    body = build_program(FAKE_HUMANEVAL, "    return sum(xs)\n")
    assert body.startswith(FAKE_HUMANEVAL["prompt"]) and body.rstrip().endswith("check(add)")
    full = build_program(
        FAKE_HUMANEVAL, "Here:\n```python\ndef add(xs: List[int]) -> int:\n    return sum(xs)\n```\nDone."
    )
    assert "from typing import List" in full and "Here:" not in full and "Done." not in full


def test_humaneval_grades_with_the_sandbox(tmp_path):
    pytest.importorskip("nanorl.execution", reason="the sandbox (nanorl/execution.py) is not merged yet")
    task = HumanEval(path=write_jsonl(tmp_path / "test.jsonl", [FAKE_HUMANEVAL]))
    conv = task.get_example(0)
    assert task.evaluate(conv, reference_text(conv))  # the canonical solution passes
    assert task.evaluate(conv, "```python\ndef add(xs):\n    return sum(xs)\n```")
    assert not task.evaluate(conv, "    return 0\n")  # wrong answer fails its tests
    assert not task.evaluate(conv, "    while True: pass\n")  # and so does a hang (the sandbox's timeout)
