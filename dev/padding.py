"""
Padding fraction of RL training micro-batches (padded positions / all positions the model runs): each sample on
its own row, padded to its micro-batch's longest (the scheme before packing), against samples packed end to end
into rows (nanorl.rl_trainer.pack_micro_batches, what the trainer runs). Rollouts are drawn at random with real
prompt lengths:
  offline  offline-curriculum prompts; every sample of a group as long as the task's reference answer (capped at
           --max-new-tokens): a trained model's stand-in
  gsm8k    GSM8K questions (a jsonl with "question"), rendered as a user turn; responses uniform in --response-len

    python dev/padding.py offline --tokenizer DIR --levels 1,2,3 --max-new-tokens 128
    python dev/padding.py gsm8k --tokenizer DIR --data ../shared/data/gsm8k/train.jsonl --response-len 100,256
"""

import argparse
import json
import random

from nanorl.rl_trainer import pack_micro_batches
from nanorl.rollout import Sample
from nanorl.tokenizer import Tokenizer


def padded_positions(sizes, max_tokens):
    """Positions the scheme before packing ran: sorted by length, rows x longest within max_tokens."""
    total, cur = 0, []
    for n in sorted(sizes) + [None]:
        if cur and (n is None or n * (len(cur) + 1) > max_tokens):
            total += len(cur) * cur[-1]
            cur = []
        cur.append(n)
    return total


def packed_positions(sizes, max_tokens, context):
    samples = [Sample(tokens=[0] * (n + 1)) for n in sizes]
    mbs = pack_micro_batches(samples, max_tokens, min(max_tokens, context))
    return sum(len(mb) * max(sum(sizes[i] for i in row) for row in mb) for mb in mbs)


parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("source", choices=["offline", "gsm8k"])
parser.add_argument("--tokenizer", required=True, help="directory holding tokenizer.json")
parser.add_argument("--levels", default="1,2,3", help="offline: curriculum levels")
parser.add_argument("--max-new-tokens", type=int, default=128, help="offline: responses are cut here")
parser.add_argument("--data", default="../shared/data/gsm8k/train.jsonl", help="gsm8k: the jsonl of questions")
parser.add_argument("--response-len", default="100,256", help="gsm8k: lo,hi of the uniform response lengths")
parser.add_argument("--max-tokens-per-gpu", type=int, default=8192)
parser.add_argument("--n-samples-per-prompt", type=int, default=8)
parser.add_argument("--rollouts", type=int, default=20, help="random rollouts averaged per setting")
args = parser.parse_args()

tok = Tokenizer.load(args.tokenizer)
if args.source == "offline":
    from tasks import get_task

    task = get_task("offline", "train", levels=tuple(int(x) for x in args.levels.split(",")))
    pool = []  # (prompt length, response length) of every problem
    for i in range(len(task)):
        conv = task.get_example(i)
        P = len(tok.render_for_completion(conv))
        pool.append((P, min(len(tok.render_conversation(conv)[0]) - P, args.max_new_tokens)))

    def group(rng):
        P, R = pool[rng.randrange(len(pool))]
        return [P + R] * args.n_samples_per_prompt
else:
    lo, hi = (int(x) for x in args.response_len.split(","))
    with open(args.data) as f:
        prompts = [
            len(tok.render_for_completion({"messages": [{"role": "user", "content": json.loads(line)["question"]}]}))
            for line in f
            if line.strip()
        ]

    def group(rng):
        P = prompts[rng.randrange(len(prompts))]
        return [P + rng.randint(lo, hi) for _ in range(args.n_samples_per_prompt)]


print(
    f"{args.source}: {args.rollouts} random rollouts per row, {args.n_samples_per_prompt} samples per prompt, "
    f"--max-tokens-per-gpu {args.max_tokens_per_gpu}"
)
print("| prompts per rollout | context | mean sample tokens | padding, padded | padding, packed |")
print("|---|---|---|---|---|")
for n_prompts in (8, 32, 128):
    for context in (512, 2048):
        rng = random.Random(0)
        real = padded = packed = 0
        for _ in range(args.rollouts):
            sizes = [L - 1 for _ in range(n_prompts) for L in group(rng)]  # a sample runs len(tokens) - 1 positions
            real += sum(sizes)
            padded += padded_positions(sizes, args.max_tokens_per_gpu)
            packed += packed_positions(sizes, args.max_tokens_per_gpu, context)
        mean = real / (args.rollouts * n_prompts * args.n_samples_per_prompt) + 1
        print(f"| {n_prompts} | {context} | {mean:.0f} | {1 - real / padded:.3f} | {1 - real / packed:.3f} |")
