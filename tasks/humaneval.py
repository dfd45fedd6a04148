"""
HumanEval (openai/openai_humaneval): 164 Python functions to complete, graded by running the dataset's
unit tests on the model's code in nanorl.execution's sandbox (a subprocess with time and memory limits).
"""

import re

from tasks.common import Task, load_rows

FENCE = re.compile(r"```(?:python|py)?\n(.*?)```", re.DOTALL)


def extract_code(response_text):
    """The first fenced code block if there is one, else the whole response."""
    m = FENCE.search(response_text)
    return m.group(1) if m else response_text


def build_program(problem, response_text):
    """The model's code (re-attached to the prompt if it only wrote the body), then the tests, then the check."""
    code = extract_code(response_text)
    entry = problem["entry_point"]
    if f"def {entry}" not in code:
        code = problem["prompt"] + code  # a bare continuation of the function body
    else:
        # the model rewrote the function: keep the prompt's imports (typing, math...) it may have dropped
        imports = [l for l in problem["prompt"].splitlines() if l.startswith(("import ", "from "))]
        code = "\n".join(imports) + "\n" + code
    return f"{code}\n\n{problem['test']}\n\ncheck({entry})\n"


class HumanEval(Task):
    runs_code = True  # graded by running the model's code: scripts check for a sandbox before they start

    def __init__(self, split="test", path=None, timeout=5.0, max_memory_mb=512, **kw):
        super().__init__(**kw)
        # HumanEval only has a test split; any split name reads it (it is never trained on)
        self.rows = load_rows("openai/openai_humaneval", None, "test", path=path, split="test")
        self.timeout, self.max_memory_mb = timeout, max_memory_mb

    def num_examples(self):
        return len(self.rows)

    def example(self, index):
        r = self.rows[index]
        return {
            "messages": [
                {"role": "user", "content": r["prompt"]},
                {"role": "assistant", "content": r["prompt"] + r["canonical_solution"]},
            ],
            "prompt": r["prompt"],
            "test": r["test"],
            "entry_point": r["entry_point"],
            "task_id": r.get("task_id", ""),
        }

    def evaluate(self, conversation, response_text):
        from nanorl.execution import execute_code  # the sandbox (rewards branch); only needed to grade

        result = execute_code(
            build_program(conversation, response_text), timeout=self.timeout, max_memory_mb=self.max_memory_mb
        )
        return bool(result.success)
