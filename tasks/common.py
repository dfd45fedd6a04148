"""
The Task interface shared by every dataset, plus mixing/sequencing, the graders several tasks share
(multiple choice, the final answer after `####`) and the local-file/Hub loading helpers.

A task is a list of conversations: get_example(i) -> {"messages": [...], ...}. The last assistant message is
the reference answer; extra keys carry what graders need ("label" = the final answer, "letters" = the
choices of a multiple-choice question). eval_type says how chat_eval scores it: "generative" (sample a
response, then evaluate(conversation, text)) or "categorical" (compare the logits of the letters).
"""

import json
import os
import random
import re
import socket

from nanorl import mirror
from nanorl.common import get_base_dir
from nanorl.dataset import download_file
from nanorl.errors import MissingFile, Unreadable
from nanorl.tokenizer import validate_conversation


class Task:
    eval_type = "generative"
    max_new_tokens = 256  # chat_eval's default answer length (-m) for the task
    has_grader = True  # chat data (conversations to train on, no right answer to check) sets it False

    def __init__(self, start=0, stop=None, step=1):
        # a lazy view over the examples: tasks[start:stop:step], without copying anything
        if step < 1:
            raise ValueError(f"step must be >= 1, got {step}")
        self.start, self.stop, self.step = start, stop, step

    def num_examples(self):
        raise NotImplementedError

    def example(self, index):
        """The example at a physical index (before slicing)."""
        raise NotImplementedError

    def __len__(self):
        stop = self.num_examples() if self.stop is None else min(self.stop, self.num_examples())
        return max(0, -(-(stop - self.start) // self.step))

    def get_example(self, i):
        if not 0 <= i < len(self):
            raise IndexError(f"example {i} out of range for {type(self).__name__} of {len(self)} examples")
        return self.example(self.start + i * self.step)

    def evaluate(self, conversation, response_text):
        """The task's one grader: is the response right? chat_eval counts it; RL is rewarded by it (reward). By default
        GSM8K's verdict on the example's label (is_correct below: gsm8k, the offline problems, SpellingBee); the
        multiple-choice tasks and HumanEval grade their own way."""
        if not self.has_grader:
            raise NotImplementedError(f"{type(self).__name__} has no grader (it is chat data, not a benchmark)")
        return is_correct(response_text, conversation["label"])

    def reward(self, conversation, response_text):
        # the RL signal (--rm-type task): the eval's own verdict as a number, so RL trains on what chat_eval reports
        return float(self.evaluate(conversation, response_text))


class TaskMixture(Task):
    """
    Several tasks, interleaved by one deterministic shuffle, so a training run sees every task throughout
    rather than one after the other. List a task twice to oversample it.
    """

    has_grader = False  # its tasks may each grade their own way

    def __init__(self, tasks, seed=42, **kw):
        super().__init__(**kw)
        self.tasks = list(tasks)
        self.index = [(t, i) for t, task in enumerate(self.tasks) for i in range(len(task))]
        random.Random(seed).shuffle(self.index)

    def num_examples(self):
        return len(self.index)

    def example(self, index):
        t, i = self.index[index]
        return self.tasks[t].get_example(i)


class TaskSequence(Task):
    """Several tasks one after the other (a curriculum), in the given order."""

    has_grader = False  # its tasks may each grade their own way

    def __init__(self, tasks, **kw):
        super().__init__(**kw)
        self.tasks = list(tasks)

    def num_examples(self):
        return sum(len(t) for t in self.tasks)

    def example(self, index):
        for task in self.tasks:
            if index < len(task):
                return task.get_example(index)
            index -= len(task)
        raise IndexError(index)


# -----------------------------------------------------------------------------------------------
# multiple choice

LETTERS = "ABCDEFGHIJ"


def render_mc(question, choices, answer_index, **extra):
    """A multiple-choice question as a conversation whose reference answer is one letter.
    Each letter starts its own line, so it is the same token in the prompt as in the answer."""
    letters = list(LETTERS[: len(choices)])
    lines = [question.strip(), ""] + [f"{l}. {c}" for l, c in zip(letters, choices)]
    lines += ["", "Answer with the letter of the correct choice only."]
    label = letters[answer_index]
    return {
        "messages": [{"role": "user", "content": "\n".join(lines)}, {"role": "assistant", "content": label}],
        "letters": letters,
        "label": label,
        **extra,
    }


def evaluate_mc(conversation, response_text):
    # a generative answer to a letter question: right if the first word is the right letter
    words = response_text.strip().replace(".", " ").replace(")", " ").split()
    return bool(words) and words[0] == conversation["label"]


# -----------------------------------------------------------------------------------------------
# the final answer after `####`: GSM8K's verdict, Task.evaluate's default, which the offline curriculum and SpellingBee
# share (their labels are integers). The answer is the number right after the last `####` (an optional `$`, thousands
# commas and trailing punctuation allowed: `#### $1,080.` reads 1080). It must be the whole number: `#### 18.5` is 18.5,
# never 18; a response with no `####`, or with a word after it, has no answer and is wrong ("The answer is 18."
# included).

ANSWER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")  # 18, -3, 1,080, 2.50


def normalize_number(s):
    """'1,080' -> '1080', '-3.0' -> '-3', '2.50' -> '2.5': exact string arithmetic, so a 400-digit answer
    is just a long string (float() would overflow)."""
    whole, _, frac = s.lstrip("-").replace(",", "").partition(".")
    whole, frac = whole.lstrip("0") or "0", frac.rstrip("0")
    number = whole + ("." + frac if frac else "")
    return "-" + number if s.startswith("-") and number != "0" else number  # -0 is 0


def extract_answer(text):
    """The number right after the last `####`, normalised; None when there is none (see the docstring above)."""
    if text is None or "####" not in text:
        return None
    words = text.rsplit("####", 1)[1].split() or [""]  # nothing after it: an empty word, which is no number
    word = words[0].lstrip("$").rstrip(".,;:!?")
    return normalize_number(word) if ANSWER.fullmatch(word) else None


def is_correct(response_text, label):
    """The one verdict for GSM8K-style answers: the response's final answer equals the label (an integer or
    a number string, read by the same rules)."""
    pred, want = extract_answer(response_text), extract_answer(f"#### {label}")
    return pred is not None and pred == want


# -----------------------------------------------------------------------------------------------
# loading rows: a local jsonl/parquet file (or a directory of them), else the Hugging Face Hub


class BadRows:
    """Counts skipped rows and remembers the first bad one, so a dirty file is reported once, clearly."""

    def __init__(self, path):
        self.path, self.count, self.first_line, self.first_reason = path, 0, None, None

    def add(self, line, reason):
        self.count += 1
        if self.first_line is None:
            self.first_line, self.first_reason = line, reason

    def report(self):
        if self.count:
            print(
                f"warning: skipped {self.count} malformed row(s) of {self.path}; first at line {self.first_line}: {self.first_reason}"
            )


def read_jsonl(path, bad=None):
    """Rows of a jsonl file; a line that is not JSON is skipped and counted in `bad` (blank lines are ignored).
    Yields (line_number, row)."""
    if not os.path.isfile(path):
        raise MissingFile(f"{path} does not exist")
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                if bad is not None:
                    bad.add(lineno, f"not JSON ({e.msg})")


def read_parquet(path):
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


def split_file(path, split):
    """A file path, or a directory holding <split>.jsonl / <split>.parquet / <split>-*.parquet."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise MissingFile(f"{path} does not exist")
    names = sorted(os.listdir(path))
    found = [
        os.path.join(path, n)
        for n in names
        if n.endswith((".jsonl", ".parquet")) and (n.split(".")[0] == split or n.startswith(split + "-"))
    ]
    if not found:
        raise MissingFile(f"no {split}.jsonl or {split}.parquet in {path} (it has: {', '.join(names) or 'nothing'})")
    return found


def read_rows(path, split):
    """All rows of the split from a local file or directory (jsonl or parquet), malformed jsonl lines skipped."""
    rows = []
    for f in split_file(path, split):
        if f.endswith(".parquet"):
            rows += read_parquet(f)
        else:
            bad = BadRows(f)
            rows += [row for _, row in read_jsonl(f, bad)]
            bad.report()
    return rows


def hub_reachable(host="huggingface.co", timeout=3.0):
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def mirror_copy(hf_name, hf_config, hf_split):
    """The local copy of a Hub split from NANORL_MIRROR (nanorl/mirror.py), downloaded on first use as a shard is."""
    path = mirror.split_path(hf_name, hf_config, hf_split)
    local = os.path.join(get_base_dir(), "hub_data", *path.split("/"))
    try:
        return download_file(f"{mirror.mirror()}/{path}", local, attempts=2, backoff=1.0)
    except RuntimeError as e:  # a MissingFile, not a RuntimeError: the stages would take that for "offline"
        cause = e.__cause__ or e
        raise MissingFile(f"NANORL_MIRROR={mirror.mirror()}: cannot read {path} ({type(cause).__name__}: {cause})")


def load_rows(hf_name, hf_config, hf_split, path=None, split=None, flag="--task-path"):
    """
    Rows of a dataset: from `path` (a jsonl/parquet file, or a directory with <split>.jsonl) when given,
    else from NANORL_MIRROR's copy of the split when that is set (read as a local file), else from the Hugging Face
    Hub (or its local cache). With no network and nothing cached, a clear error that names the dataset and the flag
    to use instead; never a 25 s retry loop.
    """
    if path is not None:
        return read_rows(path, split or hf_split)
    if mirror.mirror() is not None:
        return read_rows(mirror_copy(hf_name, hf_config, hf_split), hf_split)
    how = f"download {hf_name} with network access, or pass a local jsonl/parquet with {flag}"
    offline = not hub_reachable()
    if offline:  # the cache may still have it; but never sit in the Hub client's retry loop
        os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        import datasets
    except ImportError as e:
        raise Unreadable(f"the `datasets` package is not installed: {how}") from e
    if offline:  # in case datasets was imported before the environment variable was set
        import huggingface_hub.constants

        datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        ds = datasets.load_dataset(hf_name, hf_config, split=hf_split)
    except Exception as e:  # no network and no cache shows up as ConnectionError, ValueError, FileNotFoundError...
        raise Unreadable(
            f"could not load {hf_name} ({hf_config}, {hf_split}): {type(e).__name__}: {e}\nno network? {how}"
        ) from e
    return [dict(row) for row in ds]


def clean_conversations(items, source):
    """Keep the well-formed conversations; skip the rest with a count and the first bad item's line/index.
    items: (line_number, conversation) pairs."""
    bad, out = BadRows(source), []
    for lineno, conv in items:
        if isinstance(conv, list):  # a bare list of messages is accepted too
            conv = {"messages": conv}
        try:
            validate_conversation(conv)
        except (ValueError, AttributeError, TypeError) as e:  # a message that is not a dict, etc.
            bad.add(lineno, str(e))
            continue
        out.append(conv)
    bad.report()
    return out, bad
