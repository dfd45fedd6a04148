import json
import time
from collections import Counter
from pathlib import Path

import pytest
from rl_fixture_server import RewardHandler
from rl_fixture_server import reward_server as serve_rewards

from nanorl.remote_rewards import remote_rewards
from nanorl.rewards import (
    boxed_reward,
    exact_match,
    extract_answer,
    extract_choice,
    f1_reward,
    format_reward,
    make_reward,
    math_reward,
    mc_reward,
    normalize_number,
    parse_rm_type,
    safe_reward,
    set_rewards,
)
from nanorl.rollout import Sample
from tasks import ARC, OfflineChat, OfflineProblems, SpellingBee
from tasks import GSM8K as GSM8KTask

GSM8K = Path(__file__).resolve().parents[1].parent / "shared/data/gsm8k"


# -----------------------------------------------------------------------------------------------
# answers and numbers


@pytest.mark.parametrize(
    "response,label,want",
    [
        ("so 3 + 4 = 7\n#### 7", "7", 1.0),
        ("#### 1,000", "1000", 1.0),
        ("#### 1,000", "1,000", 1.0),
        ("#### 1,234,567", "1234567", 1.0),
        ("#### -5", "-5", 1.0),
        ("#### 5", "-5", 0.0),
        ("The temperature dropped to -12 degrees.", "-12", 1.0),
        ("#### 2.50", "2.5", 1.0),
        ("#### 12.0", "12", 1.0),
        ("#### 0", "0", 1.0),
        ("#### 10", "1", 0.0),
        ("#### 3/4", "0.75", 1.0),
        ("#### 22/7", "22/7", 1.0),
        ("#### 1/3", "0.3333333333", 1.0),
        ("#### 0.333333", "1/3", 1.0),  # within 1e-6 relative
        ("#### 0.33", "1/3", 0.0),
        ("#### 192000001", "192000000", 0.0),  # whole numbers compare exactly
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("so the answer is $\\boxed{\\dfrac{3}{4}}$.", "3/4", 1.0),
        ("\\boxed{-\\frac{1}{2}}", "-0.5", 1.0),
        ("\\boxed{{12}}", "12", 1.0),
        ("first \\boxed{3} then \\boxed{4}", "4", 1.0),
        ("The answer is $5.00", "5", 1.0),
        ("#### $5.00", "5", 1.0),
        ("#### \\$18", "18", 1.0),
        ("He has 12 apples.", "12", 1.0),
        ("#### 12 apples.", "12", 1.0),
        ("#### 7.", "7", 1.0),
        ("12 apples, then 13 apples", "13", 1.0),  # the last number
        ("12 apples, then 13 apples", "12", 0.0),
        ("first #### 3 then #### 4", "4", 1.0),  # the last ####
        ("#### 4\nHope this helps! 5 stars.", "4", 1.0),  # only the #### line counts
        ("#### 45%", "45", 1.0),
        ("#### 45%", "0.45", 1.0),
        ("x = 3.14159", "3.14159", 1.0),
        ("5-3=2", "2", 1.0),
        ("no number at all", "3", 0.0),
        ("", "3", 0.0),
        (None, "3", 0.0),
        ("#### 7", "", 0.0),  # an unusable label never pays
        ("#### 7", 7, 1.0),  # numeric labels
        ("#### 7", "Tom has 3 + 4 = 7.\n#### 7", 1.0),  # a worked solution as the label
    ],
)
def test_math_reward_tricky(response, label, want):
    assert math_reward(response, label) == want


@pytest.mark.parametrize(
    "text,want",
    [
        ("1,234", 1234.0),
        ("-5", -5.0),
        ("+5", 5.0),
        ("3.50", 3.5),
        ("12.0", 12.0),
        (".5", 0.5),
        ("3/4", 0.75),
        ("-3/4", -0.75),
        ("\\frac{3}{4}", 0.75),
        ("\\frac12", 0.5),
        ("\\boxed{7}", 7.0),
        ("$12", 12.0),
        ("$1,234.50", 1234.5),
        ("-$5", -5.0),
        ("12 apples", 12.0),
        ("12.", 12.0),
        ("45%", 45.0),
        ("1{,}000", 1000.0),
        ("x = 7", 7.0),
        ("1/0", None),
        ("abc", None),
        ("", None),
        (None, None),
        (3, 3.0),
        (float("nan"), None),
    ],
)
def test_normalize_number(text, want):
    assert normalize_number(text) == want


@pytest.mark.parametrize(
    "text,want",
    [
        ("a 1 b 2", "2"),
        ("x \\boxed{a{b}c} y", "a{b}c"),
        ("\\boxed{\\frac{1}{2}} and more", "\\frac{1}{2}"),
        ("work\n#### 1,000\n", "1,000"),
        ("#### ", None),  # nothing after ####, and no number anywhere
        ("####\n42", "42"),
        ("it costs $1,000.", "1,000"),
        ("no numbers", None),
    ],
)
def test_extract_answer(text, want):
    assert extract_answer(text) == want


# -----------------------------------------------------------------------------------------------
# multiple choice, exact, f1, format


@pytest.mark.parametrize(
    "response,want",
    [
        ("B", "B"),
        ("(B)", "B"),
        ("B.", "B"),
        ("Answer: B", "B"),
        ("the answer is B.", "B"),
        ("The answer is (C).", "C"),
        ("A is wrong, so the answer is (C)", "C"),
        ("ANSWER: d", None),
        ("#### D", "D"),
        ("\\boxed{E}", "E"),
        ("B) because it is blue", "B"),
        ("I think it's J", "J"),
        ("Option (G) looks right", "G"),
        ("A cat sat on the mat", None),
        ("no idea", None),
        ("", None),
    ],
)
def test_extract_choice(response, want):
    assert extract_choice(response) == want


def test_mc_reward():
    for resp in ["B", "(B)", "Answer: B", "the answer is B.", "I think it's B", "#### B"]:
        assert mc_reward(resp, "B") == 1.0, resp
    assert mc_reward("(b)", "B") == 0.0  # lowercase letters are words, not choices
    assert mc_reward("A", "B") == 0.0 and mc_reward("no idea", "B") == 0.0
    assert mc_reward("Answer: C", "(C)") == 1.0 and mc_reward("Answer: C", "c") == 1.0


def test_exact_and_f1_hand_computed():
    assert exact_match("The Cat!", "cat") == 1.0  # case, punctuation and articles are dropped
    assert exact_match("a dog", "cat") == 0.0
    assert exact_match("reasoning...\n#### Paris", "paris") == 1.0  # the #### answer is what counts
    assert exact_match("Rome", ["Paris", "rome"]) == 1.0
    # "the cat sat on the mat" -> [cat sat on mat]; "a cat on a mat" -> [cat on mat]
    # common 3: precision 3/4, recall 3/3, F1 = 2 * 0.75 * 1 / 1.75 = 6/7
    assert f1_reward("the cat sat on the mat", "a cat on a mat") == pytest.approx(6 / 7)
    # "big red cat" vs "red cat": p = 2/3, r = 1 -> 0.8
    assert f1_reward("big red cat", "the red cat") == pytest.approx(0.8)
    # repeated tokens count once per match: [red red red] vs [red blue]: common 1, p = 1/3, r = 1/2 -> 0.4
    assert f1_reward("red red red", "red blue") == pytest.approx(0.4)
    assert f1_reward("nothing shared", "cat") == 0.0
    assert f1_reward("", "") == 1.0 and f1_reward("the", "cat") == 0.0  # empty after normalisation
    assert f1_reward("red", ["blue", "red cat"]) == pytest.approx(2 / 3)  # best of the labels


@pytest.mark.parametrize(
    "response,want",
    [
        ("blah\n#### 42", 1.0),
        ("#### 42", 1.0),
        ("x\n#### -3.5\n", 1.0),
        ("x\n#### 1,000", 1.0),
        ("42", 0.0),
        ("#### 42 apples", 0.0),
        ("#### 42\nmore text", 0.0),
        ("so #### 42", 0.0),
        ("#### 12,34", 0.0),
        ("####", 0.0),
        ("#### $42", 0.0),
        ("", 0.0),
    ],
)
def test_format_reward(response, want):
    assert format_reward(response) == want


def test_weighted_mix_and_rm_type_errors():
    out = make_reward("math+format:0.9,0.1")[0]("it is 5", "5")
    assert out == {"math": 1.0, "format": 0.0, "total": 0.9}
    out = make_reward("math+format:0.9,0.1")[0]("so\n#### 5", "5")
    assert out == {"math": 1.0, "format": 1.0, "total": pytest.approx(1.0)}
    out = make_reward("math+f1")[0]("#### 5", "5")  # no weights: each 1.0
    assert out == {"math": 1.0, "f1": 1.0, "total": 2.0}
    assert make_reward("math")[0]("#### 5", "5") == 1.0 and make_reward("mc")[0]("(A)", "A", {"id": 1}) == 1.0
    assert parse_rm_type("math+format:0.9,0.1") == [("math", 0.9), ("format", 0.1)]
    with pytest.raises(ValueError, match="valid: task, math, boxed, mc, exact, f1, format, custom, remote"):
        make_reward("bogus")[0]("x", "y")
    with pytest.raises(ValueError, match="valid"):
        make_reward("math+bogus:0.5,0.5")[0]("x", "y")
    with pytest.raises(ValueError, match="weights"):
        make_reward("math+format:1")[0]("x", "y")
    with pytest.raises(ValueError, match="weights must be numbers"):
        make_reward("math+format:a,b")[0]("x", "y")


# -----------------------------------------------------------------------------------------------
# custom reward functions


def test_safe_reward():
    def boom(*a):
        raise RuntimeError("bad")

    def quits(*a):
        raise SystemExit(1)

    value, err = safe_reward(boom, "x")
    assert value is None and "RuntimeError: bad" in err
    assert safe_reward(quits, "x")[0] is None
    assert safe_reward(lambda *a: float("nan"), "x")[0] is None
    assert safe_reward(lambda *a: float("inf"), "x")[0] is None
    assert safe_reward(lambda *a: "high", "x") == (None, "reward is not a finite number: 'high'")
    assert safe_reward(lambda *a: None, "x")[0] is None
    assert safe_reward(lambda *a: [1.0], "x")[0] is None
    assert safe_reward(lambda *a: {"a": 1.0}, "x")[0] is None  # the RL loop needs a total
    assert safe_reward(lambda *a: {"a": float("nan"), "total": 1.0}, "x")[0] is None  # every value is checked
    assert safe_reward(lambda *a: {"a": "x", "total": 1.0}, "x")[0] is None
    assert safe_reward(lambda *a: {"a": 1, "total": 0.5}, "x") == ({"a": 1.0, "total": 0.5}, None)
    assert safe_reward(lambda *a: True, "x") == (1.0, None)
    assert safe_reward(lambda r, l: len(r) - len(l), "abc", "a") == (2.0, None)
    assert safe_reward(make_reward("math")[0], "#### 3", "3", None) == (1.0, None)
    assert safe_reward(lambda *a: make_reward("bogus")[0](*a), "#### 3", "3", None)[0] is None


# -----------------------------------------------------------------------------------------------
# GSM8K: every reference solution grades correct against its own label, and wrong against label + 1


@pytest.mark.skipif(not (GSM8K / "test.jsonl").exists(), reason=f"GSM8K not found at {GSM8K} (../shared/data/gsm8k)")
def test_gsm8k_reference_answers_grade_correct():
    counts = Counter()
    for split in ("train", "test"):
        with open(GSM8K / f"{split}.jsonl") as f:
            for line in f:
                solution = json.loads(line)["answer"]
                label = solution.rsplit("####", 1)[1].strip()
                assert math_reward(solution, label) == 1.0, solution[-80:]
                assert format_reward(solution) == 1.0, solution[-80:]
                wrong = str(int(label.replace(",", "")) + 1)
                assert math_reward(solution, wrong) == 0.0, solution[-80:]
                counts[split] += 1
    assert counts == {"train": 7473, "test": 1319}


# -----------------------------------------------------------------------------------------------
# one grader per task: the RL reward (--rm-type task, the hub) is the eval's verdict, response for response

TRICKY = [
    "#### 18",
    "#### 18.5",
    "#### 18.0",
    "#### $18",
    "#### 18.",
    "#### 1,8",
    "#### -18",
    "The answer is 18.",
    "18",
    "\\boxed{18}",
    "#### 18 apples",
    "####18",
    "#### eighteen 18",
    "#### 18\n#### 19",
    "#### 19\n#### 18",
    "#### 3/4",
    "#### 18%",
    "",
    "####",
    "#### " + "9" * 400,
    "work 18\n#### 017",
    "#### +18",
    "#### 18,000",
]


def seam_cases(task, n):
    """(conversation, row, response) over n examples: the reference, off-by-one, and the tricky forms with the
    example's own label put in place of 18."""
    for row in range(min(n, len(task))):
        conv = task.get_example(row)
        label = conv["label"]
        ref = conv["messages"][-1]["content"]
        ref = ref if isinstance(ref, str) else "".join(p["text"] for p in ref)
        yield conv, row, ref
        yield conv, row, ref.rsplit("####", 1)[0] + f"#### {int(label) + 1}"
        for t in TRICKY:
            yield conv, row, t.replace("18", label)


def assert_one_verdict(task, n):
    reward_fn, name = make_reward("task", task=task)
    assert name == f"task:{type(task).__name__}"
    verdicts = []
    for conv, row, response in seam_cases(task, n):
        v = float(task.evaluate(conv, response))
        assert task.reward(conv, response) == v == reward_fn(response, conv["label"], {"row": row}), (row, response)
        verdicts.append(v)
    assert 0 < sum(verdicts) < len(verdicts)  # the cases have both right and wrong answers


@pytest.mark.skipif(not (GSM8K / "test.jsonl").exists(), reason=f"GSM8K not found at {GSM8K} (../shared/data/gsm8k)")
def test_gsm8k_reward_is_the_eval_verdict_on_real_rows():
    assert_one_verdict(GSM8KTask("test", path=str(GSM8K)), 150)


def test_offline_and_spellingbee_reward_is_the_eval_verdict():
    assert_one_verdict(OfflineProblems("test", n=60), 60)
    assert_one_verdict(SpellingBee("test", size=40), 40)


def test_the_three_graders_that_used_to_disagree():
    task = OfflineProblems("test", n=5)
    row = 0
    conv = task.get_example(row)
    label = conv["label"]
    reward_fn, _ = make_reward("task", task=task)
    # a non-integer final answer is wrong: the offline eval used to read the integer prefix ("18" of "18.5")
    assert not task.evaluate(conv, f"#### {label}.5") and reward_fn(f"#### {label}.5", label, {"row": row}) == 0.0
    # no ####: wrong for the eval, and now for the default reward too (math_reward, an explicit choice, still pays)
    assert (
        not task.evaluate(conv, f"The answer is {label}.")
        and reward_fn(f"The answer is {label}.", label, {"row": row}) == 0.0
    )
    assert math_reward(f"The answer is {label}.", label) == 1.0
    # a 400-digit answer is a wrong answer, not an OverflowError that ends chat_eval
    from tasks.common import extract_answer as gsm8k_answer

    assert gsm8k_answer("#### " + "9" * 400) == "9" * 400
    assert not task.evaluate(conv, "#### " + "9" * 400) and reward_fn("#### " + "9" * 400, label, {"row": row}) == 0.0


def test_make_reward_types_names_and_errors(tmp_path):
    task = OfflineProblems("test", n=5)
    conv = task.get_example(0)
    label = conv["label"]
    for rm_type, name, response, want in [
        ("math", "math", f"so it is {label}", 1.0),
        ("boxed", "boxed", f"\\boxed{{{label}}}", 1.0),
        ("boxed", "boxed", f"#### {label}", 0.0),
        ("format", "format", "x\n#### 5", 1.0),
        ("mc", "mc", "(B)", 0.0),
        ("exact", "exact", f"#### {label}", 1.0),
        ("f1", "f1", f"{label} {label}x", 2 / 3),
    ]:
        fn, got_name = make_reward(rm_type, task=task)
        assert got_name == name and fn(response, label, {"row": 0}) == pytest.approx(want), rm_type
    fn, name = make_reward("task+format:0.9,0.1", task=task)
    assert name == "task:OfflineProblems+format:0.9,0.1"
    assert fn(f"work\n#### {label}", label, {"row": 0}) == {"task": 1.0, "format": 1.0, "total": pytest.approx(1.0)}
    assert fn(f"#### {label} apples", label, {"row": 0}) == {"task": 1.0, "format": 0.0, "total": pytest.approx(0.9)}
    custom = tmp_path / "my_rm.py"
    custom.write_text("def rm(response, label, metadata):\n    return float(len(response))\n")
    fn, name = make_reward("task", task=task, custom_path=f"{custom}:rm")  # a custom path replaces the default
    assert name == f"custom:{custom}:rm" and fn("abc", None, None) == 3.0
    assert make_reward("custom", custom_path=f"{custom}:rm")[0]("ab", None, None) == 2.0
    for kw, msg in [
        (dict(rm_type="math", custom_path=f"{custom}:rm"), "both pick the reward"),
        (dict(rm_type="custom"), "needs --custom-rm-path"),
        (dict(rm_type="remote"), "remote_rewards"),
        (dict(rm_type="task"), "there is no task"),
        (dict(rm_type="task", task=OfflineChat("test", n=3)), "OfflineChat has no grader"),
        (dict(rm_type="bogus"), "valid: task, math"),
    ]:
        with pytest.raises(ValueError, match=msg):
            make_reward(**kw)
    # the task grader reads its example by row: a row of another task/split is refused, not graded wrongly
    fn, _ = make_reward("task", task=task)
    other = next(i for i in range(1, 5) if task.get_example(i)["label"] != label)
    assert safe_reward(fn, f"#### {label}", label, {"row": other})[1].startswith("reward raised ValueError")
    assert safe_reward(fn, f"#### {label}", label, {})[0] is None


def test_mc_task_reward_is_its_eval_verdict(tmp_path):
    rows = [
        {
            "question": f"Q{i}?",
            "choices": {"text": ["w", "x", "y", "z"], "label": list("ABCD")},
            "answerKey": "ABCD"[i % 4],
        }
        for i in range(8)
    ]
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = ARC("ARC-Easy", "test", path=str(tmp_path))
    reward_fn, name = make_reward("task", task=task)
    assert name == "task:ARC"
    verdicts = []
    for row in range(len(task)):
        conv = task.get_example(row)
        for response in ["A", "B", " C", "D.", "(A)", "B) x", "The answer is C", "c", "", "A B"]:
            v = float(task.evaluate(conv, response))
            assert task.reward(conv, response) == v == reward_fn(response, conv["label"], {"row": row}), (row, response)
            verdicts.append(v)
    assert 0 < sum(verdicts) < len(verdicts)


@pytest.mark.parametrize(
    "response,label,want",
    [
        ("so \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{x + 1}", "x+1", 1.0),
        ("\\boxed{x+2}", "x+1", 0.0),
        ("\\boxed{}", "", 0.0),
        ("no box 5", "5", 0.0),
        ("\\boxed{7}", "solution \\boxed{7}", 1.0),
        ("\\boxed{7}", None, 0.0),
    ],
)
def test_boxed_reward(response, label, want):
    assert boxed_reward(response, label) == want


# -----------------------------------------------------------------------------------------------
# remote rewards against a real HTTP server on 127.0.0.1


@pytest.fixture(scope="module")
def reward_server():
    with serve_rewards() as url:
        yield url


def _errors(results):
    return sum(err is not None for _, err in results)


def test_remote_rewards_success_in_order(reward_server):
    results = remote_rewards(reward_server + "/ok", [{"id": i, "x": i} for i in range(20)], concurrency=4, timeout=2)
    assert results == [(i * 0.5, None) for i in range(20)]
    assert remote_rewards(reward_server + "/dict", [{"id": 0}]) == [({"acc": 1.0, "fmt": 0.5, "total": 1.5}, None)]
    assert remote_rewards(reward_server + "/ok", []) == []


def test_remote_rewards_concurrency(reward_server):
    t = time.monotonic()
    results = remote_rewards(
        reward_server + "/slow", [{"id": f"c{i}", "sleep": 0.3} for i in range(8)], concurrency=8, timeout=2
    )
    assert _errors(results) == 0
    assert time.monotonic() - t < 2.0  # 8 x 0.3 s one after another would be 2.4 s


def test_remote_rewards_retries_5xx(reward_server):
    results = remote_rewards(
        reward_server + "/flaky", [{"id": f"f{i}"} for i in range(3)], retries=3, backoff=0.01, timeout=1
    )
    assert results == [(1.0, None)] * 3
    assert all(RewardHandler.hits["/flaky", f"f{i}"] == 3 for i in range(3))
    # too few retries: the 500s win, and the reason says so
    results = remote_rewards(reward_server + "/flaky", [{"id": "g"}], retries=1, backoff=0.01, timeout=1)
    assert results == [(None, "gave up after 2 attempts: HTTP 500")]


def test_remote_rewards_failures_are_counted_not_raised(reward_server):
    t = time.monotonic()
    results = remote_rewards(reward_server + "/slow", [{"id": "s", "sleep": 1.5}], timeout=0.3, retries=1, backoff=0.01)
    assert results[0][0] is None and "gave up after 2 attempts" in results[0][1]
    assert time.monotonic() - t < 1.4  # two 0.3 s timeouts, not the server's 1.5 s

    for path, why in [
        ("/badjson", "malformed JSON"),
        ("/string", "not a finite number"),
        ("/nan", "not a finite"),
        ("/nokey", "no 'reward' key"),
        ("/missing", "HTTP 404"),
    ]:
        results = remote_rewards(reward_server + path, [{"id": i} for i in range(3)], retries=3, backoff=0.01)
        assert _errors(results) == 3 and all(v is None and why in err for v, err in results), (path, results)
        assert RewardHandler.hits[path, 0] == 1  # a bad answer is not retried

    results = remote_rewards(reward_server + "/ok", [{"id": 1, "x": 2}, {"id": 2, "x": object()}])
    assert results[0] == (1.0, None) and results[1][0] is None and "JSON" in results[1][1]


def test_remote_rewards_connection_refused():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    t = time.monotonic()
    results = remote_rewards(f"http://127.0.0.1:{port}/", [{"id": 0}, {"id": 1}], retries=2, backoff=0.01, timeout=0.5)
    assert _errors(results) == 2 and all("gave up after 3 attempts" in err for _, err in results)
    assert time.monotonic() - t < 2.0


def test_remote_scoring_path_of_the_rl_loop(reward_server):
    # what chat_rl does with a rollout: one batched call, then set_rewards; /mixed answers by response length:
    # 0 mod 5 -> HTTP 500, 1 -> hangs past the timeout, 2 -> malformed JSON, 3 and 4 -> the vowel fraction
    texts = ["ab" * k + "c" * (k % 2) for k in range(10)]
    samples = [
        Sample(tokens=[0] * (len(t) + 2), response_length=len(t) + 1, loss_mask=[1] * (len(t) + 1), metadata={"row": i})
        for i, t in enumerate(texts)
    ]
    groups = [samples[:5], samples[5:]]
    payloads = [
        {"prompt": {"messages": []}, "response": t, "label": None, "metadata": s.metadata}
        for s, t in zip(samples, texts)
    ]
    t0 = time.monotonic()
    results = remote_rewards(reward_server + "/mixed", payloads, concurrency=10, timeout=0.3, retries=1, backoff=0.01)
    assert time.monotonic() - t0 < 2.0  # the hanging ones time out, twice, all at once
    failed = set_rewards(groups, samples, results, "drop")
    kinds = [len(t) % 5 for t in texts]
    assert [s.metadata["row"] for s in failed] == [i for i, k in enumerate(kinds) if k < 3]
    for s, t, k in zip(samples, texts, kinds):
        why = s.metadata.get("reward_error", "")
        want = {0: "HTTP 500", 1: "gave up after 2 attempts", 2: "malformed JSON"}.get(k)
        if want is None:
            assert s.reward == sum(c in "aeiou" for c in t) / len(t) and sum(s.loss_mask) == s.response_length
        else:
            assert want in why and sum(s.loss_mask) == 0


def _unscored(n):
    return [Sample(tokens=[1, 2, 3, 4], response_length=2, loss_mask=[1, 1], index=i) for i in range(n)]


@pytest.mark.parametrize("mode", ["drop", "zero"])
def test_set_rewards_failure_policy(mode):
    groups = [_unscored(3), [Sample(tokens=[1, 2, 3], response_length=1, loss_mask=[1], reward=0.7)] + _unscored(1)]
    scored = [s for g in groups for s in g if s.reward is None]  # the pre-scored sample keeps its reward
    failed = set_rewards(groups, scored, [(1.0, None), (None, "HTTP 500"), (0.0, None), (None, "timed out")], mode)
    assert failed == [groups[0][1], groups[1][1]]
    assert [s.metadata["reward_error"] for s in failed] == ["HTTP 500", "timed out"]
    if mode == "drop":  # never trained on, and the group mean (advantage 0) as its reward
        assert [s.reward for s in groups[0]] == [1.0, 0.5, 0.0] and [s.reward for s in groups[1]] == [0.7, 0.7]
        assert [s.loss_mask for s in groups[0]] == [[1, 1], [0, 0], [1, 1]] and groups[1][1].loss_mask == [0, 0]
    else:  # an ordinary sample with reward 0
        assert [s.reward for s in groups[0]] == [1.0, 0.0, 0.0] and [s.reward for s in groups[1]] == [0.7, 0.0]
        assert all(s.loss_mask == [1] * s.response_length for g in groups for s in g)


def test_set_rewards_bad_input():
    g = _unscored(2)
    with pytest.raises(ValueError):  # one result per scored sample, no silent misalignment
        set_rewards([g], g, [(1.0, None)])
    with pytest.raises(ValueError, match="on_failure"):
        set_rewards([g], g, [(1.0, None)] * 2, "skip")
