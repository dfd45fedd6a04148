"""FSDP2 on the CPU with 2 gloo processes: same training as one unsharded process, 1/world memory, gathered weights."""

import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import warm_python  # pytest puts tests/ on sys.path
from torch.distributed.tensor import DTensor

from nanorl.checkpoint import delete_step, load_checkpoint
from nanorl.common import compute_cleanup
from nanorl.gpt import GPTConfig, build_model
from nanorl.model_loading import load_model_dir
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


def full_optimizer_state(model, opt):
    full = lambda v: v.full_tensor() if isinstance(v, DTensor) else v  # noqa: E731
    return {name: {k: full(v) for k, v in opt.state[p].items()} for name, p in model.named_parameters()}


def _fsdp_worker(rank, world, init_file, x, out_path):
    import torch.distributed as dist

    from nanorl.checkpoint import save
    from nanorl.decode import inference_copy
    from nanorl.fsdp import gather_full_state, local_bytes, shard_model

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    batches = [x[m::ACCUM][rank::world] for m in range(ACCUM)]
    model = shard_model(tiny_model(), torch.device("cpu"))
    opt = build_optimizer(model)
    train(model, opt, batches, opt.gradients_averaged)
    save(f"{out_path}.ck", STEPS, model, opt, {"model_config": CFG.to_dict()}, None, rank)  # sharded: DCP, every rank
    # activation checkpointing recomputes the same activations in backward: the same training, bit for bit
    ac_model = shard_model(tiny_model(), torch.device("cpu"), activation_checkpointing=True)
    ac_opt = build_optimizer(ac_model)
    train(ac_model, ac_opt, batches, ac_opt.gradients_averaged)
    ac_state = {k: v.full_tensor() for k, v in ac_model.state_dict().items()}
    saved = {}
    for name, m in (("plain", model), ("ac", ac_model)):  # ... while keeping far fewer activations for backward
        saved[name] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, n=name: saved[n].append(t.numel()) or t, lambda t: t):
            loss = m(batches[0], targets=batches[0])
        loss.backward()  # (backward also reshards what forward left gathered)
        m.zero_grad(set_to_none=True)
    assert sum(saved["ac"]) < 0.3 * sum(saved["plain"]), {k: sum(v) for k, v in saved.items()}
    x0 = x[:1]
    for p in model.parameters():  # leave gradients in place to count them (one more backward, no step)
        p.grad = torch.zeros_like(p)
    sharded_bytes = local_bytes(model, opt)
    # the RL engine's sampler copy (one flat buffer, as chat_rl builds it); under FSDP it is refreshed by gathering
    full, flat = inference_copy(tiny_model(), torch.float32)
    seconds = gather_full_state(model, full)
    assert all(
        p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for p in full.parameters()
    )  # in place
    logits = model(x0)  # the sharded model's forward, to compare with the gathered copy's
    # RL's log-probs run outside forward(): the root's weights must be gathered for them too
    lp = model.token_logprobs(x0[:, :-1], x0[:, 1:])
    assert torch.allclose(lp, full.token_logprobs(x0[:, :-1], x0[:, 1:]), atol=1e-6), (
        lp,
        full.token_logprobs(x0[:, :-1], x0[:, 1:]),
    )
    assert all(torch.equal(ac_state[k], v) for k, v in full.state_dict().items())
    torch.save(
        {
            "state": {k: v.clone() for k, v in full.state_dict().items()},
            "bytes": sharded_bytes,
            "seconds": seconds,
            "logits": logits.detach(),
            "full_logits": full(x0).detach(),
        },
        f"{out_path}.{rank}",
    )
    compute_cleanup()  # as the scripts end: FSDP's modules outlive the group (common.compute_cleanup says why)


def _reshard_worker(rank, world, init_file, ckpt_dir, out_path):
    import torch.distributed as dist

    from nanorl.checkpoint import load_sharded
    from nanorl.fsdp import shard_model

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    model = shard_model(tiny_model(), torch.device("cpu"))
    opt = build_optimizer(model)
    load_sharded(ckpt_dir, STEPS, model, opt)
    torch.save(
        {
            "state": {k: v.full_tensor() for k, v in model.state_dict().items()},
            "optim": full_optimizer_state(model, opt),
        },
        out_path,
    )
    compute_cleanup()


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
    # the 2-rank DCP checkpoint loads on 1 rank (DCP reshards): weights and optimizer state = the unsharded run's
    mp.spawn(
        _reshard_worker,
        args=(1, str(tmp_path / "init1"), str(tmp_path / "fsdp.pt.ck"), str(tmp_path / "one.pt")),
        nprocs=1,
        join=True,
    )
    one = torch.load(tmp_path / "one.pt")
    ref_optim = full_optimizer_state(model, opt)
    for k, v in one["state"].items():
        assert torch.equal(v, r0["state"][k]), k
    for name, state in ref_optim.items():
        assert state.keys() == one["optim"][name].keys(), name
        for key, v in state.items():
            torch.testing.assert_close(one["optim"][name][key], v, atol=2e-5, rtol=1e-4, msg=f"{name} {key}")


def _compile_worker(rank, world, init_file, out_path):
    import torch.distributed as dist

    from nanorl.fsdp import shard_model

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    model = shard_model(tiny_model(), torch.device("cpu"))
    x = torch.randint(0, 40, (4, 16), generator=torch.Generator().manual_seed(3))
    loss = torch.compile(model, dynamic=False)(x, targets=x)
    loss.backward()
    torch.save(
        {"loss": loss.detach(), "grads": {k: p.grad.full_tensor() for k, p in model.named_parameters()}}, out_path
    )
    compute_cleanup()


@pytest.mark.slow
@pytest.mark.skipif(
    not (shutil.which("c++") or shutil.which("g++")), reason="torch.compile on the CPU needs a C++ compiler"
)
def test_compiled_sharded_model_equals_eager(tmp_path):
    # base_train, chat_sft and `bench train --fsdp` compile the sharded model on CUDA: FSDP2's hooks must survive
    # torch.compile (here inductor on the CPU, one rank as in `bench train --fsdp`) and give the eager loss and grads
    mp.spawn(_compile_worker, args=(1, str(tmp_path / "init"), str(tmp_path / "c.pt")), nprocs=1, join=True)
    out = torch.load(tmp_path / "c.pt")
    model = tiny_model()
    x = torch.randint(0, 40, (4, 16), generator=torch.Generator().manual_seed(3))
    loss = model(x, targets=x)
    loss.backward()
    torch.testing.assert_close(out["loss"], loss.detach(), atol=1e-5, rtol=1e-5)
    for k, p in model.named_parameters():
        torch.testing.assert_close(out["grads"][k], p.grad, atol=1e-5, rtol=1e-4, msg=k)


def _oom_trial_worker(rank, world, init_file, out_path, lockstep):
    import datetime

    import torch.distributed as dist

    from nanorl.batch_fit import fit_device_batch
    from nanorl.fsdp import lockstep_trial, shard_model

    # a bounded wait: ranks left in different collectives fail here in 20 s rather than hang
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=20)
    )
    out = {}
    for where in ("forward", "backward"):
        model, tried = shard_model(tiny_model(), torch.device("cpu")), []

        def out_of_memory(*_):
            raise torch.OutOfMemoryError("CUDA out of memory (raised by the test)")

        def oom_past_two_rows(block, inputs, y):  # rank 1 only: rows beyond 2 do not fit there
            if tried[-1] > 2:
                if where == "forward":  # inside the sharded forward: block 0's all-gather done, block 1's not yet
                    out_of_memory()
                y.register_hook(out_of_memory)  # in backward, after the last block's reduce-scatter

        if rank == 1:
            model.transformer.h[0].register_forward_hook(oom_past_two_rows)

        def try_step(batch):
            tried.append(batch)
            x = torch.zeros(batch, CFG.sequence_len, dtype=torch.long)
            try:
                model(x, targets=x).backward()
            finally:
                model.zero_grad(set_to_none=True)

        trial = lockstep_trial(try_step, model) if lockstep else try_step
        batch, too_big = fit_device_batch(trial, [4, 2, 1], torch.device("cpu"))
        # FSDP's state after the failed step is clean: an ordinary step gives the unsharded model's gradients
        x = torch.randint(0, 40, (batch, CFG.sequence_len), generator=torch.Generator().manual_seed(5))
        model(x, targets=x).backward()
        grads = {k: p.grad.full_tensor() for k, p in model.named_parameters()}
        out[where] = {"batch": batch, "too_big": too_big, "tried": tried, "grads": grads}
    torch.save(out, f"{out_path}.{rank}")
    compute_cleanup()


@pytest.mark.slow
def test_a_rank_out_of_memory_mid_step_leaves_every_rank_in_step(tmp_path):
    # base_train --fsdp --device-batch-size auto: rank 1 runs out of memory above 2 rows, inside the sharded forward
    # (then in backward). Both ranks must agree on 2 rows, the step of one row first (it records the step's
    # collectives), and go on training
    mp.spawn(_oom_trial_worker, args=(2, str(tmp_path / "init"), str(tmp_path / "o"), True), nprocs=2, join=True)
    model = tiny_model()
    x = torch.randint(0, 40, (2, CFG.sequence_len), generator=torch.Generator().manual_seed(5))
    model(x, targets=x).backward()  # each rank's batch is the same x: the mean over ranks is x's gradient
    for rank in (0, 1):
        for where, out in torch.load(tmp_path / f"o.{rank}").items():
            assert (out["batch"], out["too_big"], out["tried"]) == (2, [4], [1, 4, 2]), (rank, where)
            for k, p in model.named_parameters():
                torch.testing.assert_close(out["grads"][k], p.grad, atol=1e-5, rtol=1e-4, msg=f"{where} {k}")


def _cuda_dtypes_worker(rank, world, init_file, out_path):
    import torch.distributed as dist

    from nanorl.fsdp import mixed_precision, shard_model
    from nanorl.gpt import embedding_dtype

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    model = tiny_model()
    model.transformer.wte.to(dtype=embedding_dtype(CFG, "cuda"))  # what init_weights leaves on CUDA: a bf16 lookup
    assert model.transformer.wte.weight.dtype == torch.bfloat16
    shard_model(model, torch.device("cpu"), mp_policy=mixed_precision("cuda"))
    before = {k: p.full_tensor().clone() for k, p in model.named_parameters()}
    opt = build_optimizer(model)
    x = torch.randint(0, 40, (4, 16), generator=torch.Generator().manual_seed(3))
    loss = torch.compile(model, dynamic=False)(x, targets=x)
    loss.backward()
    opt.step()
    after = {k: (p.dtype, p.full_tensor()) for k, p in model.named_parameters()}
    seen = []  # the dtype a block computes with: the policy's bf16 gathered weights
    hook = model.transformer.h[0].register_forward_pre_hook(lambda m, a: seen.append(m.attn.c_q.weight.dtype))
    model(x, targets=x)
    hook.remove()
    torch.save({"loss": loss.detach(), "seen": seen, "before": before, "after": after}, out_path)
    compute_cleanup()


@pytest.mark.slow
@pytest.mark.skipif(
    not (shutil.which("c++") or shutil.which("g++")), reason="torch.compile on the CPU needs a C++ compiler"
)
def test_sharding_with_cuda_dtypes_compiles_and_steps(tmp_path):
    # on CUDA the token embedding is bf16 (init_weights) and the policy gathers bf16 / reduces fp32; FSDP2 asserts one
    # original dtype per unit, and the root unit holds the embedding beside the fp32 head. The same dtypes on the CPU,
    # through shard_model + compile + one optimizer step, as every --fsdp run on CUDA takes them
    mp.spawn(_cuda_dtypes_worker, args=(1, str(tmp_path / "init"), str(tmp_path / "c.pt")), nprocs=1, join=True)
    out = torch.load(tmp_path / "c.pt")
    assert out["seen"] == [torch.bfloat16]
    ref = tiny_model()  # the same step unsharded, all fp32
    init = {k: v.clone() for k, v in ref.state_dict().items()}
    opt = build_optimizer(ref)
    x = torch.randint(0, 40, (4, 16), generator=torch.Generator().manual_seed(3))
    loss = ref(x, targets=x)
    loss.backward()
    opt.step()
    torch.testing.assert_close(out["loss"], loss.detach(), atol=2e-2, rtol=0)  # bf16 compute
    for k, p in ref.named_parameters():
        dtype, after = out["after"][k]
        assert dtype == torch.float32, k  # fp32 master shards, the embedding's included
        # the step moved the same entries by the same amounts, up to bf16 compute: AdamW's first step is ~lr*sign(g),
        # so entries whose tiny gradient changes sign in bf16 (< 1% of the embedding) move the other way
        d, d_ref = after - out["before"][k], p.detach() - init[k]
        assert torch.equal(d != 0, d_ref != 0), k
        off = (d - d_ref).abs() > 0.1 * d_ref.abs().max()
        assert off.float().mean() < (0.01 if k == "transformer.wte.weight" else 1e-9), (k, off.float().mean())


ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "--depth",
    "2",
    "--aspect-ratio",
    "32",
    "--head-dim",
    "32",
    "--max-seq-len",
    "64",
    "--device-batch-size",
    "2",
    "--total-batch-size",
    "512",
    "--eval-every",
    "-1",
    "--sample-every",
    "-1",
    "--num-iterations",
    "4",
    "--save-every",
    "2",
]


def torchrun_base_train(base_dir, *extra):
    env = {**os.environ, "NANORL_BASE_DIR": str(base_dir), "OMP_NUM_THREADS": "1"}
    out = warm_python.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "scripts.base_train",
            "--",
            *TINY,
            *extra,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return {int(s): float(v) for s, v in re.findall(r"step (\d+)/\d+ \| loss ([\d.]+)", out.stdout)}, out.stdout


@pytest.mark.slow
def test_base_train_fsdp_matches_ddp_resumes_and_consolidates(tmp_path, monkeypatch):
    monkeypatch.setenv("NANORL_BASE_DIR", str(tmp_path))
    env = {**os.environ}
    warm_python.run(
        [sys.executable, "-m", "scripts.tok_train", "--vocab-size", "600", "--max-chars", "300000"],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
    )
    ddp, _ = torchrun_base_train(tmp_path, "--model-tag", "ddp")
    fsdp, log = torchrun_base_train(tmp_path, "--model-tag", "fsdp", "--fsdp")
    assert "FSDP2 over 2 ranks" in log and sorted(fsdp) == [1, 2, 3, 4]
    # the same data on each rank, fp32: sharded and replicated training differ only in the order of gradient sums
    assert all(abs(fsdp[s] - ddp[s]) <= 2e-4 for s in ddp), (ddp, fsdp)
    ck = tmp_path / "base_checkpoints" / "fsdp"
    assert (ck / "dcp_000002").is_dir() and not (ck / "model_000002.safetensors").exists()
    with pytest.raises(
        FileNotFoundError, match=r"is sharded \(saved with --fsdp\): run `python -m nanorl.fsdp consolidate "
    ):
        load_checkpoint(str(ck), 2)
    # "kill" after step 2: drop step 4, resume on 2 ranks from the DCP shards, the following losses are identical
    delete_step(str(ck), 4)
    resumed, log = torchrun_base_train(tmp_path, "--model-tag", "fsdp", "--fsdp", "--resume")
    assert "resumed from" in log and resumed == {3: fsdp[3], 4: fsdp[4]}
    # one file for chat_eval/chat_web/export, loaded by the ordinary loader
    out = warm_python.run(
        [sys.executable, "-m", "nanorl.fsdp", "consolidate", str(ck)], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0 and "model_000004.safetensors" in out.stdout, out.stderr[-2000:]
    model, _, meta = load_model_dir(str(ck))
    assert meta["step"] == 4 and meta["consolidated"]
    ref = load_checkpoint(str(tmp_path / "base_checkpoints" / "ddp"), 4)[0]
    for k, v in model.state_dict().items():
        if k == "transformer.wte.weight":
            # Adam's eps=1e-10 turns last-bit differences of near-zero embedding gradients (rows of tokens a step
            # barely saw) into ~1e-3 steps: bound how far, and that such entries stay a handful (under 0.1%)
            off = (v - ref[k]).abs()
            assert off.max() < 1e-2 and (off > 2e-3).float().mean() < 1e-3, (off.max(), (off > 2e-3).sum())
            continue
        torch.testing.assert_close(v, ref[k], atol=2e-6, rtol=1e-4, msg=k)


def test_fsdp_flags_are_checked_before_anything_runs(tmp_path):
    env = {**os.environ, "NANORL_BASE_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    for flags, msg in (
        (["--cpu-offload"], "--activation-checkpointing and --cpu-offload only apply with --fsdp"),
        (["--fsdp"], "--fsdp needs torchrun, also on one GPU"),
    ):
        out = warm_python.run(
            [sys.executable, "-m", "scripts.base_train", *TINY, *flags],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode != 0 and msg in out.stderr, out.stderr[-2000:]


def torchrun_sft(base_dir, *extra):
    env = {**os.environ, "NANORL_BASE_DIR": str(base_dir), "OMP_NUM_THREADS": "1"}
    out = warm_python.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "scripts.chat_sft",
            "--",
            "--source",
            "base",
            "--model-tag",
            "t",
            "--levels",
            "1",
            "--num-examples",
            "64",
            "--num-iterations",
            "4",
            "--device-batch-size",
            "2",
            "--max-seq-len",
            "128",
            "--eval-every",
            "1",
            "--eval-tokens",
            "512",
            "--save-every",
            "2",
            "--init-lr-frac",
            "1.0",
            "--device-type",
            "cpu",
            *extra,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return {int(s): float(v) for s, v in re.findall(r"step +(\d+) \| val loss ([\d.]+)", out.stdout)}, out.stdout


@pytest.mark.slow
def test_chat_sft_fsdp_matches_replicated_resumes_and_consolidates(tmp_path, monkeypatch):
    monkeypatch.setenv("NANORL_BASE_DIR", str(tmp_path))
    warm_python.run(
        [sys.executable, "-m", "scripts.tok_train", "--vocab-size", "600", "--max-chars", "300000"],
        cwd=ROOT,
        env={**os.environ},
        check=True,
        capture_output=True,
    )
    from nanorl.checkpoint import save_checkpoint
    from nanorl.model_loading import checkpoint_root
    from nanorl.tokenizer import get_tokenizer

    torch.manual_seed(0)
    cfg = GPTConfig(
        sequence_len=128, vocab_size=get_tokenizer().vocab_size, n_layer=2, n_head=2, n_kv_head=1, n_embd=32
    )
    save_checkpoint(
        checkpoint_root("base") + "/t", 0, build_model(cfg, "cpu").state_dict(), meta={"model_config": cfg.to_dict()}
    )
    ref, _ = torchrun_sft(tmp_path, "--output-tag", "ddp")
    sharded, log = torchrun_sft(tmp_path, "--output-tag", "fsdp", "--fsdp")
    assert "FSDP2 over 2 ranks" in log and sorted(sharded) == [0, 1, 2, 3, 4] and ref[4] < ref[0]
    # the same batches on each rank, fp32: sharded and replicated training differ only in the order of gradient sums
    # (the log prints 4 decimals: a difference of one in the last printed digit is allowed)
    assert all(abs(sharded[s] - ref[s]) <= 1.5e-4 for s in ref), (ref, sharded)
    ck = tmp_path / "sft_checkpoints" / "fsdp"
    assert (ck / "dcp_000002").is_dir() and not (ck / "model_000002.safetensors").exists()
    # "kill" after step 2: drop step 4, resume on 2 ranks from the DCP shards: the same losses and weights, bit for bit
    delete_step(str(ck), 4)
    resumed, log = torchrun_sft(tmp_path, "--output-tag", "fsdp", "--fsdp", "--resume")
    assert "resumed from" in log and {s: resumed[s] for s in (3, 4)} == {s: sharded[s] for s in (3, 4)}, (
        sharded,
        resumed,
    )
    # one file that chat_eval's loader reads; its weights = the replicated run's to summation order
    out = warm_python.run(
        [sys.executable, "-m", "nanorl.fsdp", "consolidate", str(ck)],
        cwd=ROOT,
        env={**os.environ},
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0 and "model_000004.safetensors" in out.stdout, out.stderr[-2000:]
    from nanorl.model_loading import load_model

    model, _, meta = load_model("sft", "cpu", model_tag="fsdp")  # what chat_eval calls
    assert meta["step"] == 4 and meta["consolidated"]
    replicated = load_checkpoint(str(tmp_path / "sft_checkpoints" / "ddp"), 4)[0]
    for k, v in model.state_dict().items():
        # Adam's eps=1e-10 turns last-bit differences of near-zero embedding gradients into ~1e-3 steps: wte is looser
        tol = dict(atol=2e-3, rtol=0) if k == "transformer.wte.weight" else dict(atol=2e-6, rtol=1e-4)
        torch.testing.assert_close(v, replicated[k], **tol, msg=k)


def rl_samples():
    """Rank 0's long responses fill 4 micro-batches per optimizer step, rank 1's short ones 1: unequal on purpose."""
    from test_rl_trainer import make_samples

    return make_samples([40] * 8, seed=0), make_samples([4, 5, 6, 7] * 2, seed=1)


def rl_step_grads(model, samples, world=1, distributed=False):
    """The gradients each of chat_rl's optimizer steps hands the optimizer (full tensors; the weights are left as they are)."""
    from nanorl.logger import Timer
    from nanorl.rl_config import GroupSpec, TrainerConfig
    from nanorl.rl_trainer import DataParallel, Trainer

    grads, opt = [], build_optimizer(model)
    opt.step = lambda: grads.append(
        {
            k: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
            for k, p in model.named_parameters()
        }
    )
    group = GroupSpec(n_samples_per_prompt=4, max_response_len=12)
    cfg = TrainerConfig(group=group, max_tokens_per_gpu=64, num_steps_per_rollout=2)  # 2 steps: old log-probs first
    data_parallel = DataParallel(world=world, distributed=distributed)
    Trainer(cfg, model, opt, torch.device("cpu"), data_parallel=data_parallel).train_step(0, samples, Timer())
    return grads


def _rl_worker(rank, world, init_file, out_path):
    import torch.distributed as dist
    from test_rl_trainer import tiny_model as rl_model

    from nanorl.fsdp import shard_model

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.save(
        rl_step_grads(shard_model(rl_model(), torch.device("cpu")), rl_samples()[rank], world, True),
        f"{out_path}.{rank}",
    )
    compute_cleanup()


def test_rl_step_on_shards_with_unequal_micro_batches_equals_one_process(tmp_path):
    from test_rl_trainer import tiny_model as rl_model

    from nanorl.rl_trainer import pack_micro_batches

    r0, r1 = rl_samples()
    assert len(pack_micro_batches(r0[:4], 64, 64)) == 4 and len(pack_micro_batches(r1[:4], 64, 64)) == 1
    # every forward and backward of the sharded model is a collective: rank 1 runs dummy micro-batches (a hang otherwise)
    mp.spawn(_rl_worker, args=(2, str(tmp_path / "init"), str(tmp_path / "g.pt")), nprocs=2, join=True)
    sharded = [torch.load(f"{tmp_path / 'g.pt'}.{r}") for r in (0, 1)]
    # one process on both ranks' samples, in the order the 2 steps cut them: each step = both ranks' first/second group
    ref = rl_step_grads(rl_model(), r0[:4] + r1[:4] + r0[4:] + r1[4:])
    assert len(ref) == len(sharded[0]) == 2
    for step in range(2):
        assert (
            ref[step]["lm_head.weight"].abs().max() > 0
            and ref[step]["transformer.h.1.mlp.c_proj.weight"].abs().max() > 0
        )
        for k, g in ref[step].items():
            assert torch.equal(sharded[0][step][k], sharded[1][step][k]), k
            # fp32: the dummy micro-batches add exact zeros; only the order of the gradient sums differs (the
            # zero-initialised output projections leave some matrices without a gradient at this first step)
            torch.testing.assert_close(sharded[0][step][k], g, atol=1e-6, rtol=1e-4, msg=f"step {step} {k}")
