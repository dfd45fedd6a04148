"""RL prompts: from a task object or a jsonl file, with their labels and metadata; their token ids, rendered once; the
PromptSource's shards, epochs, seeds and resume."""

import json

import pytest

from nanorl.prompts import PromptSource, add_prompt_ids, jsonl_prompts, task_prompts
from nanorl.tokenizer import SPLIT_PATTERN, Tokenizer


class FakeTask:
    """Three examples: a label of its own, a reference reply to take the answer from, and neither."""

    rows = [
        {"messages": [{"role": "user", "content": "1+1?"}], "label": "2"},
        {"messages": [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "so\n#### 5"}]},
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "text", "text": "hello"}]},
            ]
        },
    ]

    def __len__(self):
        return len(self.rows)

    def get_example(self, i):
        return self.rows[i]


def test_task_prompts_labels_and_metadata():
    items = task_prompts(FakeTask(), "fake", "train")
    assert [it["label"] for it in items] == ["2", "5", None]  # its own, the reply's final answer, none to be found
    assert items[1]["conversation"] is FakeTask.rows[1]
    assert [it["metadata"] for it in items] == [{"task": "fake", "split": "train", "row": i} for i in range(3)]
    with pytest.raises(SystemExit, match="task 'fake' \\(test\\) row 2 has no label, and --rm-type math needs one"):
        task_prompts(FakeTask(), "fake", "test", require_label="--rm-type math")


def test_jsonl_prompts(tmp_path):
    f = tmp_path / "p.jsonl"
    rows = [{"q": "What is 2+2?", "a": "4"}, {"q": [{"role": "user", "content": "hi"}]}]
    f.write_text(json.dumps(rows[0]) + "\n\n" + json.dumps(rows[1]) + "\n")
    raw, chat = (jsonl_prompts(f, "train", "q", "a", apply_chat_template=t) for t in (False, True))
    assert raw[0]["text"] == "What is 2+2?" and raw[0]["label"] == "4" and raw[1]["label"] is None
    assert chat[0]["conversation"] == {"messages": [{"role": "user", "content": "What is 2+2?"}]}
    assert raw[1]["conversation"] == chat[1]["conversation"] == {"messages": rows[1]["q"]}  # messages stay messages
    assert [it["metadata"]["row"] for it in raw] == [1, 3]  # the file's line numbers
    with pytest.raises(SystemExit, match="line 3 has no 'a', and --rm-type math needs one"):
        jsonl_prompts(f, "train", "q", "a", require_label="--rm-type math")
    with pytest.raises(SystemExit, match="line 1: expected a JSON object with key 'prompt'"):
        jsonl_prompts(f, "train")


def test_add_prompt_ids_renders_each_item_once_by_hand():
    """A conversation up to a new assistant turn (its reference answer dropped), raw text after <|bos|>: on a byte
    tokenizer (ids 0-255 the bytes, then <|bos|> 256, <|user_start|> 257, <|user_end|> 258, <|assistant_start|> 259)."""
    tok = Tokenizer.from_ranks({bytes([i]): i for i in range(256)}, SPLIT_PATTERN)
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    items = [{"conversation": chat, "label": "1", "metadata": {}}, {"text": "ab", "label": None, "metadata": {}}]
    add_prompt_ids(tok, items)
    assert [it["prompt_ids"] for it in items] == [[256, 257, 104, 105, 258, 259], [256, 97, 98]]
    assert items[0]["conversation"] is chat and set(items[1]) == {"text", "label", "metadata", "prompt_ids"}


def test_prompt_source_shards_epochs_and_resume():
    items = list(range(10))
    a, b = PromptSource(items, seed=1, rank=0, world_size=2), PromptSource(items, seed=1, rank=1, world_size=2)
    (pa, sa), (pb, sb) = a.get(5), b.get(5)
    assert sorted(pa + pb) == items  # one epoch across 2 ranks covers everything once
    # a prompt's seed is where it sits in the global order, whichever rank serves it: one rank samples the same
    one, seeds = PromptSource(items, seed=1).get(10)
    assert dict(zip(pa + pb, sa + sb)) == dict(zip(one, seeds))
    assert seeds == [1 * 1_000_003 + 0 * 10_000_019 + position for position in range(10)]
    assert PromptSource(items, seed=1).get(12)[1][10:] == [1_000_003 + 10_000_019, 1_000_003 + 10_000_019 + 1]
    a.get(2)  # into epoch 2
    state = a.state_dict()
    nxt = a.get(7)
    c = PromptSource(items, seed=1, rank=0, world_size=2)
    c.load_state_dict(state)
    assert c.get(7) == nxt
    with pytest.raises(ValueError, match="empty"):
        PromptSource([])
