"""A reward for RL tests on random-weight models: the fraction of vowels in the response, so rewards
differ within a group and advantages are not all zero."""

import itertools
import os


def vowel_reward(response, label, metadata):
    return sum(c in "aeiou" for c in response) / max(len(response), 1)


def broken_reward(response, label, metadata):
    if len(response) % 2:
        raise RuntimeError("flaky reward server")
    return float("nan") if len(response) % 3 == 0 else 1.0


CALLS = {"n": 0}

if os.environ.get("SLOW_META"):  # the lead rank's write of a step's meta (the mark of a complete save) comes late
    import time

    from nanorl import checkpoint

    _atomic_json = checkpoint._atomic_json

    def _slow_atomic_json(obj, path):
        time.sleep(float(os.environ["SLOW_META"]))
        _atomic_json(obj, path)

    checkpoint._atomic_json = _slow_atomic_json


def failing_generate(cfg, engine, tokenizer, prompts, seeds):
    """A rollout that works until its FAIL_AT-th call, then hangs (FAIL_MODE=hang) or raises on rank FAIL_RANK."""
    import os
    import time

    from nanorl.engine import Request
    from nanorl.rollout import Sample, extend_sample

    CALLS["n"] += 1
    if CALLS["n"] >= int(os.environ["FAIL_AT"]) and os.environ.get("RANK", "0") == os.environ["FAIL_RANK"]:
        if os.environ["FAIL_MODE"] == "hang":
            time.sleep(600)
        raise RuntimeError("the sandbox crashed")
    groups = []
    for p, seed in zip(prompts, seeds):
        ids = p["prompt_ids"]  # rendered when the run was built
        comps = engine.submit_and_wait(
            [Request(ids, num_samples=cfg.group.n_samples_per_prompt, max_tokens=cfg.group.max_response_len, seed=seed)]
        )[0]
        groups.append(
            [
                extend_sample(
                    Sample(
                        prompt=p["conversation"],
                        tokens=list(ids),
                        label=p["label"],
                        index=i,
                        metadata=dict(p["metadata"]),
                    ),
                    c,
                )
                for i, c in enumerate(comps)
            ]
        )
    return groups


def no_logprob_generate(cfg, engine, tokenizer, prompts, seeds):
    """A custom rollout that does not report the sampler's log-probs."""
    import os

    os.environ.update(FAIL_AT="1000000", FAIL_RANK="-1", FAIL_MODE="raise")
    groups = failing_generate(cfg, engine, tokenizer, prompts, seeds)
    for g in groups:
        for s in g:
            s.rollout_log_probs = []
    return groups


def eval_broken_reward(response, label, metadata):
    """Fails on every held-out (eval) prompt, works on the training prompts."""
    if metadata["split"] == "test":
        raise RuntimeError("the eval grader is down")
    return vowel_reward(response, label, metadata)


_CALLS = itertools.count()


def constant_on_rank1_reward(response, label, metadata):
    """Rank 1: 1.0 for every response, so the dynamic-sampling filter drops every group there (all correct).
    Other ranks: a new value on every call, so no group is constant and none is dropped."""
    if os.environ.get("RANK") == "1":
        return 1.0
    return float(next(_CALLS))
