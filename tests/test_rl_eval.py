"""nanorl/rl_eval.py: the held-out pass@k sums of one rank and their reduction, against hand-computed values."""

import pytest
import torch

from nanorl import rl_eval


class Sample:
    def __init__(self, reward):
        self.reward = reward

    def scalar_reward(self):
        return self.reward


class FakeWorker:
    """Two prompts x 4 samples: 1 and 4 correct (reward >= 0.5 counts as correct)."""

    def __init__(self, fail=False):
        self.fail, self.inflight, self.calls = fail, {}, []

    def generate(self, items, seeds, temperature, n, version):
        self.calls.append((items, seeds, temperature, n, version))
        self.inflight["generating"] = items
        if self.fail:
            raise RuntimeError("boom")
        return [[Sample(r) for r in rs] for rs in ([1.0, 0.0, 0.2, 0.4], [0.5, 1.0, 0.9, 0.7])]

    def score(self, groups, count_failures=True):
        assert count_failures is False  # the eval's reward failures are not the rollout's
        return groups


def test_local_sums_and_reduce_match_hand_values():
    w = FakeWorker()
    local = rl_eval.local_pass_at_k(w, ["a", "b"], [7, 8], 4, 0.7, [1, 2], 3, 0, "rank 0: the eval at step 3")
    assert w.calls == [(["a", "b"], [7, 8], 0.7, 4, 3)] and w.inflight == {}
    # pass@1 = c/n: 1/4 + 4/4; pass@2 = 1 - C(n-c, 2)/C(4, 2): (1 - 3/6) + 1
    assert local == pytest.approx([1.25, 1.5, 2, 0.0])
    out, n_prompts, n_failed = rl_eval.reduce_pass_at_k(local, [1, 2], torch.device("cpu"))
    assert out == pytest.approx({"eval/pass@1": 0.625, "eval/pass@2": 0.75}) and (n_prompts, n_failed) == (2, 0)


def test_a_failure_is_counted_not_raised(capsys):
    w = FakeWorker(fail=True)
    local = rl_eval.local_pass_at_k(w, ["a"], [7], 4, 1.0, [1], 0, 0, "rank 1: the eval at step 0")
    assert local == [0.0, 0.0, 1.0] and w.inflight == {}
    assert "rank 1: the eval at step 0 failed: RuntimeError: boom" in capsys.readouterr().err
    out, n_prompts, n_failed = rl_eval.reduce_pass_at_k(local, [1], torch.device("cpu"))
    assert out == {"eval/pass@1": 0.0} and (n_prompts, n_failed) == (0, 1)
