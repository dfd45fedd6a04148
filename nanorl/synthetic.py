"""
The offline curriculum: a deterministic, seeded generator of
  (a) pretraining documents: a small world of people, objects and places, arithmetic and spelling facts,
  (b) chat conversations: small talk, identity, questions about the world, problems solved step by step,
  (c) verifiable problems with integer answers in GSM8K's format (worked solution ending in `#### N`):
      multi-step arithmetic word problems and letter counting, four difficulty levels.
It lets the whole pipeline run with no downloads. The vocabulary is small on purpose, so that a tiny
model trained for minutes on a CPU learns it; the problems get hard enough at levels 3-4 that RL has room.
Train and test are disjoint: a problem's split is decided by a stable hash of its question text.
"""

import argparse
import hashlib
import random
import re

from nanorl.errors import BadValue

NAMES = (
    "Alice Bob Carol Dave Emma Frank Grace Henry Ivy Jack Kate Leo Mia Noah Olga Paul Quinn Rosa Sam Tara "
    "Uma Victor Wendy Xavier Yara Zack"
).split()
ITEMS = (
    "apples pears oranges books pencils marbles stickers cookies coins shells stamps cards eggs candles "
    "buttons flowers stones boxes cups plates"
).split()
PLACES = "park school market garden library farm beach forest kitchen village".split()
ADJS = "small big red blue green old new happy quiet bright warm cold tall short".split()
ANIMALS = "cat dog bird fish horse cow sheep rabbit fox owl".split()
VERBS_PAST = "found bought picked made collected got won received".split()
WORDS = (
    "apple banana cherry grape lemon mango melon orange peach pear plum berry strawberry raspberry "
    "blueberry tomato potato carrot pepper onion garlic bread butter cheese cookie candle pencil paper "
    "letter bottle button mirror window garden forest river mountain valley island ocean planet rocket "
    "engine bridge castle tower school teacher student doctor farmer banana pizza coffee sugar salt "
    "yellow purple silver golden hello world python computer keyboard monitor network balloon giraffe "
    "elephant kangaroo butterfly penguin dolphin octopus squirrel hamster rabbit turtle parrot spider "
    "mississippi committee bookkeeper balloon assessment possession success address necessary "
    "occasion tomorrow beginning different grammar library february calendar cemetery accommodate "
    "excellent millennium pineapple watermelon cinnamon broccoli spaghetti umbrella television "
    "hippopotamus alligator cucumber avocado abracadabra bubble puppy kitten daddy mummy summer winter "
    "autumn spring coconut peppermint lollipop cappuccino referee tattoo zucchini sassafras"
).split()
WORDS = sorted(set(WORDS))


def _hash_split(text, test_frac=0.1):
    # stable across processes and Python versions (unlike hash()), so splits never leak
    h = int(hashlib.md5(text.encode("utf-8")).hexdigest()[:8], 16)
    return "test" if (h % 1000) < test_frac * 1000 else "train"


def letter_count_split(word, letter):
    """The split of one letter-counting fact: the count problems, the pretraining spelling facts and SpellingBee
    (tasks/) all decide by it, so a count held out for evaluation is taught by no stage."""
    return _hash_split(f"{word}|{letter}")


def _fmt_step(a, op, b, result):
    return f"{a} {op} {b} = <<{a}{op}{b}={result}>>{result}"


# -----------------------------------------------------------------------------------------------
# problems


def _arith_problem(rng, level):
    """A word problem as a chain of steps: a start amount, then `level` operations on it."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    hi = {1: 10, 2: 20, 3: 50, 4: 100}[level]
    total = rng.randint(2, hi)
    sentences = [f"{name} has {total} {item}."]
    steps = []
    n_ops = level if level < 4 else 4
    for _ in range(n_ops):
        op = rng.choice(["+", "-", "*", "/"] if level >= 2 else ["+", "-"])
        if op == "+":
            b = rng.randint(1, hi)
            friend = rng.choice([x for x in NAMES if x != name])
            sentences.append(
                rng.choice(
                    [
                        f"{friend} gives {name} {b} more {item}.",
                        f"Then {name} finds {b} more {item}.",
                        f"{name} buys {b} more {item} at the {rng.choice(PLACES)}.",
                    ]
                )
            )
            res = total + b
        elif op == "-":
            if total < 2:
                op, b, res = "+", 3, total + 3
                sentences.append(f"Then {name} finds {b} more {item}.")
                steps.append(_fmt_step(total, op, b, res))
                total = res
                continue
            b = rng.randint(1, total - 1)
            sentences.append(
                rng.choice(
                    [f"{name} gives {b} {item} away.", f"{name} loses {b} {item}.", f"{name} uses {b} of the {item}."]
                )
            )
            res = total - b
        elif op == "*":
            b = rng.randint(2, 3 if level < 4 else 5)
            if total * b > 2000:
                b = 2
            sentences.append(
                rng.choice(
                    [f"Then the number of {item} grows {b} times.", f"{name} makes it {b} times as many {item}."]
                )
            )
            res = total * b
        else:
            divisors = [d for d in (2, 3, 4, 5) if total % d == 0]
            if not divisors:
                b = rng.randint(1, hi)
                op, res = "+", total + b
                sentences.append(f"Then {name} finds {b} more {item}.")
                steps.append(_fmt_step(total, op, b, res))
                total = res
                continue
            b = rng.choice(divisors)
            sentences.append(f"{name} shares the {item} equally among {b} friends and keeps one share.")
            op, res = "/", total // b
        steps.append(_fmt_step(total, op, b, res))
        total = res
    question = " ".join(sentences) + f" How many {item} does {name} have now?"
    answer = "\n".join(steps) + f"\n{name} has {total} {item} now.\n#### {total}"
    return {
        "question": question,
        "answer": answer,
        "label": str(total),
        "kind": "arith",
        "level": level,
        "split_key": question,
    }


# the words each level counts letters in: short ones at level 1, longer at 2, any at 3 and 4 (built once: a chat_rl
# start draws ~27,000 count problems for its 20,000 training prompts)
_COUNT_POOLS = {lv: [w for w in WORDS if (len(w) <= 6) == (lv == 1) or lv >= 3] for lv in (1, 2, 3, 4)}


def _count_problem(rng, level):
    """How many times does a letter appear in a word; longer words and rarer letters at higher levels."""
    word = rng.choice(_COUNT_POOLS[level])
    if level >= 4 and rng.random() < 0.5:
        word = word + rng.choice(WORDS)  # made-up compound words: no memorised answer to lean on
    letters = sorted(set(word))
    letter = rng.choice(letters) if level <= 2 or rng.random() < 0.7 else rng.choice("abcdefghijklmnopqrstuvwxyz")
    count = word.count(letter)
    question = rng.choice(
        [
            f"How many times does the letter {letter} appear in the word {word}?",
            f"Count the letter {letter} in {word}. How many are there?",
            f"How many {letter}'s are in the word {word}?",
        ]
    )
    spelled = "-".join(word)
    running, marks = 0, []
    for ch in word:
        if ch == letter:
            running += 1
            marks.append(f"{ch}({running})")
        else:
            marks.append(ch)
    answer = (
        f"The word {word} is spelled {spelled}.\nMarking each {letter}: {' '.join(marks)}.\n"
        f"So {word}.count('{letter}') = <<'{word}'.count('{letter}')={count}>>{count}.\n#### {count}"
    )
    # split by (word, letter), not by the wording: the same count must never be asked in both splits
    return {
        "question": question,
        "answer": answer,
        "label": str(count),
        "kind": "count",
        "level": level,
        "split_key": f"{word}|{letter}",
    }


LEVELS = (1, 2, 3, 4)


def levels_flag(text):
    """An argparse `type=` for --levels: comma-separated levels of the curriculum, e.g. 1,2. Checked here, where
    argparse names the flag; the text itself is returned, as the scripts split it where they use it."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of levels (e.g. 1,2)") from None
    if not values or any(v not in LEVELS for v in values):
        raise argparse.ArgumentTypeError(f"{text} is out of range: the levels are {', '.join(map(str, LEVELS))}")
    return text


def make_problem(rng, level, kind=None):
    """One verifiable problem dict: question, answer (ends with `#### N`), label, kind, level."""
    if level not in LEVELS:
        raise BadValue(f"level must be 1..4, got {level} (--levels)")
    kind = kind or rng.choice(["arith", "count"])
    if kind == "arith":
        return _arith_problem(rng, level)
    if kind == "count":
        return _count_problem(rng, level)
    raise ValueError(f"unknown problem kind {kind!r}; valid: arith, count")


def problems(split, n, seed=0, levels=(1, 2, 3, 4), kinds=("arith", "count")):
    """n distinct problems of one split, deterministic in (split, n, seed, levels, kinds)."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    rng = random.Random(f"problems-{seed}-{split}")
    out, seen, misses = [], set(), 0
    while len(out) < n:
        p = make_problem(rng, rng.choice(levels), rng.choice(kinds))
        if p["question"] in seen or _hash_split(p["split_key"]) != split:
            misses += 1  # many misses in a row: the space is exhausted, say so instead of looping forever
            if misses > 20_000:
                raise ValueError(
                    f"could not find {n} distinct {split} problems at levels {levels} of kinds {kinds}: "
                    f"the space is too small (found {len(out)})"
                )
            continue
        misses = 0
        seen.add(p["question"])
        out.append(p)
    return out


_ANNOT = re.compile(r"<<([^=<>]+)=([^<>]+)>>")


def problem_to_conversation(problem, use_tools=False):
    """A problem as a chat: the user asks, the assistant solves. With tools, each <<expr=val>> becomes a
    python tool call (expr) followed by its output (val), like GSM8K's calculator annotations."""
    answer = problem["answer"]
    if not use_tools:
        content = _ANNOT.sub("", answer)
    else:
        content, pos = [], 0
        for m in _ANNOT.finditer(answer):
            if m.start() > pos:
                content.append({"type": "text", "text": answer[pos : m.start()]})
            content.append({"type": "python", "text": m.group(1)})
            content.append({"type": "python_output", "text": m.group(2)})
            pos = m.end()
        # the text after an annotation repeats the value; the tool output already showed it
        rest = answer[pos:]
        content.append({"type": "text", "text": rest})
    return {
        "messages": [{"role": "user", "content": problem["question"]}, {"role": "assistant", "content": content}],
        "label": problem["label"],
    }


# -----------------------------------------------------------------------------------------------
# pretraining documents


def _story(rng):
    name, friend, place = rng.choice(NAMES), rng.choice(NAMES), rng.choice(PLACES)
    animal, adj, item = rng.choice(ANIMALS), rng.choice(ADJS), rng.choice(ITEMS)
    lines = [
        f"{name} went to the {place} with {friend}.",
        f"There they saw a {adj} {animal}.",
        f"{name} {rng.choice(VERBS_PAST)} some {item} and gave them to {friend}.",
        f"The {animal} was {rng.choice(ADJS)} and {rng.choice(ADJS)}.",
        f"In the evening {name} and {friend} went home from the {place}.",
    ]
    rng.shuffle(lines[1:4])
    return " ".join(lines)


def _facts(rng):
    out = []
    for _ in range(rng.randint(3, 8)):
        a, b = rng.randint(0, 50), rng.randint(0, 50)
        op = rng.choice(["+", "-", "*"])
        if op == "-" and b > a:
            a, b = b, a
        if op == "*":
            a, b = rng.randint(0, 12), rng.randint(0, 12)
        res = eval(f"{a}{op}{b}")  # noqa: S307 - our own two integers
        out.append(rng.choice([f"{a} {op} {b} = {res}.", f"We know that {a} {op} {b} is {res}."]))
    return " ".join(out)


def _spelling(rng, split):
    out = []
    for _ in range(rng.randint(2, 5)):
        w = rng.choice(WORDS)
        letter = rng.choice(sorted(set(w)))
        if letter_count_split(w, letter) != split:  # never state a held-out count
            continue
        out.append(
            f"The word {w} is spelled {'-'.join(w)}. It has {len(w)} letters and the letter {letter} appears {w.count(letter)} times."
        )
    return " ".join(out)


def _counting(rng):
    start, step = rng.randint(0, 30), rng.randint(1, 5)
    seq = [str(start + i * step) for i in range(rng.randint(5, 12))]
    return f"Counting by {step} from {start}: {', '.join(seq)}."


def _document(rng, split):
    parts = []
    while sum(len(p) for p in parts) < rng.randint(300, 1500):
        r = rng.random()
        if r < 0.3:
            parts.append(_story(rng))
        elif r < 0.45:
            parts.append(_facts(rng))
        elif r < 0.6:
            parts.append(_spelling(rng, split))
        elif r < 0.7:
            parts.append(_counting(rng))
        else:
            # solved problems in the exact chat/problem format, so pretraining already sees them
            p = make_problem(rng, rng.choice([1, 2, 3, 4]))
            if _hash_split(p["split_key"]) == split:
                parts.append(f"Question: {p['question']}\nAnswer: {_ANNOT.sub('', p['answer'])}")
    return "\n\n".join(parts)


def pretrain_documents(split="train", seed=0):
    """An endless stream of documents, deterministic in (split, seed). Embedded problems respect the split."""
    rng = random.Random(f"pretrain-{seed}-{split}")
    while True:
        yield _document(rng, split)


# -----------------------------------------------------------------------------------------------
# chat conversations

IDENTITY = [
    ("Who are you?", "I am nanorl, a small language model trained from scratch with reinforcement learning."),
    ("What is your name?", "My name is nanorl."),
    ("Hello!", "Hello! How can I help you today?"),
    ("Hi there", "Hi! What would you like to talk about?"),
    ("Thank you!", "You are welcome!"),
    ("What can you do?", "I can answer simple questions, count letters and solve small math word problems."),
    ("Who made you?", "I was trained with nanorl, a small open source project for training chat models."),
    ("Goodbye", "Goodbye! Have a nice day."),
]


def _world_qa(rng):
    name, place, animal, adj = rng.choice(NAMES), rng.choice(PLACES), rng.choice(ANIMALS), rng.choice(ADJS)
    story = f"{name} saw a {adj} {animal} at the {place}."
    q, a = rng.choice(
        [
            (f"{story} Where was {name}?", f"{name} was at the {place}."),
            (f"{story} What animal did {name} see?", f"{name} saw a {animal}."),
            (f"{story} What was the {animal} like?", f"The {animal} was {adj}."),
        ]
    )
    return q, a


def _one_exchange(rng, split):
    """One user/assistant exchange whose user message belongs to `split` (identity chat belongs to both)."""
    while True:
        messages, key = _exchange(rng)
        if any(messages[0]["content"] == q for q, _ in IDENTITY) or _hash_split(key) == split:
            return messages


def _exchange(rng):
    """(messages, split key) of one random exchange."""
    r = rng.random()
    if r < 0.15:
        q, a = rng.choice(IDENTITY)
        return [{"role": "user", "content": q}, {"role": "assistant", "content": a}], q
    if r < 0.4:
        q, a = _world_qa(rng)
        return [{"role": "user", "content": q}, {"role": "assistant", "content": a}], q
    p = make_problem(rng, rng.choice([1, 2, 3, 4]))
    return problem_to_conversation(p, use_tools=rng.random() < 0.5)["messages"], p["split_key"]


def conversations(split, n, seed=0):
    """n chat conversations of one split (split by a hash of the first user message), deterministic."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    rng = random.Random(f"conversations-{seed}-{split}")
    out = []
    while len(out) < n:
        # identity small talk is in both splits on purpose (it is not a held-out skill); every other
        # user message, later turns included, belongs to this split only
        messages = _one_exchange(rng, split)
        for _ in range(rng.choice([0, 0, 0, 1, 2])):  # some multi-turn chats
            messages = messages + _one_exchange(rng, split)
        out.append({"messages": messages})
    return out
