"""
MMLU (cais/mmlu): 4-way multiple choice over 57 subjects. split "test"/"validation"/"dev" of the "all"
subset, or subset="auxiliary_train" (~100K questions from other exams) for midtraining.
"""

from tasks.common import Task, evaluate_mc, load_rows, render_mc


class MMLU(Task):
    eval_type = "categorical"

    def __init__(self, split="test", subset="all", path=None, **kw):
        super().__init__(**kw)
        if subset == "auxiliary_train":
            split = "train"  # the only split it has
        if split not in ("train", "test", "validation", "dev") or (split == "train" and subset != "auxiliary_train"):
            raise ValueError(
                f"MMLU subset {subset!r} has no split {split!r} (all: test/validation/dev; auxiliary_train: train)"
            )
        rows = load_rows("cais/mmlu", subset, split, path=path, split=split)
        # auxiliary_train nests each row under a "train" key on the Hub
        self.rows = [r["train"] if isinstance(r.get("train"), dict) else r for r in rows]

    def num_examples(self):
        return len(self.rows)

    def example(self, index):
        r = self.rows[index]
        return render_mc(r["question"], list(r["choices"]), int(r["answer"]), subject=r.get("subject", ""))

    def evaluate(self, conversation, response_text):
        return evaluate_mc(conversation, response_text)
