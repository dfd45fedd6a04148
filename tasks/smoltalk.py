"""
SmolTalk (HuggingFaceTB/smol-smoltalk): general multi-turn chat, the bulk of midtraining and SFT.
Chat data has no right answer, so it trains but does not grade.
"""

from tasks.common import Task, clean_conversations, load_rows


class SmolTalk(Task):
    has_grader = False

    def __init__(self, split="train", path=None, **kw):
        super().__init__(**kw)
        if split not in ("train", "test"):
            raise ValueError(f"SmolTalk split must be train or test, got {split!r}")
        rows = load_rows("HuggingFaceTB/smol-smoltalk", "default", split, path=path, split=split)
        # rows that do not alternate user/assistant are skipped and counted (row numbers are 1-based)
        self.conversations, self.bad = clean_conversations(
            ((i + 1, r) for i, r in enumerate(rows)), path or "smol-smoltalk"
        )

    def num_examples(self):
        return len(self.conversations)

    def example(self, index):
        return self.conversations[index]
