"""
ARC (allenai/ai2_arc): grade-school science multiple choice, ARC-Easy and ARC-Challenge.
Choices are relabelled A, B, C... by position (a few rows use 1/2/3/4).
"""

from tasks.common import Task, evaluate_mc, load_rows, render_mc


class ARC(Task):
    eval_type = "categorical"

    def __init__(self, subset="ARC-Easy", split="test", path=None, **kw):
        super().__init__(**kw)
        if subset not in ("ARC-Easy", "ARC-Challenge"):
            raise ValueError(f"ARC subset must be ARC-Easy or ARC-Challenge, got {subset!r}")
        if split not in ("train", "validation", "test"):
            raise ValueError(f"ARC split must be train/validation/test, got {split!r}")
        self.rows = load_rows("allenai/ai2_arc", subset, split, path=path, split=split)

    def num_examples(self):
        return len(self.rows)

    def example(self, index):
        r = self.rows[index]
        labels = list(r["choices"]["label"])
        return render_mc(r["question"], list(r["choices"]["text"]), labels.index(r["answerKey"]))

    def evaluate(self, conversation, response_text):
        return evaluate_mc(conversation, response_text)
