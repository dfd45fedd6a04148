"""
A copy of GSM8K whose every question ends with an instruction to put the final answer after "####", the format
nanorl's GSM8K grader reads. An instruct model (Qwen2.5-0.5B-Instruct) answers in its own words otherwise, and
verl's published GSM8K baselines on that model (36.4% before RL, 56.7% after PPO) were measured with this same
instruction in the prompt, so train and eval read it (dev/LOG.md, "Qwen2.5-0.5B-Instruct on GSM8K").

    python dev/gsm8k_instruct.py --out data/gsm8k_instruct                 # from the Hub (openai/gsm8k, main)
    python dev/gsm8k_instruct.py --src ../shared/data/gsm8k --out /tmp/g   # from a local train/test jsonl folder

Then --task gsm8k --task-path data/gsm8k_instruct (chat_rl) and -a gsm8k --task-path gsm8k=data/gsm8k_instruct
(chat_eval).
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tasks.common import load_rows

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def instruct(row):
    return {**row, "question": f"{row['question'].rstrip()} {INSTRUCTION}"}


def main():
    p = argparse.ArgumentParser(description="GSM8K with the '####' answer instruction in every question")
    p.add_argument("--src", default=None, help="a folder with train.jsonl / test.jsonl (default: the Hub's gsm8k)")
    p.add_argument("--out", required=True, help="the folder to write train.jsonl and test.jsonl into")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    for split in ("train", "test"):
        rows = load_rows("openai/gsm8k", "main", split, path=a.src, split=split, flag="--src")
        with open(os.path.join(a.out, f"{split}.jsonl"), "w") as f:
            f.writelines(json.dumps(instruct(row)) + "\n" for row in rows)
        print(f"{split}: {len(rows)} questions -> {os.path.join(a.out, split + '.jsonl')}")


if __name__ == "__main__":
    main()
