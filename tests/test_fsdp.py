"""FSDP2 on the CPU with 2 gloo processes: same training as one unsharded process, 1/world memory, gathered weights."""
import torch
import torch.multiprocessing as mp

from nanorl.gpt import GPTConfig, build_model
from nanorl.optim import build_optimizer

STEPS, ACCUM = 3, 2
CFG = GPTConfig(sequence_len=16, vocab_size=40, n_layer=2, n_head=2, n_kv_head=1, n_embd=32)


def tiny_model():
    torch.manual_seed(0)
    return build_model(CFG, "cpu")


def train(model, opt, batches, after_backward=None):
    for _ in range(STEPS):
        for xb in batches:
            (model(xb, targets=xb) / len(batches)).backward()
        if after_backward:
            after_backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        model.zero_grad(set_to_none=True)


def _fsdp_worker(rank, world, init_file, x, out_path):
    import torch.distributed as dist

    from nanorl.fsdp import gather_full_state, local_bytes, shard_model
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    model = shard_model(tiny_model(), torch.device("cpu"))
    opt = build_optimizer(model)
    train(model, opt, [x[m::ACCUM][rank::world] for m in range(ACCUM)], opt.gradients_averaged)
    x0 = x[:1]
    for p in model.parameters():  # leave gradients in place to count them (one more backward, no step)
        p.grad = torch.zeros_like(p)
    sharded_bytes = local_bytes(model, opt)
    full = build_model(CFG, "cpu")
    seconds = gather_full_state(model, full)
    logits = model(x0)  # the sharded model's forward, to compare with the gathered copy's
    torch.save({"state": {k: v.clone() for k, v in full.state_dict().items()}, "bytes": sharded_bytes, "seconds": seconds,
                "logits": logits.detach(), "full_logits": full(x0).detach()}, f"{out_path}.{rank}")
    dist.destroy_process_group()


def test_fsdp_two_processes_equal_one_unsharded(tmp_path):
    from nanorl.fsdp import local_bytes
    torch.manual_seed(1)
    x = torch.randint(0, 40, (8, 16))
    mp.spawn(_fsdp_worker, args=(2, str(tmp_path / "init"), x, str(tmp_path / "fsdp.pt")), nprocs=2, join=True)
    model = tiny_model()
    opt = build_optimizer(model)
    train(model, opt, [x[m::ACCUM] for m in range(ACCUM)])
    r0, r1 = (torch.load(f"{tmp_path / 'fsdp.pt'}.{r}") for r in (0, 1))
    init = tiny_model().state_dict()
    for k, v in model.state_dict().items():
        assert not torch.equal(init[k], v), k  # every tensor was trained
        # fp32 on the CPU: the sharded run differs from one process only by the order of the gradient sums
        torch.testing.assert_close(r0["state"][k], v, atol=2e-5, rtol=1e-4)
        assert torch.equal(r0["state"][k], r1["state"][k]), k  # both ranks gathered the same full weights
    # the gathered copy computes what the sharded model computes
    torch.testing.assert_close(r0["full_logits"], r0["logits"], atol=1e-6, rtol=1e-6)
    # per-rank parameters + gradients + optimizer state, from the local shards' sizes: half the unsharded run's
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    replicated = local_bytes(model, opt)
    assert r0["bytes"] + r1["bytes"] == replicated  # nothing duplicated, nothing lost
    assert abs(r0["bytes"] / replicated - 0.5) < 0.05, (r0["bytes"], replicated)
