import os
import re
import sys
from pathlib import Path

import pytest
import torch
import warm_python  # pytest puts tests/ on sys.path
from test_chat_rl import base_dir  # noqa: F401  (a tokenizer and a tiny 'sft' checkpoint, tag t)

from nanorl.gpt import GPTConfig, build_model
from nanorl.sft_data import SFTLoader, render_example
from nanorl.tokenizer import SPLIT_PATTERN, Tokenizer
from scripts.chat_sft import lr_multiplier
from tasks import OfflineChat, OfflineProblems, Task, TaskMixture


@pytest.fixture(scope="module")
def tok():
    # a byte-level tokenizer: no training, every string encodable, letters are single tokens
    return Tokenizer.from_ranks({bytes([i]): i for i in range(256)}, SPLIT_PATTERN)


class ListTask(Task):
    def __init__(self, conversations, **kw):
        super().__init__(**kw)
        self.conversations = conversations

    def num_examples(self):
        return len(self.conversations)

    def example(self, i):
        return self.conversations[i]


TOOL_CONV = {
    "messages": [
        {"role": "user", "content": "What is 12*7?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me compute "},
                {"type": "python", "text": "12*7"},
                {"type": "python_output", "text": "84"},
                {"type": "text", "text": " so 84.\n#### 84"},
            ],
        },
        {"role": "user", "content": "thanks"},
        {"role": "assistant", "content": "You're welcome."},
    ]
}


def test_targets_are_exactly_what_the_assistant_wrote(tok):
    inputs, targets, truncated = render_example(tok, TOOL_CONV, seq_len=1000)
    ids, _ = tok.render_conversation(TOOL_CONV)
    assert not truncated and inputs == ids[:-1] and len(targets) == len(inputs)
    # independently rebuild who wrote each token, from the special tokens that delimit the turns
    sp = {
        n: tok.encode_special(n)
        for n in [
            "<|user_start|>",
            "<|user_end|>",
            "<|assistant_start|>",
            "<|assistant_end|>",
            "<|python_start|>",
            "<|python_end|>",
            "<|output_start|>",
            "<|output_end|>",
        ]
    }
    writer, in_assistant, in_output = [], False, False
    for t in ids:
        if t == sp["<|assistant_start|>"]:
            writer.append(False)
            in_assistant = True
        elif t == sp["<|output_start|>"]:
            in_output = True
            writer.append(False)
        elif t == sp["<|output_end|>"]:
            in_output = False
            writer.append(False)
        elif t == sp["<|assistant_end|>"]:
            writer.append(True)
            in_assistant = False
        else:
            writer.append(in_assistant and not in_output)
    expected = [t if w else -1 for t, w in zip(ids[1:], writer[1:])]
    assert targets == expected
    # the tool call itself is trained on, its output is not
    trained = tok.decode([t for t in targets if t >= 0])
    assert "12*7" in trained and "<|python_start|>" in trained and "<|output_start|>" not in trained
    assert "What is" not in trained and "thanks" not in trained
    assert trained.endswith("You're welcome.<|assistant_end|>")


def random_model(vocab_size, seq_len=1024, seed=0):
    torch.manual_seed(seed)
    model = build_model(
        GPTConfig(sequence_len=seq_len, vocab_size=vocab_size, n_layer=2, n_head=2, n_kv_head=1, n_embd=32), "cpu"
    )
    with torch.no_grad():  # init_weights zeroes the residual projections: randomise everything so attention matters
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


@pytest.mark.fp32("calls the model outside autocast, as an fp32 reference (CUDA's layout runs it under autocast only)")
def test_packed_loss_equals_per_conversation_losses(tok):
    convs = OfflineChat("train", n=12).conversations + [TOOL_CONV]
    loader = SFTLoader(ListTask(convs), tok, batch_size=2, seq_len=1024, shuffle=False, epochs=1)
    batches = list(loader)
    assert loader.stats["conversations"] == len(convs) and loader.stats["truncated"] == 0
    model = random_model(tok.vocab_size)
    with torch.no_grad():
        packed_sum = sum(model(x, y, doc_ids=d, loss_reduction="sum").item() for x, y, d in batches)
        packed_count = sum(int((y >= 0).sum()) for _, y, _ in batches)
        single_sums, single_counts = [], []
        for conv in convs:  # one at a time: no packing, no document mask, plain causal attention
            inputs, targets, _ = render_example(tok, conv, 1024)
            x, y = torch.tensor([inputs]), torch.tensor([targets])
            single_sums.append(model(x, y, loss_reduction="sum").item())
            single_counts.append(int((y >= 0).sum()))
            # per conversation, the token-mean loss from packing-free rendering is finite and positive
            assert single_sums[-1] / single_counts[-1] > 0
    assert packed_count == sum(single_counts)
    # the packed token-mean loss = the token-weighted mean of the per-conversation mean losses
    per_conv_means = [s / c for s, c in zip(single_sums, single_counts)]
    weighted = sum(m * c for m, c in zip(per_conv_means, single_counts)) / sum(single_counts)
    assert packed_sum / packed_count == pytest.approx(weighted, rel=1e-5)
    assert packed_sum == pytest.approx(sum(single_sums), rel=1e-5)
    # and it is not the same number if the document mask is ignored (the test has teeth)
    with torch.no_grad():
        unmasked = sum(model(x, y, loss_reduction="sum").item() for x, y, _ in batches)
    assert unmasked != pytest.approx(packed_sum, rel=1e-4)


def test_packing_rows_documents_and_padding(tok):
    task = OfflineProblems("train", n=60)
    loader = SFTLoader(task, tok, batch_size=4, seq_len=512, shuffle=False, epochs=1)
    seen_tokens, pad_before_last = 0, []
    for x, y, d in loader:
        pad_before_last.append((loader.stats["padding"], loader.stats["positions"]))
        assert x.shape == y.shape == d.shape == (4, 512)
        bos = tok.get_bos_token_id()
        assert not (y == bos).any()  # <|bos|> is never a target: nothing predicts across a document boundary
        for b in range(4):
            ids = d[b].tolist()
            assert ids == sorted(ids)  # documents are contiguous runs
            starts = [0] + [i for i in range(1, 512) if ids[i] != ids[i - 1]]
            assert all(x[b, i] == bos for i in starts)  # each run is a whole conversation (or the padded tail)
            tail = [i for i, v in enumerate(ids) if v == ids[-1]]
            if (y[b, tail] == -1).all():  # the padded tail: nothing to learn there
                assert (x[b, tail] == bos).all()
        seen_tokens += int((y >= 0).sum())
    expected = sum(sum(t >= 0 for t in render_example(tok, task.get_example(i), 512)[1]) for i in range(len(task)))
    assert seen_tokens == expected  # every conversation once, nothing lost
    # best-fit packing wastes only row tails (the last batch of an epoch is allowed to be mostly empty)
    pad, pos = pad_before_last[-2]
    assert 0 <= pad / pos < 0.1, pad / pos


def test_document_starts_restart_positions(tok):
    convs = OfflineChat("train", n=6).conversations
    loader = SFTLoader(ListTask(convs), tok, batch_size=1, seq_len=1024, shuffle=False, epochs=1)
    x, _, d = loader.next_batch()
    starts = [0] + [i for i in range(1, 1024) if d[0, i] != d[0, i - 1]]
    # every document (but the padded tail) starts with <|bos|>, exactly where its id starts
    docs = starts[:-1] if loader.stats["padding"] else starts
    assert all(x[0, s] == tok.get_bos_token_id() for s in docs)


def test_truncation_is_counted(tok):
    long = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x" * 300}]}
    prompt_only = {"messages": [{"role": "user", "content": "y" * 300}, {"role": "assistant", "content": "ok"}]}
    short = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    loader = SFTLoader(ListTask([long, prompt_only, short]), tok, batch_size=2, seq_len=64, shuffle=False, epochs=1)
    batches = list(loader)
    assert loader.stats["truncated"] == 2  # both long ones, never silently
    assert loader.stats["no_target"] == 1  # the truncated prompt left nothing to learn: skipped and counted
    assert sum(int((y >= 0).sum()) for _, y, _ in batches) == (64 - 5) + len("hello") + 1
    with pytest.raises(ValueError, match="no conversation"):  # nothing to learn at all: an error, not a hang
        SFTLoader(
            ListTask([prompt_only]), tok, batch_size=1, seq_len=64
        ).next_batch()  # 65 ids kept; the first 6 (bos, user turn, <|assistant_start|>) are not the assistant's


def test_ddp_shards_are_disjoint_and_cover_the_data(tok):
    task = OfflineProblems("train", n=40)
    seen = []
    for rank in range(2):
        loader = SFTLoader(task, tok, batch_size=2, seq_len=512, rank=rank, world_size=2, seed=3, epochs=1)
        idx = []
        orig = loader._render

        def spy(i, orig=orig, idx=idx):
            idx.append(i)
            return orig(i)

        loader._render = spy
        list(loader)
        seen.append(idx)
    assert set(seen[0]).isdisjoint(seen[1]) and sorted(seen[0] + seen[1]) == list(range(40))


def test_resume_gives_the_same_batches(tok):
    task = TaskMixture([OfflineProblems("train", n=50), OfflineChat("train", n=50)])
    a = SFTLoader(task, tok, batch_size=2, seq_len=300, seed=1, pool_size=8)
    for _ in range(7):
        a.next_batch()
    state = a.state_dict()
    expected = [a.next_batch() for _ in range(30)]  # crosses an epoch boundary
    assert a.epoch >= 1
    b = SFTLoader(task, tok, batch_size=2, seq_len=300, seed=1, pool_size=8)
    b.load_state_dict(state)
    for e, got in zip(expected, (b.next_batch() for _ in range(30))):
        assert all(torch.equal(u, v) for u, v in zip(e, got))


def test_epochs_reshuffle_and_progress(tok):
    task = OfflineProblems("train", n=20)
    loader = SFTLoader(task, tok, batch_size=1, seq_len=2048, seed=0, pool_size=4)
    first = list(loader.order)
    while loader.epoch == 0:
        loader.next_batch()
    assert loader.order != first and sorted(loader.order) == sorted(first)
    assert 1.0 <= loader.progress < 2.0


def test_lr_multiplier():
    assert lr_multiplier(0.0, 0.2) == 1.0 and lr_multiplier(0.79, 0.2) == 1.0
    assert lr_multiplier(0.9, 0.2) == pytest.approx(0.5) and lr_multiplier(1.0, 0.2) == 0.0
    assert lr_multiplier(0.25, 1.0) == pytest.approx(0.75)  # SFT: linear decay all along
    assert lr_multiplier(0.5, 0.0) == 1.0


class TargetSumModel(torch.nn.Module):
    """Computes on the CPU while its weights (lm_head.weight.device) are on 'meta': FSDP's --cpu-offload seen from
    a CPU test, where the weights live in host memory and the losses come out on the GPU. Its summed "loss" is the
    sum of the batch's target ids, so the token-mean is known by hand."""

    def __init__(self):
        super().__init__()
        self.lm_head = torch.nn.Linear(1, 1, device="meta")

    def forward(self, x, y, doc_ids=None, loss_reduction="mean"):
        assert loss_reduction == "sum"
        return (y * (y >= 0)).sum().float()


def test_eval_loss_accumulates_on_the_compute_device():
    from contextlib import nullcontext

    from scripts.chat_sft import eval_loss

    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(3):
        y = torch.randint(-1, 9, (2, 5), generator=g)  # -1: not a target
        batches.append((torch.zeros(2, 5, dtype=torch.long), y, torch.zeros(2, 5, dtype=torch.long)))
    ys = torch.cat([y for _, y, _ in batches[:2]])
    want = ys[ys >= 0].double().mean().item()  # two batches asked for
    assert eval_loss(TargetSumModel(), batches, 2, nullcontext(), torch.device("cpu")) == pytest.approx(want)


ROOT = Path(__file__).resolve().parents[1]
# a small base model, trained briefly: SFT has format and arithmetic to teach it, in half a minute of CPU (held-out
# level-1 accuracy base 0.10 -> SFT 0.43 measured on an AVX2 CPU; the test asks for +0.2)
E2E_BASE = [
    "--depth",
    "4",
    "--aspect-ratio",
    "32",
    "--head-dim",
    "32",
    "--max-seq-len",
    "256",
    "--device-batch-size",
    "16",
    "--total-batch-size",
    "4096",
    "--num-iterations",
    "25",
    "--eval-every",
    "0",
    "--sample-every",
    "0",
]
E2E_SFT = [
    "--source",
    "base",
    "--levels",
    "1",
    "--num-examples",
    "1000",
    "--num-iterations",
    "40",
    "--init-lr-frac",
    "1.0",
    "--device-batch-size",
    "16",
    "--eval-every",
    "1000",
    "--eval-tokens",
    "4096",
]


@pytest.mark.slow
def test_sft_beats_the_base_model_on_held_out_offline_problems(tmp_path, monkeypatch):
    """The whole point of SFT, on a CPU: tokenizer -> tiny base model -> SFT on the offline curriculum, then both
    models answer the same 100 held-out level-1 problems (greedy, through the engine); SFT must be >= 0.2 better."""
    env = {**os.environ, "NANORL_BASE_DIR": str(tmp_path), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    for cmd in (
        ["scripts.tok_train", "--vocab-size", "1024", "--max-chars", "300000"],
        ["scripts.base_train", *E2E_BASE],
        ["scripts.chat_sft", *E2E_SFT],
    ):
        out = warm_python.run(
            [sys.executable, "-m", *cmd], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
        )
        assert out.returncode == 0, f"{cmd[0]} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    # SFT's progress line has an ETA from step 1 on (its progress moves unevenly: it is epochs of packed rows)
    assert re.search(r"step     1 \| .* \| eta \d+\.\dm", out.stdout) and "eta nan" not in out.stdout, out.stdout[
        -2000:
    ]
    from nanorl.engine import Engine
    from nanorl.model_loading import load_model
    from scripts.chat_eval import evaluate

    monkeypatch.setenv("NANORL_BASE_DIR", str(tmp_path))
    task = OfflineProblems("test", n=100, levels=(1,))
    acc = {}
    for source in ("base", "sft"):
        model, tok, _ = load_model(source, "cpu")
        sums, _ = evaluate(
            task, model, tok, Engine(model, tok, batch_size=100), list(range(len(task))), max_tokens=64, temperature=0.0
        )
        acc[source] = sums["correct"] / sums["problems"]
    print(f"held-out level-1 accuracy: base {acc['base']:.2f}, sft {acc['sft']:.2f}")
    assert acc["sft"] >= acc["base"] + 0.2, acc


@pytest.mark.slow
def test_sft_packs_the_next_step_while_the_device_works(base_dir, monkeypatch):  # noqa: F811
    """The loop packs step s+1's rows after launching step s and before waiting for its loss (on a GPU the host packs
    while the device computes), and its checkpoint holds the loader's position after step s, not the prefetched one."""
    from argparse import ArgumentParser

    import scripts.chat_sft as chat_sft
    from nanorl.checkpoint import load_checkpoint
    from nanorl.tokenizer import get_tokenizer

    monkeypatch.setenv("NANORL_BASE_DIR", str(base_dir))
    events, real_next, real_step = [], SFTLoader.next_batch, chat_sft.train_step

    def next_batch(self):
        if self.shuffle:  # the training loader (the held-out one reads in order)
            events.append("pack")
        return real_next(self)

    class Loss:  # the step's loss, recording when the loop waits for it
        def __init__(self, t):
            self.t = t

        def item(self):
            events.append("wait")
            return self.t.item()

    monkeypatch.setattr(SFTLoader, "next_batch", next_batch)
    monkeypatch.setattr(chat_sft, "train_step", lambda *a: Loss(real_step(*a)))
    parser = ArgumentParser()
    chat_sft.add_train_args(parser, "sft", source="sft", init_lr_frac=0.02, warmdown_ratio=1.0, num_epochs=1)
    argv = "--model-tag t --levels 1 --num-examples 100 --num-iterations 3 --device-batch-size 2 --max-seq-len 128"
    args = parser.parse_args(argv.split() + "--eval-every 100 --eval-tokens 256 --output-tag prefetch".split())
    out = chat_sft.train(args, "sft", chat_sft.hub_mixture, chat_sft.offline_mixture)
    train = chat_sft.offline_mixture(args)[0]
    assert events == ["pack"] + ["pack", "wait"] * 3, events
    fresh = SFTLoader(train, get_tokenizer(), 2, 128, seed=args.seed)
    for _ in range(3):
        real_next(fresh)
    saved = load_checkpoint(out["checkpoint_dir"], 3, load_optimizer=True)[3]["loader"]
    assert saved == fresh.state_dict() and out["stats"] == fresh.stats


# -----------------------------------------------------------------------------------------------
# --data hub: every rank trains on the same data, or none trains


def _hub_args(*task_paths):
    from argparse import Namespace

    return Namespace(data="hub", task_path=list(task_paths))


def _hub_fails_on(ranks):
    """A hub_mixture that cannot reach the Hub on `ranks` (as a node without network or cache), and loads elsewhere."""

    def hub_mixture(args, paths):
        import torch.distributed as dist

        from nanorl.errors import Unreadable

        if (dist.get_rank() if dist.is_initialized() else 0) in ranks:
            raise Unreadable("could not load allenai/ai2_arc (ARC-Easy, train): ConnectionError\nno network? ...")
        return ListTask([TOOL_CONV] * 4), ListTask([TOOL_CONV])

    return hub_mixture


def _offline(args):
    return ListTask([TOOL_CONV] * 2), ListTask([TOOL_CONV])


def test_a_named_task_path_that_is_missing_stops_instead_of_falling_back(tmp_path):
    """The Hub out of reach for a task nobody named (it loads first) and a --task-path file that is not there: the
    stage stops on the user's path, rather than training on the offline curriculum with a warning."""
    from nanorl.errors import Unreadable
    from nanorl.sft_data import build_data

    missing = tmp_path / "gsm8k.jsonl"
    with pytest.raises(Unreadable, match=f"^--data hub: --task-path gsm8k={missing}: no such file"):
        build_data(_hub_args(f"gsm8k={missing}"), _hub_fails_on({0}), _offline)
    missing.write_text("")  # there, but the Hub fails for another task: no fallback either while a path is named
    with pytest.raises(Unreadable, match="^--data hub: could not load allenai/ai2_arc.*no offline fallback"):
        build_data(_hub_args(f"gsm8k={missing}"), _hub_fails_on({0}), _offline)
    train, _, desc = build_data(_hub_args(), _hub_fails_on({0}), _offline)  # nothing named, no Hub: the fallback
    assert len(train) == 2 and desc.startswith("offline (fallback: could not load allenai/ai2_arc")


def test_a_task_path_the_stage_never_reads_stops_instead_of_being_ignored(tmp_path):
    """A --task-path whose name the stage's mixture never asks for (a typo, another stage's task) or given with
    --data offline would be a flag quietly ignored: the stage stops in one line naming it and the tasks it reads."""
    from argparse import Namespace

    from nanorl.errors import BadValue, Unreadable
    from nanorl.sft_data import build_data

    def reading(*names):  # a hub mixture that asks for these tasks' paths, as mid_train's and chat_sft's do
        return lambda args, paths: [paths.get(n) for n in names] and (ListTask([TOOL_CONV] * 4), ListTask([TOOL_CONV]))

    f = tmp_path / "gsm8k.jsonl"
    f.write_text("")
    train, _, desc = build_data(_hub_args(f"gsm8k={f}"), reading("smoltalk", "gsm8k"), _offline)
    assert len(train) == 4 and desc == "hub"
    with pytest.raises(
        Unreadable,
        match=rf"--task-path gsm8kk={f}: this stage's mixture has no task 'gsm8kk' \(its tasks: gsm8k, smoltalk\)",
    ):
        build_data(_hub_args(f"gsm8kk={f}"), reading("smoltalk", "gsm8k"), _offline)
    with pytest.raises(BadValue, match="^--task-path gsm8k=...: only --data hub reads task files"):
        build_data(Namespace(data="offline", task_path=[f"gsm8k={f}"]), reading("gsm8k"), _offline)


def _agree_worker(rank, world, init_file, out_dir, failing):
    import torch.distributed as dist

    from nanorl.sft_data import build_data

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        out = build_data(_hub_args(), _hub_fails_on(failing), _offline)
        result = ("ok", len(out[0]), out[2])
    except Exception as e:  # noqa: BLE001 - what each rank met is the result
        result = (type(e).__name__, str(e))
    finally:
        dist.destroy_process_group()
    torch.save(result, f"{out_dir}/agree{rank}.pt")


@pytest.mark.parametrize("failing", [{1}, {0, 1}])
def test_ranks_agree_on_the_data_source(tmp_path, failing):
    """2 gloo ranks. Rank 1 alone cannot load the Hub's datasets: both stop, naming rank 1 (before, rank 1 trained on
    the ~10x shorter offline curriculum and its epoch ended everyone's training early). Neither can: both fall back."""
    import torch.multiprocessing as mp

    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    mp.start_processes(
        _agree_worker, args=(2, str(tmp_path / "init"), str(tmp_path), failing), nprocs=2, start_method=method
    )
    results = [torch.load(tmp_path / f"agree{r}.pt") for r in range(2)]
    if failing == {1}:
        for kind, msg in results:
            assert kind == "Unreadable" and msg.startswith("--data hub: rank 1 of 2: could not load allenai/ai2_arc")
    else:
        assert results[0] == results[1] and results[0][:2] == ("ok", 2) and "fallback" in results[0][2]


# -----------------------------------------------------------------------------------------------
# --device-batch-size auto: the batch that fits in memory, the same step


@pytest.mark.fp32("16 rows against 4 accumulated micro-batches to fp32 summation order; bf16 rounds each micro-batch")
@pytest.mark.parametrize("stage", ["mid", "sft"])
def test_a_stage_fits_its_batch_to_memory_and_trains_the_same_step(base_dir, monkeypatch, capsys, stage):  # noqa: F811
    """Out of memory caught as on CUDA, and a simulated limit of 4 rows a forward: --device-batch-size auto tries 16
    and 8, takes 4 and accumulates 4 micro-batches, so the step keeps its 16 rows (the d20 SFT step at 16 rows was
    61.4 GB on one H100). The weights and optimizer state equal --device-batch-size 4 --total-batch-size 1024's bit for
    bit, and 16 rows at once to summation order."""
    from argparse import ArgumentParser

    import nanorl.batch_fit
    import scripts.chat_sft as chat_sft
    import scripts.mid_train as mid_train
    from nanorl.checkpoint import load_checkpoint
    from nanorl.gpt import GPT

    monkeypatch.setenv("NANORL_BASE_DIR", str(base_dir))
    monkeypatch.setattr(nanorl.batch_fit, "oom_is_catchable", lambda device: True)
    script = mid_train if stage == "mid" else chat_sft
    limit, real_forward = [None], GPT.forward

    def forward(self, idx, *a, **kw):
        if limit[0] is not None and idx.size(0) > limit[0]:
            raise torch.OutOfMemoryError(f"simulated: more than {limit[0]} rows")
        return real_forward(self, idx, *a, **kw)

    monkeypatch.setattr(GPT, "forward", forward)

    def run(tag, *flags):
        parser = ArgumentParser()
        chat_sft.add_train_args(parser, stage, source="sft", init_lr_frac=1.0, warmdown_ratio=0.5, num_epochs=1)
        argv = "--model-tag t --levels 1 --num-examples 100 --num-iterations 2 --max-seq-len 64 --eval-every 100"
        args = parser.parse_args([*argv.split(), "--eval-tokens", "256", "--output-tag", f"{stage}-{tag}", *flags])
        out = chat_sft.train(args, stage, script.hub_mixture, script.offline_mixture)
        return load_checkpoint(out["checkpoint_dir"], 2, load_optimizer=True)[:2]

    limit[0] = 4
    fitted = run("fitted")
    assert "device batch (auto): 4 rows, the largest that fits in memory (16, 8 did not)" in capsys.readouterr().out
    limit[0] = None
    four = run("four", "--device-batch-size", "4", "--total-batch-size", "1024")
    sixteen = run("sixteen")
    assert "device batch (auto): 16 rows" in capsys.readouterr().out
    for k, v in fitted[0].items():
        assert torch.equal(v, four[0][k]), k
        assert torch.allclose(v.float(), sixteen[0][k].float(), rtol=1e-4, atol=1e-5 * v.abs().max().item()), k
    moments = [
        (s, t) for i in fitted[1]["state"] for s, t in zip(fitted[1]["state"][i].values(), four[1]["state"][i].values())
    ]
    assert moments and all(torch.equal(s, t) for s, t in moments if torch.is_tensor(s))
