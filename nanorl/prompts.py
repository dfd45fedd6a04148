"""
Where RL prompts come from: items of {"conversation" or "text", "label", "metadata"} from a task object (the script
builds it from tasks/ and passes it in) or from a jsonl file (--prompt-data), and the tokens a response starts from,
rendered once per prompt when the run is built (add_prompt_ids: its "prompt_ids"), and the PromptSource that deals
them out during the run, shard by shard and epoch by epoch.
"""

import json
import os

from nanorl.common import epoch_order
from nanorl.errors import MissingFile
from nanorl.rewards import extract_answer


def add_args(group):
    """The flags of prompts from a file (slime's names), for the script's "model and data" group."""
    group.add_argument(
        "--prompt-data",
        default=None,
        help="a jsonl of prompts to RL on instead of --task (slime's "
        "flag): one object a line with --input-key and --label-key",
    )
    group.add_argument(
        "--eval-prompt-data",
        default=None,
        help="a jsonl of held-out prompts for --prompt-data "
        "(default: none held out: the eval then reads the first training prompts, and says so)",
    )
    group.add_argument(
        "--input-key", default="prompt", help="--prompt-data: the prompt's key (a string or a list of chat messages)"
    )
    group.add_argument("--label-key", default="label", help="--prompt-data: the label's key")
    group.add_argument(
        "--apply-chat-template",
        action="store_true",
        help="--prompt-data: render string prompts as a "
        "user turn of the chat template (lists of messages always are); without it a string prompt is "
        "fed as raw text",
    )


def task_prompts(task, name, split, require_label=None):
    """A task's examples as RL prompts: the conversation without its answer, plus the label (the task's own, else the
    final answer of its reference reply). require_label: what needs a label (e.g. "--rm-type math"), or None."""
    items = []
    for i in range(len(task)):
        conv = task.get_example(i)
        label = conv.get("label")
        if label is None and conv["messages"][-1]["role"] == "assistant":
            ref = conv["messages"][-1]["content"]
            ref = ref if isinstance(ref, str) else "".join(p["text"] for p in ref if p["type"] == "text")
            label = extract_answer(ref)
        if label is None and require_label:
            raise SystemExit(f"task {name!r} ({split}) row {i} has no label, and {require_label} needs one")
        items.append({"conversation": conv, "label": label, "metadata": {"task": name, "split": split, "row": i}})
    return items


def jsonl_prompts(path, split, input_key="prompt", label_key="label", apply_chat_template=False, require_label=None):
    """--prompt-data: one JSON object a line; the prompt under input_key (a string or chat messages), the label under
    label_key. A string prompt is a user turn with apply_chat_template, else raw text fed as is."""
    items = []
    if not os.path.isfile(path):
        raise MissingFile(f"{path} does not exist")
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt, label = row[input_key], row.get(label_key)
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
                raise SystemExit(
                    f"--prompt-data {path} line {i}: expected a JSON object with key {input_key!r} "
                    f"({type(e).__name__}: {e})"
                )
            if isinstance(prompt, list):
                item = {"conversation": {"messages": prompt}}
            elif isinstance(prompt, str) and apply_chat_template:
                item = {"conversation": {"messages": [{"role": "user", "content": prompt}]}}
            elif isinstance(prompt, str):
                item = {"text": prompt}
            else:
                raise SystemExit(f"--prompt-data {path} line {i}: {input_key!r} must be a string or a list of messages")
            if label is None and require_label:
                raise SystemExit(f"--prompt-data {path} line {i} has no {label_key!r}, and {require_label} needs one")
            metadata = {"task": os.path.basename(path), "split": split, "row": i}
            items.append({**item, "label": label, "metadata": metadata})
    return items


def add_prompt_ids(tokenizer, items):
    """Give each item its "prompt_ids", the tokens its responses start from: the conversation rendered up to the
    assistant's turn, or raw text (--prompt-data without --apply-chat-template) after <|bos|>. Done once, in place,
    when the run is built: every rollout and eval deals the items with their ids, and renders nothing."""
    for item in items:
        if "text" in item:
            item["prompt_ids"] = [tokenizer.get_bos_token_id()] + tokenizer.encode(item["text"])
        else:
            item["prompt_ids"] = tokenizer.render_for_completion(item["conversation"])


# -----------------------------------------------------------------------------------------------
# the prompt source: the prompts dealt out during the run, with their seeds


class PromptSource:
    """
    Prompts (conversation or text, prompt_ids, label, metadata: the items above) from a task or a file,
    reshuffled every epoch with a seed; each DDP rank walks its own strided shard. state_dict() makes a resumed run
    continue on the exact next prompt.
    """

    def __init__(self, items, seed=0, rank=0, world_size=1, shuffle=True):
        if not items:
            raise ValueError("the prompt source is empty: the RL task gave no prompts")
        self.items = items
        self.seed, self.rank, self.world_size, self.shuffle = seed, rank, world_size, shuffle
        self.epoch, self.offset = 0, 0
        self._order = self._make_order()

    def _make_order(self):
        return epoch_order(len(self.items), self.seed, self.epoch, self.rank, self.world_size, self.shuffle)

    def get(self, n):
        """The next n prompts of this rank and their sampling seeds. A prompt's seed is a function of the run's seed
        and of where the prompt sits in the global order (epoch, position), whichever rank serves it: a run on k
        ranks samples exactly what a run on one rank samples."""
        out, seeds = [], []
        while len(out) < n:
            if self.offset >= len(self._order):
                self.epoch, self.offset = self.epoch + 1, 0
                self._order = self._make_order()
            out.append(self.items[self._order[self.offset]])
            position = self.offset * self.world_size + self.rank
            seeds.append(self.seed * 1_000_003 + self.epoch * 10_000_019 + position)
            self.offset += 1
        return out, seeds

    def state_dict(self):
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed}

    def load_state_dict(self, state):
        self.epoch, self.offset, self.seed = state["epoch"], state["offset"], state["seed"]
        self._order = self._make_order()
