"""
CustomJSON: your own conversations from a jsonl file, e.g. identity data ("who are you?").
Each line is a conversation: {"messages": [{"role": "user", "content": ...}, ...]} or a bare list of messages.
Lines that are not JSON, or whose roles do not alternate, are skipped and counted, and the first bad
line number is reported: one typo should not kill a run, but it should not go unnoticed either.
"""

from nanorl.errors import BadValue
from tasks.common import BadRows, Task, clean_conversations, read_jsonl


class CustomJSON(Task):
    has_grader = False  # conversations to train on

    def __init__(self, split=None, path=None, **kw):
        super().__init__(**kw)
        if path is None:
            raise ValueError(
                "CustomJSON needs a jsonl file: pass path=... (--task-path / --identity-path in the scripts)"
            )
        bad_json = BadRows(path)
        rows = list(read_jsonl(path, bad_json))
        self.conversations, bad_conv = clean_conversations(rows, path)
        # one count and one "first bad line" over both kinds of fault
        self.skipped = bad_json.count + bad_conv.count
        firsts = [(b.first_line, b.first_reason) for b in (bad_json, bad_conv) if b.first_line is not None]
        self.first_bad_line, self.first_bad_reason = min(firsts) if firsts else (None, None)
        if bad_json.count:
            print(
                f"warning: skipped {bad_json.count} line(s) of {path} that are not JSON; first at line {bad_json.first_line}"
            )
        if not self.conversations:
            raise BadValue(
                f"{path} has no valid conversations ({self.skipped} bad line(s), first at line {self.first_bad_line})"
            )

    def num_examples(self):
        return len(self.conversations)

    def example(self, index):
        return self.conversations[index]
