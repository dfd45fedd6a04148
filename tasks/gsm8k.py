"""
GSM8K: grade-school math word problems (openai/gsm8k). The worked solutions carry calculator annotations
`<<48/2=24>>`; each becomes a python tool call ("48/2") and its output ("24"), so SFT teaches the model to
use the tool exactly where the dataset's authors used a calculator. Graded by the final `#### N` number.
"""
import re

from tasks.common import Task, load_rows

ANNOTATION = re.compile(r"<<([^<>]*)>>")
NUMBER = re.compile(r"-?[\d,]*\.?\d+")


def answer_to_parts(answer):
    """'... 48/2 = <<48/2=24>>24 clips' -> [text '... 48/2 = ', python '48/2', python_output '24', text '24 clips']."""
    parts, pos = [], 0
    for m in ANNOTATION.finditer(answer):
        if "=" not in m.group(1):
            continue  # not a calculator call: stays as plain text
        expr, result = m.group(1).rsplit("=", 1)
        if m.start() > pos:
            parts.append({"type": "text", "text": answer[pos:m.start()]})
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


def normalize_number(s):
    s = s.replace(",", "").strip()
    try:
        x = float(s)
    except ValueError:
        return s
    return str(int(x)) if x == int(x) else str(x)


def extract_answer(text):
    """The number after the last `####`, normalised ('1,080' -> '1080', '18.0' -> '18'); None if absent."""
    if "####" not in text:
        return None
    m = NUMBER.search(text.rsplit("####", 1)[1])
    return normalize_number(m.group(0)) if m else None


class GSM8K(Task):
    def __init__(self, split="train", path=None, **kw):
        super().__init__(**kw)
        if split not in ("train", "test"):
            raise ValueError(f"GSM8K split must be train or test, got {split!r}")
        self.rows = load_rows("openai/gsm8k", "main", split, path=path, split=split)

    def num_examples(self):
        return len(self.rows)

    def example(self, index):
        row = self.rows[index]
        return {"messages": [{"role": "user", "content": row["question"]},
                             {"role": "assistant", "content": answer_to_parts(row["answer"])}],
                "label": extract_answer(row["answer"])}

    def evaluate(self, conversation, response_text):
        pred = extract_answer(response_text)
        return pred is not None and pred == conversation["label"]
