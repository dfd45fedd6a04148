"""The distributed optimizer paths: torch DDP (bucketed all-reduce during backward) + Muon split across ranks."""

import copy
from contextlib import nullcontext

import pytest
import torch
import torch.multiprocessing as mp

from nanorl.gpt import GPTConfig, build_model
from nanorl.optim import build_optimizer

STEPS, ACCUM = 3, 2


def tiny_model():
    torch.manual_seed(0)
    # 2 layers: each same-shape group of Muon matrices has 2 members, one per rank
    return build_model(GPTConfig(sequence_len=16, vocab_size=40, n_layer=2, n_head=2, n_kv_head=1, n_embd=32), "cpu")


def _ddp_worker(rank, world, init_file, x, out_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    model = tiny_model()
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, gradient_as_bucket_view=True, bucket_cap_mb=0.01
    )  # tiny buckets: several all-reduces overlap backward
    opt = build_optimizer(model)
    calls = []
    orig = dist.all_reduce
    dist.all_reduce = lambda *a, **k: calls.append(1) or orig(*a, **k)  # the optimizer must not all-reduce again
    for _ in range(STEPS):
        for micro in range(ACCUM):
            xb = x[micro::ACCUM][rank::world]  # this rank's rows of micro-batch `micro`
            with ddp.no_sync() if micro < ACCUM - 1 else nullcontext():
                loss = ddp(xb, targets=xb)
                (loss / ACCUM).backward()
        opt.gradients_averaged()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        model.zero_grad(set_to_none=True)
    dist.all_reduce = orig
    assert not calls
    torch.save({"state": {k: v.clone() for k, v in model.state_dict().items()}}, f"{out_path}.{rank}")
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.fp32("calls the model outside autocast, as an fp32 reference (CUDA's layout runs it under autocast only)")
def test_ddp_and_split_muon_two_processes_equal_one(tmp_path):
    torch.manual_seed(1)
    x = torch.randint(0, 40, (8, 16))
    mp.spawn(_ddp_worker, args=(2, str(tmp_path / "init"), x, str(tmp_path / "ddp.pt")), nprocs=2, join=True)
    model = tiny_model()
    opt = build_optimizer(model)
    for _ in range(STEPS):
        for micro in range(ACCUM):
            xb = x[micro::ACCUM]  # the whole micro-batch in one process: mean over both ranks' rows
            loss = model(xb, targets=xb)
            (loss / ACCUM).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        model.zero_grad(set_to_none=True)
    r0, r1 = (torch.load(f"{tmp_path / 'ddp.pt'}.{r}") for r in (0, 1))
    init = tiny_model().state_dict()
    assert all(not torch.equal(init[k], v) for k, v in model.state_dict().items())  # every tensor was trained
    for k, v in model.state_dict().items():
        # fp32: the two ranks' half-batch mean differs from the one-process mean only by summation order
        torch.testing.assert_close(r0["state"][k], v, atol=2e-5, rtol=1e-4)
        assert torch.equal(r0["state"][k], r1["state"][k]), k  # Muon's all_gather leaves the ranks bit-identical


def test_each_rank_reads_only_its_share_of_the_text(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from nanorl.dataset import iter_documents

    docs = [f"doc {i}" for i in range(12)]
    for f in range(2):  # two train files of 3 row groups x 2 documents, then a val file
        pq.write_table(pa.table({"text": docs[6 * f : 6 * f + 6]}), tmp_path / f"shard_{f}.parquet", row_group_size=2)
    pq.write_table(pa.table({"text": ["val"]}), tmp_path / "shard_9.parquet")
    read = []
    orig = pq.ParquetFile.read_row_group
    monkeypatch.setattr(pq.ParquetFile, "read_row_group", lambda self, i, **kw: read.append(i) or orig(self, i, **kw))
    take = lambda rank, world: [
        d for _, d in zip(range(12 // world), iter_documents("train", str(tmp_path), rank=rank, world_size=world))
    ]  # noqa: E731
    assert take(0, 1) == docs
    read.clear()
    r0, r1 = take(0, 2), take(1, 2)
    # row groups alternate between the ranks (across files), together they are the 1-rank stream, and no rank
    # decodes a row group that is not its own
    assert r0 == ["doc 0", "doc 1", "doc 4", "doc 5", "doc 8", "doc 9"] and sorted(r0 + r1, key=docs.index) == docs
    assert len(read) == 6


def test_lr_scale_multiplies_every_groups_lr_and_initial_lr():
    base, scaled = build_optimizer(tiny_model()), build_optimizer(tiny_model(), lr_scale=0.05)
    assert len(base.param_groups) == len(scaled.param_groups) >= 3
    for b, s in zip(base.param_groups, scaled.param_groups):
        assert s["lr"] == s["initial_lr"] == b["initial_lr"] * 0.05 and b["lr"] == b["initial_lr"]


def test_resumed_optimizer_keeps_fp32_moments_for_a_bf16_embedding(monkeypatch):
    """In CUDA's dtype layout the token embedding is bf16 and AdamW's moments fp32. torch's load_state_dict casts
    floating state to the parameter's dtype, which left bf16 moments and crashed the first step after every --resume.
    Loaded moments stay fp32, bit for bit, and the resumed steps equal the uninterrupted ones."""
    from nanorl.precision import CUDA_DTYPES_ENV, autocast_ctx

    monkeypatch.setenv(CUDA_DTYPES_ENV, "1")
    x = torch.randint(0, 40, (2, 16), generator=torch.Generator().manual_seed(1))

    def step(model, opt):
        with autocast_ctx("cpu"):
            loss = model(x, targets=x)
        loss.backward()
        opt.step()
        model.zero_grad(set_to_none=True)

    a = tiny_model()
    assert a.transformer.wte.weight.dtype == torch.bfloat16  # what init_weights leaves on CUDA
    opt_a = build_optimizer(a)
    step(a, opt_a)
    saved = {k: v.clone() for k, v in opt_a.state[a.transformer.wte.weight].items() if torch.is_tensor(v)}
    b = tiny_model()
    b.load_state_dict(a.state_dict())
    opt_b = build_optimizer(b)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))  # as read from a checkpoint: no tensor shared with opt_a
    loaded = opt_b.state[b.transformer.wte.weight]
    for k in ("exp_avg", "exp_avg_sq"):
        assert loaded[k].dtype == torch.float32 and torch.equal(loaded[k], saved[k])
    for _ in range(2):  # the crash was here: lerp_ of bf16 moments with an fp32 gradient
        step(a, opt_a)
        step(b, opt_b)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
