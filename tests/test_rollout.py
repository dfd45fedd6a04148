"""Dynamic sampling: the group filter, filling a rollout from the buffer and new rounds, the buffer's state."""

import random

from nanorl.rollout import RolloutBuffer, RolloutFill, Sample, keep_nonconstant_group


def group(rewards, gi=0):
    return [
        Sample(tokens=[1, 2, 3], response_length=1, reward=r, loss_mask=[1], group_index=gi, index=i)
        for i, r in enumerate(rewards)
    ]


def test_filter_keeps_and_drops_the_right_groups():
    assert keep_nonconstant_group(group([1, 0, 0, 1])) == (True, None)
    assert keep_nonconstant_group(group([1, 1, 1])) == (False, "all_correct")
    assert keep_nonconstant_group(group([0, 0])) == (False, "all_wrong")
    # dict rewards use their total
    g = group([{"total": 0.5, "math": 1}, {"total": 0.5, "math": 0}])
    assert keep_nonconstant_group(g)[0] is False


def fill_by_rounds(target, buffer, make_groups, max_rounds=8):
    """RLRun.sample_share's loop over a RolloutFill, with make_groups() standing for a round of sampled prompts."""
    fill = RolloutFill(target, buffer, keep_nonconstant_group, max_rounds)
    while fill.next_round():
        for g in make_groups():
            fill.add(g)
    return fill.finish()


def test_rollout_fill_over_samples_and_buffers_surplus():
    rng = random.Random(0)
    calls = []

    def make_groups():  # 4 prompts per round; about half are constant and get dropped
        calls.append(1)
        return [group([rng.choice([0, 1]) for _ in range(2)], gi) for gi in range(4)]

    buf = RolloutBuffer()
    kept, stats = fill_by_rounds(5, buf, make_groups)
    assert len(kept) == 5 and all(keep_nonconstant_group(g)[0] for g in kept)
    assert stats["groups_generated"] == 4 * len(calls) and stats["rounds"] == len(calls)
    assert stats["groups_dropped"] == stats["groups_generated"] - 5 - len(buf)
    assert stats["groups_dropped"] == stats.get("dropped_all_correct", 0) + stats.get("dropped_all_wrong", 0)
    # surplus is served first next time
    surplus = list(buf.groups)
    kept2, stats2 = fill_by_rounds(len(surplus), buf, make_groups)
    assert kept2 == surplus and stats2["groups_from_buffer"] == len(surplus) and stats2["rounds"] == 0


def test_rollout_fill_tops_up_after_max_rounds():
    calls = []

    def make_groups():
        calls.append(1)
        return [group([0, 0])]

    kept, stats = fill_by_rounds(2, RolloutBuffer(), make_groups, max_rounds=3)
    assert len(calls) == 3 and len(kept) == 2
    assert stats["groups_unfiltered_fill"] == 2 and stats["groups_dropped"] == 1 and stats["dropped_all_wrong"] == 3


def test_buffer_state_roundtrip():
    buf = RolloutBuffer()
    buf.groups.append(group([1, 0], 3))
    buf2 = RolloutBuffer()
    buf2.load_state_dict(buf.state_dict())
    assert [[s.to_dict() for s in g] for g in buf2.groups] == [[s.to_dict() for s in g] for g in buf.groups]


def test_buffer_loads_a_checkpoint_whose_samples_recorded_their_temperature():
    # checkpoints written before the GroupSpec kept a temperature on every sample: it is the run's, dropped on load
    state = RolloutBuffer()
    state.groups.append(group([1, 0], 3))
    old = state.state_dict()
    for g in old["groups"]:
        for d in g:
            d["temperature"] = 1.0
    buf = RolloutBuffer()
    buf.load_state_dict(old)
    assert [[s.to_dict() for s in g] for g in buf.groups] == [[s.to_dict() for s in g] for g in state.groups]
