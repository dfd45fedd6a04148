"""
The held-out eval of RL, for scripts/chat_rl.py: every sampling rank samples and scores its share of the eval
prompts, then pass@k is averaged over all of them. A failure or a hang on one rank is counted, not raised, so that
every rank still reaches the all-reduce and learns of it; the script then stops the run.
"""

import sys
import traceback

import torch
import torch.distributed as dist

from nanorl import rl, rollout


def local_pass_at_k(worker, items, seeds, n_samples, temperature, pass_ks, version, timeout_s, where):
    """n_samples responses per prompt, scored (their reward failures are not counted as a rollout's) ->
    [sum over the prompts of pass@k for each k in pass_ks, number of prompts, 1.0 if it failed else 0.0].
    A failure or a hang past timeout_s is printed with what was in flight; `where` names the rank and step."""
    sums, failed = [0.0] * (len(pass_ks) + 1), 0.0
    try:
        with rollout.deadline(timeout_s, "the eval"):
            groups = worker.generate(items, seeds, temperature, n_samples, version)
            groups = worker.score(groups, count_failures=False)
        correct = [[s.scalar_reward() >= 0.5 for s in g] for g in groups]
        sums = [sum(rl.pass_at_k(len(c), sum(c), k) for c in correct) for k in pass_ks] + [len(correct)]
    except (Exception, rollout.RolloutTimeout) as e:
        traceback.print_exc()
        print(f"{where} failed: {type(e).__name__}: {e}\n  in flight: {worker.inflight}", file=sys.stderr, flush=True)
        failed = 1.0
    worker.inflight.clear()
    return sums + [failed]


def reduce_pass_at_k(local, pass_ks, device, group=None, distributed=False):
    """The ranks' local_pass_at_k lists summed -> ({"eval/pass@k": mean over all prompts}, prompts, failed ranks)."""
    vec = torch.tensor(local, dtype=torch.float64, device=device)
    if distributed:
        dist.all_reduce(vec, group=group)
    out = {f"eval/pass@{k}": (vec[i] / max(vec[-2], 1)).item() for i, k in enumerate(pass_ks)}
    return out, int(vec[-2]), int(vec[-1].item())
