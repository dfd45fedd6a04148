import random

import pytest
import torch

from nanorl.rollout import (PromptSource, RolloutBuffer, Sample, collate, collate_packed, fill_rollout, keep_nonconstant_group,
                            load_function, pack_micro_batches, set_rewards, unpack)


def group(rewards, gi=0):
    return [Sample(tokens=[1, 2, 3], response_length=1, reward=r, loss_mask=[1], group_index=gi, index=i)
            for i, r in enumerate(rewards)]


def test_filter_keeps_and_drops_the_right_groups():
    assert keep_nonconstant_group(group([1, 0, 0, 1])) == (True, None)
    assert keep_nonconstant_group(group([1, 1, 1])) == (False, "all_correct")
    assert keep_nonconstant_group(group([0, 0])) == (False, "all_wrong")
    # dict rewards use their total
    g = group([{"total": 0.5, "math": 1}, {"total": 0.5, "math": 0}])
    assert keep_nonconstant_group(g)[0] is False


def test_fill_rollout_over_samples_and_buffers_surplus():
    rng = random.Random(0)
    calls = []

    def make_groups():  # 4 prompts per round; about half are constant and get dropped
        calls.append(1)
        return [group([rng.choice([0, 1]) for _ in range(2)], gi) for gi in range(4)]

    buf = RolloutBuffer()
    kept, stats = fill_rollout(5, buf, make_groups, keep_nonconstant_group)
    assert len(kept) == 5 and all(keep_nonconstant_group(g)[0] for g in kept)
    assert stats["groups_generated"] == 4 * len(calls)
    assert stats["groups_dropped"] == stats["groups_generated"] - 5 - len(buf)
    assert stats["groups_dropped"] == stats.get("dropped_all_correct", 0) + stats.get("dropped_all_wrong", 0)
    # surplus is served first next time
    surplus = list(buf.groups)
    kept2, stats2 = fill_rollout(len(surplus), buf, make_groups, keep_nonconstant_group)
    assert kept2 == surplus and stats2["groups_from_buffer"] == len(surplus) and stats2["rounds"] == 0


def test_fill_rollout_tops_up_after_max_rounds():
    calls = []

    def make_groups():
        calls.append(1)
        return [group([0, 0])]
    kept, stats = fill_rollout(2, RolloutBuffer(), make_groups, keep_nonconstant_group, max_rounds=3)
    assert len(calls) == 3 and len(kept) == 2
    assert stats["groups_unfiltered_fill"] == 2 and stats["groups_dropped"] == 1 and stats["dropped_all_wrong"] == 3


def test_buffer_state_roundtrip():
    buf = RolloutBuffer()
    buf.add([group([1, 0], 3)])
    buf2 = RolloutBuffer()
    buf2.load_state_dict(buf.state_dict())
    assert [[s.to_dict() for s in g] for g in buf2.groups] == [[s.to_dict() for s in g] for g in buf.groups]


def test_prompt_source_shards_epochs_and_resume():
    items = list(range(10))
    a, b = PromptSource(items, seed=1, rank=0, world_size=2), PromptSource(items, seed=1, rank=1, world_size=2)
    first = a.get(5) + b.get(5)
    assert sorted(first) == items  # one epoch across 2 ranks covers everything once
    a.get(2)  # into epoch 2
    state = a.state_dict()
    nxt = a.get(7)
    c = PromptSource(items, seed=1, rank=0, world_size=2)
    c.load_state_dict(state)
    assert c.get(7) == nxt
    with pytest.raises(ValueError, match="empty"):
        PromptSource([])


def test_collate_aligns_responses():
    # prompt [5, 6, 7], response [8, 9(tool output), 10]
    s = Sample(tokens=[5, 6, 7, 8, 9, 10], response_length=3, loss_mask=[1, 0, 1], rollout_log_probs=[-0.1, 0.0, -0.3])
    t = Sample(tokens=[1, 2, 3], response_length=1, loss_mask=[1], rollout_log_probs=[-0.5])
    b = collate([s, t])
    assert b["inputs"].tolist() == [[5, 6, 7, 8, 9], [1, 2, 0, 0, 0]]
    assert b["targets"].tolist() == [[-1, -1, 8, 9, 10], [-1, 3, -1, -1, -1]]
    assert b["loss_mask"].tolist() == [[0, 0, 1, 0, 1], [0, 1, 0, 0, 0]]
    assert torch.allclose(b["rollout_logp"], torch.tensor([[0, 0, -0.1, 0.0, -0.3], [0, -0.5, 0, 0, 0]]))


def test_pack_micro_batches_respects_budget():
    sizes = [10, 3, 7, 12, 5, 30, 1, 2]  # positions (len(tokens) - 1); 30 is longer than a row
    samples = [Sample(tokens=[0] * (n + 1), response_length=1, loss_mask=[1]) for n in sizes]
    batches = pack_micro_batches(samples, max_tokens=24, row_len=12)
    assert sorted(i for mb in batches for row in mb for i in row) == list(range(len(sizes)))
    for mb in batches:
        lens = [sum(sizes[i] for i in row) for row in mb]
        assert all(n <= 12 or len(row) == 1 for n, row in zip(lens, mb))
        assert max(lens) * len(mb) <= 24 or len(mb) == 1
    # first-fit over the longest first: 30 | 12 | 10+2 | 7+5 | 3+1 (their mean, 14, is over 12: not evened out);
    # rows of 12 go two to a micro-batch
    assert batches == [[[5]], [[3], [0, 7]], [[2, 4], [1, 6]]]
    # 12 + 10 + 7 + 5 + 3 + 2 + 1 = 40 fit 2 rows of 24; evened out: 12+7+1 and 10+5+3+2, not 24+16
    sizes = [12, 10, 7, 5, 3, 2, 1]
    samples = [Sample(tokens=[0] * (n + 1)) for n in sizes]
    assert pack_micro_batches(samples, max_tokens=100, row_len=24) == [[[0, 2, 6], [1, 3, 4, 5]]]


def test_collate_packed_round_trips_to_collate():
    s = [Sample(tokens=[5, 6, 7, 8, 9, 10], response_length=3, loss_mask=[1, 0, 1], rollout_log_probs=[-0.1, 0.0, -0.3]),
         Sample(tokens=[1, 2, 3], response_length=1, loss_mask=[1], rollout_log_probs=[-0.5]),
         Sample(tokens=[4, 4, 11, 12], response_length=2, loss_mask=[1, 1])]
    b = collate_packed(s, [[0], [2, 1]])
    assert b["order"] == [0, 2, 1]
    assert b["packed_inputs"].tolist() == [[5, 6, 7, 8, 9], [4, 4, 11, 1, 2]]
    assert b["packed_targets"].tolist() == [[-1, -1, 8, 9, 10], [-1, 11, 12, -1, 3]]
    assert b["doc_ids"].tolist() == [[0, 0, 0, 0, 0], [0, 0, 0, 1, 1]]
    ref = collate([s[0], s[2], s[1]])
    for k in ("inputs", "targets", "loss_mask", "rollout_logp"):
        assert torch.equal(b[k], ref[k])
    assert torch.equal(unpack(b["packed_inputs"], b["unpack"]), ref["inputs"])  # padding comes back as 0
    assert b["unpack"].tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, -1, -1], [8, 9, -1, -1, -1]]
    # a row shorter than the longest: its padding is one more document
    assert collate_packed(s, [[0], [1]])["doc_ids"].tolist() == [[0, 0, 0, 0, 0], [0, 0, 1, 1, 1]]


def test_load_function_errors(tmp_path):
    f = tmp_path / "myrm.py"
    f.write_text("def rm(a, b):\n    return 1.0\n")
    assert load_function(f"{f}:rm", ["response", "label"], "--custom-rm-path")("x", "y") == 1.0
    with pytest.raises(ValueError, match="--custom-rm-path.*could not import"):
        load_function("no_such_module_xyz:rm", ["response", "label"], "--custom-rm-path")
    with pytest.raises(ValueError, match="no function 'nope'"):
        load_function(f"{f}:nope", ["response", "label"], "--custom-rm-path")
    with pytest.raises(ValueError, match="wrong signature"):
        load_function(f"{f}:rm", ["a", "b", "c"], "--custom-rm-path")
    with pytest.raises(ValueError, match="module:function"):
        load_function("justaname", ["a"], "--x")


def _unscored(n):
    return [Sample(tokens=[1, 2, 3, 4], response_length=2, loss_mask=[1, 1], index=i) for i in range(n)]


@pytest.mark.parametrize("mode", ["drop", "zero"])
def test_set_rewards_failure_policy(mode):
    groups = [_unscored(3), [Sample(tokens=[1, 2, 3], response_length=1, loss_mask=[1], reward=0.7)] + _unscored(1)]
    scored = [s for g in groups for s in g if s.reward is None]  # the pre-scored sample keeps its reward
    failed = set_rewards(groups, scored, [(1.0, None), (None, "HTTP 500"), (0.0, None), (None, "timed out")], mode)
    assert failed == [groups[0][1], groups[1][1]]
    assert [s.metadata["reward_error"] for s in failed] == ["HTTP 500", "timed out"]
    if mode == "drop":  # never trained on, and the group mean (advantage 0) as its reward
        assert [s.reward for s in groups[0]] == [1.0, 0.5, 0.0] and [s.reward for s in groups[1]] == [0.7, 0.7]
        assert [s.loss_mask for s in groups[0]] == [[1, 1], [0, 0], [1, 1]] and groups[1][1].loss_mask == [0, 0]
    else:  # an ordinary sample with reward 0
        assert [s.reward for s in groups[0]] == [1.0, 0.0, 0.0] and [s.reward for s in groups[1]] == [0.7, 0.0]
        assert all(s.loss_mask == [1] * s.response_length for g in groups for s in g)


def test_set_rewards_bad_input():
    g = _unscored(2)
    with pytest.raises(ValueError):  # one result per scored sample, no silent misalignment
        set_rewards([g], g, [(1.0, None)])
    with pytest.raises(ValueError, match="on_failure"):
        set_rewards([g], g, [(1.0, None)] * 2, "skip")
