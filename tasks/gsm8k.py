"""
GSM8K: grade-school math word problems (openai/gsm8k). The worked solutions carry calculator annotations
`<<48/2=24>>`; each becomes a python tool call ("48/2") and its output ("24"), so SFT teaches the model to
use the tool exactly where the dataset's authors used a calculator.

Graded as nanochat grades it, and the RL reward is this same verdict: the number right after the last `####`
(tasks/common.py's is_correct, Task.evaluate's default, which the offline curriculum and SpellingBee share).
"""

import re

from nanorl.errors import BadValue
from tasks.common import Task, extract_answer, load_rows, split_file

ANNOTATION = re.compile(r"<<([^<>]*)>>")


def answer_to_parts(answer):
    """'... 48/2 = <<48/2=24>>24 clips' -> [text '... 48/2 = ', python '48/2', python_output '24', text '24 clips']."""
    parts, pos = [], 0
    for m in ANNOTATION.finditer(answer):
        if "=" not in m.group(1):
            continue  # not a calculator call: stays as plain text
        expr, result = m.group(1).rsplit("=", 1)
        if m.start() > pos:
            parts.append({"type": "text", "text": answer[pos : m.start()]})
        parts.append({"type": "python", "text": expr})
        parts.append({"type": "python_output", "text": result})
        pos = m.end()
    if pos < len(answer):
        parts.append({"type": "text", "text": answer[pos:]})
    return parts


def parts_to_answer(parts):
    """The inverse of answer_to_parts: put the <<expr=result>> annotations back."""
    out = []
    for p in parts:
        if p["type"] == "python":
            out.append(f"<<{p['text']}=")
        elif p["type"] == "python_output":
            out.append(f"{p['text']}>>")
        else:
            out.append(p["text"])
    return "".join(out)


class GSM8K(Task):
    def __init__(self, split="train", path=None, **kw):
        super().__init__(**kw)
        if split not in ("train", "test"):
            raise ValueError(f"GSM8K split must be train or test, got {split!r}")
        self.rows = load_rows("openai/gsm8k", "main", split, path=path, split=split)
        for i, row in enumerate(self.rows):  # a bad row would be a KeyError (or an ungradable label) mid-run
            missing = [k for k in ("question", "answer") if not isinstance(row.get(k), str)]
            if missing or extract_answer(row["answer"]) is None:
                where = ", ".join(split_file(path, split)) if path else f"openai/gsm8k ({split})"
                what = (
                    f"no {' or '.join(repr(k) for k in missing)}" if missing else "an 'answer' without a final '#### N'"
                )
                raise BadValue(
                    f"{where}: row {i + 1} has {what} (GSM8K rows need a 'question' and an 'answer' ending in '#### N')"
                )

    def num_examples(self):
        return len(self.rows)

    def example(self, index):
        row = self.rows[index]
        return {
            "messages": [
                {"role": "user", "content": row["question"]},
                {"role": "assistant", "content": answer_to_parts(row["answer"])},
            ],
            "label": extract_answer(row["answer"]),
        }
