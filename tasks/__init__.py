"""
Tasks: datasets rendered as conversations, and their graders.

    from tasks import get_task
    task = get_task("gsm8k", "test", path="gsm8k/")   # a local jsonl/parquet instead of the Hub
    conv = task.get_example(0); task.evaluate(conv, "... #### 18")
"""

from functools import partial

from nanorl.errors import BadValue
from tasks.arc import ARC
from tasks.common import Task, TaskMixture, TaskSequence
from tasks.customjson import CustomJSON
from tasks.gsm8k import GSM8K
from tasks.humaneval import HumanEval
from tasks.mmlu import MMLU
from tasks.offline import OfflineChat, OfflineProblems
from tasks.smoltalk import SmolTalk
from tasks.spellingbee import SpellingBee

# name -> constructor(split, **kw): a Task class, or a partial of one. Names are matched case-insensitively.
TASKS = {
    "offline": OfflineProblems,
    "offline-chat": OfflineChat,
    "smoltalk": SmolTalk,
    "mmlu": MMLU,
    "mmlu-aux": partial(MMLU, subset="auxiliary_train"),
    "arc-easy": partial(ARC, "ARC-Easy"),
    "arc-challenge": partial(ARC, "ARC-Challenge"),
    "gsm8k": GSM8K,
    "humaneval": HumanEval,
    "spellingbee": SpellingBee,
    "customjson": CustomJSON,
}

# the score of random guessing, for ChatCORE's centred mean (generative tasks: 0)
RANDOM_BASELINE = {"mmlu": 0.25, "arc-easy": 0.25, "arc-challenge": 0.25}
# ChatCORE is the centred mean over exactly these (nanochat's six); chat_eval reports it only when all of them ran
CHATCORE_TASKS = ("arc-easy", "arc-challenge", "mmlu", "gsm8k", "humaneval", "spellingbee")


def task_class(name):
    """The Task class behind a task name (TASKS holds classes and partials of them)."""
    ctor = TASKS[name.lower()]
    return getattr(ctor, "func", ctor)


# the tasks with a grader (chat_eval can score them, RL be rewarded by them); the others are chat data to train on
GRADED_TASKS = tuple(name for name in TASKS if task_class(name).has_grader)


def get_task(name, split, **kw):
    key = name.lower()
    if key not in TASKS:
        raise BadValue(f"unknown task {name!r}; valid tasks: {', '.join(TASKS)}")
    return TASKS[key](split=split, **kw)


__all__ = [
    "Task",
    "TaskMixture",
    "TaskSequence",
    "get_task",
    "task_class",
    "TASKS",
    "GRADED_TASKS",
    "RANDOM_BASELINE",
    "CHATCORE_TASKS",
    "ARC",
    "CustomJSON",
    "GSM8K",
    "HumanEval",
    "MMLU",
    "OfflineChat",
    "OfflineProblems",
    "SmolTalk",
    "SpellingBee",
]
