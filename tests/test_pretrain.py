import os
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import warm_python  # pytest puts tests/ on sys.path

from nanorl.checkpoint import find_last_step, load_checkpoint
from nanorl.gpt import GPTConfig, build_model
from nanorl.optim import build_optimizer, orthogonalize

ROOT = Path(__file__).resolve().parents[1]


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return build_model(GPTConfig(sequence_len=16, vocab_size=40, n_layer=2, n_head=2, n_kv_head=1, n_embd=32), "cpu")


def test_adamw_groups_match_torch_adamw():
    model = tiny_model()
    ref = tiny_model()
    opt = build_optimizer(model, weight_decay=0.0)
    head_group = next(g for g in opt.param_groups if g["params"][0] is model.lm_head.weight)
    ref_opt = torch.optim.AdamW(
        [ref.lm_head.weight], lr=head_group["lr"], betas=head_group["betas"], eps=head_group["eps"], weight_decay=0.0
    )
    x = torch.randint(0, 40, (2, 16))
    for _ in range(3):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad() if o is ref_opt else m.zero_grad()
            m(x, targets=x).backward()
        opt.step()
        ref_opt.step()
        with torch.no_grad():  # only compare the head: keep the rest of ref in sync
            for p, q in zip(model.parameters(), ref.parameters()):
                if q is not ref.lm_head.weight:
                    q.copy_(p)
    torch.testing.assert_close(model.lm_head.weight, ref.lm_head.weight, atol=1e-6, rtol=1e-5)


def test_muon_update_matches_hand_reference():
    torch.manual_seed(0)
    W = torch.randn(8, 4)
    G1, G2 = torch.randn(8, 4), torch.randn(8, 4)
    lr, mom = 0.02, 0.95

    def ns(G):  # independent reference: the same quintic iteration written out on the transposed (wide) matrix
        X = G.T / G.norm()
        for _ in range(5):
            A = X @ X.T
            X = 3.4445 * X + (-4.7750 * A + 2.0315 * A @ A) @ X
        return X.T

    # two Muon steps by hand: buf = mom*buf + (1-mom)*g; nesterov g' = (1-mom)*g + mom*buf; W -= lr*sqrt(8/4)*ns(g')
    buf = torch.zeros(8, 4)
    W_ref = W.clone()
    for G in (G1, G2):
        buf = mom * buf + (1 - mom) * G
        g = (1 - mom) * G + mom * buf
        W_ref = W_ref - lr * (8 / 4) ** 0.5 * ns(g)

    class Tiny(torch.nn.Module):  # build_optimizer needs the GPT's attribute names
        def __init__(self):
            super().__init__()
            self.config = GPTConfig(n_embd=768)
            self.transformer = torch.nn.ModuleDict(
                {"wte": torch.nn.Embedding(2, 2), "h": torch.nn.ModuleList([torch.nn.Linear(4, 8, bias=False)])}
            )
            self.lm_head = torch.nn.Linear(2, 2, bias=False)

    m = Tiny()
    m.transformer.h[0].weight.data.copy_(W)
    opt = build_optimizer(m, matrix_lr=lr, muon_momentum=mom)
    for G in (G1, G2):
        m.transformer.h[0].weight.grad = G.clone()
        opt.step()
    torch.testing.assert_close(m.transformer.h[0].weight.data, W_ref, atol=1e-5, rtol=1e-4)
    # and the orthogonalisation really makes singular values close to 1
    s = torch.linalg.svdvals(orthogonalize(torch.randn(16, 8)))
    assert s.min() > 0.6 and s.max() < 1.3


def _ddp_worker(rank, world, init_file, x, out_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    model = tiny_model()
    opt = build_optimizer(model)
    for _ in range(2):
        xb = x[rank::world]
        model(xb, targets=xb).backward()
        opt.step()
        model.zero_grad()
    if rank == 0:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, out_path)
    dist.destroy_process_group()


def test_ddp_two_processes_equal_one(tmp_path):
    torch.manual_seed(1)
    x = torch.randint(0, 40, (4, 16))
    mp.spawn(_ddp_worker, args=(2, str(tmp_path / "init"), x, str(tmp_path / "ddp.pt")), nprocs=2, join=True)
    model = tiny_model()
    opt = build_optimizer(model)
    for _ in range(2):
        # the same global batch in one process: the mean of the two half-batch losses
        loss = 0.5 * (model(x[0::2], targets=x[0::2]) + model(x[1::2], targets=x[1::2]))
        loss.backward()
        opt.step()
        model.zero_grad()
    ddp_state = torch.load(tmp_path / "ddp.pt")
    for k, v in model.state_dict().items():
        torch.testing.assert_close(ddp_state[k], v, atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("nanorl")
    env = {**os.environ, "NANORL_BASE_DIR": str(d)}
    warm_python.run(
        [sys.executable, "-m", "scripts.tok_train", "--vocab-size", "600", "--max-chars", "300000"],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
    )
    return d


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
    "256",
    "--eval-every",
    "-1",
    "--sample-every",
    "-1",
    "--keep-last",
    "5",
]


def base_train(base_dir, *extra, launcher=(sys.executable, "-m")):
    env = {**os.environ, "NANORL_BASE_DIR": str(base_dir), "OMP_NUM_THREADS": "1"}
    return warm_python.run(
        [*launcher, "scripts.base_train", *(["--"] if len(launcher) > 2 else []), *TINY, *extra],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def run_base_train(base_dir, *extra):
    out = base_train(base_dir, *extra)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return {int(s): float(l) for s, l in re.findall(r"step (\d+)/\d+ \| loss ([\d.]+)", out.stdout)}, out.stdout


def test_loss_drops_and_kill_resume_is_exact(base_dir):
    tb = base_dir / "tb_full"
    losses, log = run_base_train(
        base_dir, "--num-iterations", "40", "--save-every", "20", "--model-tag", "full", "--tensorboard", str(tb)
    )
    assert losses[40] < 0.7 * losses[1]
    # the TensorBoard event files hold the same per-step losses the log printed (to its 4 decimals)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb)).Reload().Scalars("train/loss")
    assert [e.step for e in events] == list(range(1, 41))
    assert all(abs(e.value - losses[e.step]) <= 5e-5 for e in events), [
        (e.step, e.value, losses[e.step]) for e in events
    ]
    # the ETA: a number from step 1 on (no "nan"), from the pace of recent steps
    etas = re.findall(r"\| eta (\S+)", log)
    assert len(etas) == 40 and all(re.fullmatch(r"\d+\.\dm", e) for e in etas) and etas[-1] == "0.0m", etas
    # "kill" the run after step 20 (drop the final checkpoint), then resume: steps 21..40 must match exactly
    ck = base_dir / "base_checkpoints" / "resumed"
    run_base_train(base_dir, "--num-iterations", "40", "--save-every", "20", "--model-tag", "resumed")
    for p in ck.glob("*_000040*"):
        p.unlink()
    resumed, log = run_base_train(
        base_dir, "--num-iterations", "40", "--save-every", "20", "--model-tag", "resumed", "--resume"
    )
    assert "resumed from" in log and min(resumed) == 21
    assert all(resumed[s] == losses[s] for s in range(21, 41)), [(s, resumed[s], losses[s]) for s in range(21, 41)]


def test_bad_batch_flags(base_dir):
    out = base_train(base_dir, "--device-batch-size", "3")
    assert out.returncode != 0 and "--total-batch-size 256 must be a multiple" in out.stderr


def test_auto_device_batch_keeps_the_tokens_per_step(base_dir):
    # off CUDA auto takes the largest of 32, 16, 8, ... whose micro-steps add up to the step: 256 tokens of 64 = 4 rows
    losses, log = run_base_train(
        base_dir, "--device-batch-size", "auto", "--num-iterations", "2", "--model-tag", "auto"
    )
    assert "device batch (auto): 4 rows\n" in log and "2 steps x 256 tokens (1 micro-steps each)" in log
    assert len(losses) == 2
    _, log = run_base_train(
        base_dir, "--device-batch-size", "auto", "--max-seq-len", "16", "--num-iterations", "1", "--model-tag", "auto16"
    )
    assert "device batch (auto): 16 rows\n" in log and "(1 micro-steps each)" in log  # 256 / 16 = 16 rows
    out = base_train(base_dir, "--device-batch-size", "big")
    assert out.returncode == 2 and "argument --device-batch-size: 'big' is not an integer" in out.stderr


def test_wandb_without_a_key_stops_before_the_model_is_built(base_dir, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_API_KEY", "WANDB_MODE", "NETRC")}
    env.update(NANORL_BASE_DIR=str(base_dir), OMP_NUM_THREADS="1", HOME=str(tmp_path))  # HOME: no ~/.netrc
    out = warm_python.run(
        [sys.executable, "-m", "scripts.base_train", *TINY, "--num-iterations", "2", "--run", "myrun"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 1 and "model d2" not in out.stdout  # the model line comes after the build: never reached
    assert out.stderr.splitlines() == [
        "--run 'myrun' logs to wandb but no wandb API key is set (WANDB_API_KEY or `wandb login`): "
        "set WANDB_MODE=offline to log locally, or use --run dummy"
    ]


def test_nonfinite_loss_stops_and_keeps_the_last_good_checkpoint(base_dir):
    # an absurd embedding LR overflows the RMSNorm of step 3's forward (a natural trigger, no injection flag);
    # the checkpoint saved just before that step holds the weights that blew up, so it goes; step 1 stays
    out = base_train(
        base_dir, "--num-iterations", "10", "--embedding-lr", "1e36", "--save-every", "1", "--model-tag", "nan"
    )
    assert out.returncode != 0
    assert "step 3/10: training loss is nan; stopping. The last good checkpoint, step 1 in" in out.stderr, out.stderr[
        -2000:
    ]
    ck = base_dir / "base_checkpoints" / "nan"
    assert find_last_step(str(ck)) == 1 and not list(ck.glob("*_000002*"))
    model_state = load_checkpoint(str(ck), 1)[0]
    assert all(torch.isfinite(v).all() for v in model_state.values())


def test_resume_with_another_config_or_world_size_is_refused(base_dir):
    run_base_train(base_dir, "--num-iterations", "2", "--model-tag", "mismatch")
    out = base_train(base_dir, "--num-iterations", "4", "--model-tag", "mismatch", "--resume", "--aspect-ratio", "64")
    assert (
        out.returncode != 0
        and "--resume: the checkpoint's model config" in out.stderr
        and "differs from this run's" in out.stderr
    )
    # 2 gloo ranks on the CPU resuming a 1-rank run: the data order was sharded for 1 rank
    out = base_train(
        base_dir,
        "--num-iterations",
        "4",
        "--model-tag",
        "mismatch",
        "--resume",
        launcher=(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m"),
    )
    assert out.returncode != 0
    assert "written by 1 rank(s), this run has 2; resume with --nproc_per_node=1" in out.stdout + out.stderr


def test_loader_refuses_another_world_size():
    from nanorl.dataloader import PretrainLoader
    from nanorl.tokenizer import SPLIT_PATTERN, Tokenizer

    tok = Tokenizer.from_ranks({bytes([i]): i for i in range(256)}, SPLIT_PATTERN)
    loader = PretrainLoader(tok, 2, 16, world_size=1)
    loader.next_batch()
    state = {**loader.state_dict(), "world_size": 2}
    with pytest.raises(ValueError, match="made with 2 ranks, this run has 1"):
        loader.load_state_dict(state)


class CountingTokenizer:
    """A byte-level tokenizer that counts the documents it encodes."""

    def __init__(self):
        from nanorl.tokenizer import SPLIT_PATTERN, Tokenizer

        self.tok, self.encoded = Tokenizer.from_ranks({bytes([i]): i for i in range(256)}, SPLIT_PATTERN), 0

    def get_bos_token_id(self):
        return self.tok.get_bos_token_id()

    def encode(self, texts, prepend=None):
        self.encoded += len(texts)
        return self.tok.encode(texts, prepend=prepend)


def write_pretrain_data(d, kind):
    """Two train files and a val file of documents of 5..60 characters (parquet: row groups of 3 documents)."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    d.mkdir()
    for f in range(3):
        texts = [f"file {f} doc {i} " + "abcdefgh"[: i % 8] * (i % 7) for i in range(40)]
        if kind == "parquet":
            pq.write_table(pa.table({"text": texts}), d / f"shard_{f}.parquet", row_group_size=3)
        else:
            (d / f"shard_{f}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n\n" for t in texts))


@pytest.mark.parametrize("kind", ["parquet", "jsonl", "synthetic"])
def test_loader_resumes_without_tokenizing_what_it_consumed(tmp_path, kind):
    """A loader restored from a state taken after k batches gives the uninterrupted loader's next batches, and
    tokenizes at most one tokenizer batch (8 documents) to get there, however many documents came before: resuming
    late in a long run used to tokenize every document the rank had consumed. 2 ranks, past the end of the files."""
    from nanorl.dataloader import PretrainLoader

    data = None if kind == "synthetic" else str(tmp_path / "data")
    if data:
        write_pretrain_data(tmp_path / "data", kind)
    for rank in range(2):
        full = PretrainLoader(CountingTokenizer(), 2, 16, data_dir=data, rank=rank, world_size=2, tokenizer_batch=8)
        states, batches = [], []
        for _ in range(60):  # 60 x 2 rows of about one document each: more than a rank's 40 documents of 2 files
            states.append(full.state_dict())
            batches.append(torch.cat(full.next_batch()))
        for k in (0, 1, 5, 23, 41, 57):
            tok = CountingTokenizer()
            resumed = PretrainLoader(tok, 2, 16, data_dir=data, rank=rank, world_size=2, tokenizer_batch=8)
            tok.encoded = 0
            resumed.load_state_dict(states[k])
            assert tok.encoded <= 8, (kind, rank, k, tok.encoded, states[k]["docs_consumed"])
            for j in range(k, min(k + 3, 60)):
                assert torch.equal(torch.cat(resumed.next_batch()), batches[j]), (kind, rank, k, j)
            if k + 3 < 60:  # and it is where the uninterrupted loader was
                assert resumed.state_dict() == states[k + 3]


def test_the_batch_trial_compiles_the_graph_training_runs(base_dir):
    """2 ranks under DDP, torch.compile and the batch-size trial switched on for the CPU (tests/compile_fixture.py):
    the trial tries 2 rows, which fit, and training then runs that very graph: one graph compiled per rank for its one
    shape. A trial outside DDP, with one tensor as input and targets, compiled a graph that the first DDP step compiled
    again (split at DDP's buckets), so the batch size was checked on another graph."""
    env = {**os.environ, "NANORL_BASE_DIR": str(base_dir), "OMP_NUM_THREADS": "1"}
    flags = [*TINY, "--device-batch-size", "auto", "--total-batch-size", str(64 * 2 * 2), "--num-iterations", "2"]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd = [*launch, str(ROOT / "tests" / "compile_fixture.py"), "scripts.base_train", "--", *flags, "--model-tag", "cg"]
    out = warm_python.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "device batch (auto): 2 rows" in out.stdout and "step 00002/2" in out.stdout, out.stdout[-2000:]
    assert sorted(re.findall(r"rank (\d): compiled graphs: (\d+)", out.stdout)) == [("0", "1"), ("1", "1")], out.stdout
