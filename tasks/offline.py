"""
The offline curriculum as tasks (nanorl/synthetic.py): verifiable problems (multi-step arithmetic and letter
counting, levels 1-4, GSM8K's `#### N` format, optional tool calls) and small chat conversations.
No download: the default of every script when no data is given. Train/test are disjoint by construction.
Problems are graded by GSM8K's rule, Task.evaluate's default (tasks/common.py's is_correct): the integer right after
the last `####`.
"""

from nanorl import synthetic
from tasks.common import Task

DEFAULT_SIZE = {"train": 20000, "test": 500}


class OfflineProblems(Task):
    max_new_tokens = 128  # the longest reference answer, of any level, is 85 tokens in the tiny run's tokenizer

    def __init__(
        self, split="train", n=None, seed=0, levels=(1, 2, 3, 4), kinds=("arith", "count"), use_tools=None, **kw
    ):
        super().__init__(**kw)
        split = "test" if split in ("val", "validation") else split
        n = DEFAULT_SIZE.get(split, 500) if n is None else n
        self.problems = synthetic.problems(split, n, seed=seed, levels=tuple(levels), kinds=tuple(kinds))
        self.use_tools = use_tools  # None: every other problem solved with tool calls, so both styles are learned

    def num_examples(self):
        return len(self.problems)

    def example(self, index):
        p = self.problems[index]
        tools = index % 2 == 0 if self.use_tools is None else self.use_tools
        conv = synthetic.problem_to_conversation(p, use_tools=tools)
        return {**conv, "level": p["level"], "kind": p["kind"]}


class OfflineChat(Task):
    has_grader = False  # small talk: no right answer

    def __init__(self, split="train", n=None, seed=0, **kw):
        super().__init__(**kw)
        split = "test" if split in ("val", "validation") else split
        n = DEFAULT_SIZE.get(split, 500) if n is None else n
        self.conversations = synthetic.conversations(split, n, seed=seed)

    def num_examples(self):
        return len(self.conversations)

    def example(self, index):
        return self.conversations[index]
