"""
SpellingBee: "how many r are in strawberry?", generated on the fly (no download). Counting letters is hard
for a model that sees tokens, not letters, so the reference answer spells the word out and counts one
letter at a time; half of the examples also check the count with a python tool call.
Train and test never share a (word, letter) pair.
"""

import random

from nanorl.synthetic import WORDS, letter_count_split
from tasks.common import Task

TEMPLATES = [
    "How many {l} are in {w}?",
    "How many times does the letter {l} appear in {w}?",
    "Count the number of {l}'s in the word {w}.",
    "how many {l}'s in {w}",
    "In the word '{w}', how many '{l}' are there?",
]


class SpellingBee(Task):
    def __init__(self, split="train", size=None, seed=0, use_tools=None, **kw):
        super().__init__(**kw)
        split = "test" if split in ("val", "validation") else split
        if split not in ("train", "test"):
            raise ValueError(f"SpellingBee split must be train or test, got {split!r}")
        self.split, self.seed, self.use_tools = split, seed, use_tools
        self.size = (2000 if split == "train" else 200) if size is None else size

    def num_examples(self):
        return self.size

    def example(self, index):
        rng = random.Random(f"spellingbee-{self.split}-{self.seed}-{index}")
        while True:
            word = rng.choice(WORDS)
            # mostly letters of the word, sometimes one it lacks (the answer 0 must be learnable too)
            letter = rng.choice(sorted(set(word))) if rng.random() < 0.9 else rng.choice("abcdefghijklmnopqrstuvwxyz")
            if letter_count_split(word, letter) == self.split:  # the offline curriculum's split
                break
        count = word.count(letter)
        question = rng.choice(TEMPLATES).format(l=letter, w=word)
        running, marks = 0, []
        for ch in word:
            running += ch == letter
            marks.append(f"{ch}({running})" if ch == letter else ch)
        text = f"Spelling out {word}: {'-'.join(word)}.\nCounting each {letter}: {' '.join(marks)}.\n"
        tools = rng.random() < 0.5 if self.use_tools is None else self.use_tools
        if tools:
            content = [
                {"type": "text", "text": text + "Let me check with python: "},
                {"type": "python", "text": f"'{word}'.count('{letter}')"},
                {"type": "python_output", "text": str(count)},
                {"type": "text", "text": f"\nThe letter {letter} appears {count} times in {word}.\n#### {count}"},
            ]
        else:
            content = text + f"The letter {letter} appears {count} times in {word}.\n#### {count}"
        return {
            "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": content}],
            "label": str(count),
            "word": word,
            "letter": letter,
        }
