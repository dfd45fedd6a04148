"""The Sample's tensor layout: the next-token alignment, packing samples into rows and micro-batches, and the packed
tensors' round trip back to per-sample rows (one sample per row: the plain padded batch)."""

import torch

from nanorl.rl_trainer import collate_packed, pack_micro_batches, unpack
from nanorl.rollout import Sample


def test_collate_aligns_responses():
    # prompt [5, 6, 7], response [8, 9(tool output), 10]
    s = Sample(tokens=[5, 6, 7, 8, 9, 10], response_length=3, loss_mask=[1, 0, 1], rollout_log_probs=[-0.1, 0.0, -0.3])
    t = Sample(tokens=[1, 2, 3], response_length=1, loss_mask=[1], rollout_log_probs=[-0.5])
    b = collate_packed([s, t], [[0], [1]])  # one sample per row
    assert b["packed_inputs"].tolist() == [[5, 6, 7, 8, 9], [1, 2, 0, 0, 0]]
    assert b["packed_targets"].tolist() == [[-1, -1, 8, 9, 10], [-1, 3, -1, -1, -1]]
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


def test_collate_packed_round_trips_to_one_sample_per_row():
    s = [
        Sample(tokens=[5, 6, 7, 8, 9, 10], response_length=3, loss_mask=[1, 0, 1], rollout_log_probs=[-0.1, 0.0, -0.3]),
        Sample(tokens=[1, 2, 3], response_length=1, loss_mask=[1], rollout_log_probs=[-0.5]),
        Sample(tokens=[4, 4, 11, 12], response_length=2, loss_mask=[1, 1]),
    ]
    b = collate_packed(s, [[0], [2, 1]])
    assert b["order"] == [0, 2, 1]
    assert b["packed_inputs"].tolist() == [[5, 6, 7, 8, 9], [4, 4, 11, 1, 2]]
    assert b["packed_targets"].tolist() == [[-1, -1, 8, 9, 10], [-1, 11, 12, -1, 3]]
    assert b["doc_ids"].tolist() == [[0, 0, 0, 0, 0], [0, 0, 0, 1, 1]]
    ref = collate_packed([s[0], s[2], s[1]], [[0], [1], [2]])
    for k in ("loss_mask", "rollout_logp"):
        assert torch.equal(b[k], ref[k])
    assert torch.equal(b["loss_mask"], torch.tensor([[0.0, 0, 1, 0, 1], [0, 1, 1, 0, 0], [0, 1, 0, 0, 0]]))
    assert torch.equal(b["rollout_logp"], torch.tensor([[0, 0, -0.1, 0.0, -0.3], [0, 0, 0, 0, 0], [0, -0.5, 0, 0, 0]]))
    for k in ("packed_inputs", "packed_targets"):  # padding comes back as 0
        assert torch.equal(unpack(b[k], b["unpack"]), unpack(ref[k], ref["unpack"]))
    assert unpack(b["packed_inputs"], b["unpack"]).tolist() == [[5, 6, 7, 8, 9], [4, 4, 11, 0, 0], [1, 2, 0, 0, 0]]
    assert b["unpack"].tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, -1, -1], [8, 9, -1, -1, -1]]
    # a row shorter than the longest: its padding is one more document
    assert collate_packed(s, [[0], [1]])["doc_ids"].tolist() == [[0, 0, 0, 0, 0], [0, 0, 1, 1, 1]]
