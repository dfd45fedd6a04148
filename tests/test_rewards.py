import json
import math
from pathlib import Path

import pytest

from nanorl.rewards import (compute_reward, exact_match, extract_answer, f1_reward, format_reward, math_reward,
                            mc_reward, normalize_number, safe_reward)

GSM8K = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "gsm8k"


@pytest.mark.parametrize("response,label,want", [
    ("so 3 + 4 = 7\n#### 7", "7", 1.0),
    ("#### 1,000", "1000", 1.0),
    ("#### -5", "-5", 1.0),
    ("#### 5", "-5", 0.0),
    ("The answer is $5.00", "5", 1.0),
    ("He has 12 apples.", "12", 1.0),
    ("12 apples, then 13 apples", "13", 1.0),
    ("12 apples, then 13 apples", "12", 0.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{3/4}", "0.75", 1.0),
    ("\\boxed{{12}}", "12", 1.0),
    ("#### 2.50", "2.5", 1.0),
    ("#### 45%", "0.45", 1.0),
    ("no number at all", "3", 0.0),
    ("", "3", 0.0),
    ("#### 7 apples", "7", 1.0),
    ("#### 7.", "7", 1.0),
    ("first #### 3 then #### 4", "4", 1.0),
    ("1,234,567 is big\n#### 1,234,567", "1234567", 1.0),
    ("#### 0", "0", 1.0),
    ("#### 10", "1", 0.0),
    ("#### 1e3", "1", 1.0),  # only the leading number is read
    ("x = 3.14159", "3.14159", 1.0),
    ("#### 1/3", "0.3333333333", 1.0),
    ("#### 192000001", "192000000", 0.0),
    ("#### 22/7", "22/7", 1.0),
])
def test_math_reward_tricky(response, label, want):
    assert math_reward(response, label) == want


def test_normalize_and_extract():
    assert normalize_number("$1,234.50") == 1234.5
    assert normalize_number("\\frac{3}{4}") == 0.75
    assert normalize_number("abc") is None
    assert extract_answer("a 1 b 2") == "2"
    assert extract_answer("x \\boxed{a{b}c} y") == "a{b}c"


def test_mc_exact_f1_format():
    for resp in ["B", "(B)", "Answer: B", "the answer is B.", "I think it's B"]:
        assert mc_reward(resp, "B") == 1.0, resp
    assert mc_reward("A", "B") == 0.0
    assert exact_match("The Cat!", "cat") == 1.0 and exact_match("a dog", "cat") == 0.0
    # pred "big red cat" vs gold "red cat": p=2/3, r=1 -> f1=0.8
    assert abs(f1_reward("big red cat", "the red cat") - 0.8) < 1e-9
    assert format_reward("blah\n#### 42") == 1.0 and format_reward("42") == 0.0


def test_weighted_mix_and_errors():
    out = compute_reward("math+format:0.9,0.1", "it is 5", "5")
    assert out == {"math": 1.0, "format": 0.0, "total": 0.9}
    assert compute_reward("math", "#### 5", "5") == 1.0
    with pytest.raises(ValueError, match="valid: math"):
        compute_reward("bogus", "x", "y")
    with pytest.raises(ValueError, match="weights"):
        compute_reward("math+format:1", "x", "y")


def test_safe_reward():
    def boom(*a):
        raise RuntimeError("bad")
    assert safe_reward(boom, "x")[0] is None and "RuntimeError" in safe_reward(boom, "x")[1]
    assert safe_reward(lambda *a: float("nan"), "x")[0] is None
    assert safe_reward(lambda *a: "high", "x")[0] is None
    assert safe_reward(lambda *a: {"a": 1.0}, "x")[0] is None  # dict needs a total
    assert safe_reward(lambda *a: {"a": 1.0, "total": 0.5}, "x") == ({"a": 1.0, "total": 0.5}, None)
    assert safe_reward(lambda *a: True, "x") == (1.0, None)


@pytest.mark.skipif(not GSM8K.exists(), reason="../shared/data/gsm8k is not present")
def test_gsm8k_reference_answers_all_grade_correct():
    n = 0
    for split in ("train", "test"):
        with open(GSM8K / f"{split}.jsonl") as f:
            for line in f:
                row = json.loads(line)
                label = row["answer"].rsplit("####", 1)[1].strip()
                assert math_reward(row["answer"], label) == 1.0, row["answer"][-80:]
                wrong = str(int(float(label.replace(",", ""))) + 1)
                assert math_reward(row["answer"], wrong) == 0.0
                n += 1
    assert n == 7473 + 1319
