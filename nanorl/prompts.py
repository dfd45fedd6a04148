"""
Where RL prompts come from: items of {"conversation" or "text", "label", "metadata"} from a task object (the script
builds it from tasks/ and passes it in) or from a jsonl file (--prompt-data), and the tokens a response starts from,
rendered once per prompt when the run is built (add_prompt_ids: its "prompt_ids"). The PromptSource that deals them
out during the run is nanorl/rollout.py's.
"""

import json
import os

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
