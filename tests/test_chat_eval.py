import json
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from nanorl.gpt import GPTConfig, build_model
from nanorl.rl import pass_at_k
from nanorl.tokenizer import SPLIT_PATTERN, Tokenizer
from scripts.chat_eval import (
    Progress,
    centered,
    evaluate,
    fitted_engine,
    letter_token,
    run_categorical,
    run_generative,
    run_header,
)
from tasks import Task, TaskMixture
from tasks.common import render_mc
from tasks.offline import OfflineProblems

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_ranks({bytes([i]): i for i in range(256)}, SPLIT_PATTERN)


class ListTask(Task):
    def __init__(self, conversations, eval_type="generative", **kw):
        super().__init__(**kw)
        self.conversations, self.eval_type = conversations, eval_type

    def num_examples(self):
        return len(self.conversations)

    def example(self, i):
        return self.conversations[i]


def test_progress_lines(capsys):
    from nanorl.logger import print0

    progress = Progress("gsm8k", 20, log=print0, tty=False)  # a log file: a line every tenth of the problems
    for i in range(20):
        progress.add(float(i % 2 == 0))
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"[gsm8k] {n}/20 problems, running accuracy {(n + 1) // 2 / n:.4f}" for n in range(2, 21, 2)]
    progress = Progress("gsm8k", 3, log=print0, tty=True)  # a terminal: one line rewritten in place
    for v in (1.0, 0.0, 0.5):
        progress.add(v)
    out = capsys.readouterr().out
    assert (
        out
        == "".join(
            f"\r\033[K[gsm8k] {n}/3 problems, running accuracy {a:.4f}" for n, a in ((1, 1.0), (2, 0.5), (3, 0.5))
        )
        + "\n"
    )


def test_centered_mean():
    assert centered(0.25, 0.25) == 0.0 and centered(1.0, 0.25) == 1.0
    assert centered(0.625, 0.25) == pytest.approx(0.5) and centered(0.3, 0.0) == 0.3
    assert centered(0.0, 0.25) == pytest.approx(-1 / 3)  # worse than chance is negative


class LetterFavouringModel(torch.nn.Module):
    """At position t the fake model's favourite answer letter is letters[t % n]; a non-letter token beats
    every letter everywhere, so only an eval that restricts to the letters, at each row's last prompt
    position, gets the expected answers."""

    def __init__(self, tok, letters="ABCD"):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.letter_ids = [letter_token(tok, l) for l in letters]
        self.vocab = tok.vocab_size

    def forward(self, idx):
        B, T = idx.shape
        logits = torch.zeros(B, T, self.vocab)
        logits[:, :, ord("z")] = 100.0
        for t in range(T):
            logits[:, t, self.letter_ids[t % len(self.letter_ids)]] = 10.0
        return logits

    def logits_at(self, idx, pos):
        return self(idx)[torch.arange(idx.size(0)), pos]


def test_categorical_eval_picks_the_favoured_letter(tok):
    model = LetterFavouringModel(tok)
    convs, expected = [], []
    for i, q in enumerate(["Q?", "A longer question?", "Mid question", "x" * 17, "yy", "Which one is it, then?"]):
        favoured = (len(tok.render_for_completion(render_mc(q, ["w", "x", "y", "z"], 0))) - 1) % 4
        answer = favoured if i % 2 == 0 else (favoured + 1) % 4  # half right, half wrong
        conv = render_mc(q, ["w", "x", "y", "z"], answer_index=answer)
        convs.append(conv)
        expected.append(answer == favoured)
    assert any(expected) and not all(expected)  # the fixture has both right and wrong answers
    task = ListTask(convs, eval_type="categorical")
    got = run_categorical(model, tok, task, list(range(len(convs))), batch_size=4)  # mixed lengths, 2 batches
    assert got == expected
    sums, _ = evaluate(task, model, tok, None, list(range(len(convs))))
    assert sums == {"problems": len(convs), "correct": sum(expected), "too_long": 0}


def test_categorical_eval_on_a_model_that_knows_the_answer(tok):
    class Oracle(torch.nn.Module):  # reads the answer off a hint in the prompt: accuracy must be 1
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, idx):
            logits = torch.zeros(*idx.shape, tok.vocab_size)
            for b in range(idx.size(0)):
                text = tok.decode([t for t in idx[b].tolist() if t < 256])
                logits[b, :, letter_token(tok, text.split("hint=")[1][0])] = 5.0
            return logits

        def logits_at(self, idx, pos):
            return self(idx)[torch.arange(idx.size(0)), pos]

    convs = [render_mc(f"hint={l} what?", ["1", "2", "3", "4", "5"], "ABCDE".index(l)) for l in "EBDAC"]
    assert run_categorical(Oracle(), tok, ListTask(convs, "categorical"), [0, 1, 2, 3, 4], batch_size=2) == [True] * 5


def test_categorical_eval_makes_logits_only_where_it_scores_and_fits_its_batch(tok, monkeypatch, capsys):
    """The head sees one hidden state per prompt, never all T positions (at -b 64 on MMLU the fp32 logits of every
    position were tens of GB). Under a simulated memory limit of 2 prompts a forward (out of memory is caught, as on
    CUDA) the eval picks 2 of -b 8 and gives the same verdicts as without the limit."""
    import nanorl.batch_fit

    torch.manual_seed(0)
    model = build_model(
        GPTConfig(sequence_len=256, vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_kv_head=2, n_embd=32), "cpu"
    )
    head_inputs = []
    model.lm_head.register_forward_hook(lambda m, args, out: head_inputs.append(tuple(args[0].shape)))
    questions = ["Q?", "A longer question?", "Mid question", "x" * 17, "yy", "Which one is it, then?", "z", "ok?"]
    convs = [render_mc(q, ["w", "x", "y", "z"], answer_index=i % 4) for i, q in enumerate(questions)]
    task = ListTask(convs, eval_type="categorical")
    free = run_categorical(model, tok, task, list(range(8)), batch_size=8)
    assert None not in free and head_inputs == [(8, 32)]  # one batch: (prompts, width), the last position of each alone

    monkeypatch.setattr(nanorl.batch_fit, "oom_is_catchable", lambda device: True)
    real_hidden = model.hidden_states

    def hidden_states(idx, **kw):  # the memory limit: 2 prompts a forward
        if idx.size(0) > 2:
            raise torch.OutOfMemoryError("simulated: more than 2 prompts")
        return real_hidden(idx, **kw)

    monkeypatch.setattr(model, "hidden_states", hidden_states)
    head_inputs.clear()
    limited = run_categorical(model, tok, task, list(range(8)), batch_size=8)
    assert "categorical batch (auto): 2 rows, the largest that fits in memory (8, 4 did not)" in capsys.readouterr().out
    assert limited == free and head_inputs == [(2, 32)] * 5  # the trial at 2, then 4 batches of 2


def test_generative_eval_fits_its_engine_batch_to_memory(tok, monkeypatch, capsys):
    """-b is also the rows the engine decodes at once. Under a simulated memory limit of a 3-row KV cache (out of
    memory is caught, as on CUDA) the eval's engine takes 2 of -b 8, and answers the same problems with the same
    tokens as an engine of 8 rows."""
    import nanorl.batch_fit
    import nanorl.engine

    torch.manual_seed(0)
    model = build_model(
        GPTConfig(sequence_len=64, vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_kv_head=2, n_embd=32), "cpu"
    )
    task = OfflineProblems("test", n=6, levels=(1,))
    free = fitted_engine(model, tok, 8, torch.device("cpu"))  # out of memory is not caught on the CPU: no trial
    assert free.batch_size == 8 and capsys.readouterr().out == ""

    monkeypatch.setattr(nanorl.batch_fit, "oom_is_catchable", lambda device: True)
    real_cache = nanorl.engine.new_kv_cache

    def new_kv_cache(model, batch_size, *args):  # the memory limit: a cache of 3 rows
        if batch_size > 3:
            raise torch.OutOfMemoryError(f"simulated: a cache of {batch_size} rows")
        return real_cache(model, batch_size, *args)

    monkeypatch.setattr(nanorl.engine, "new_kv_cache", new_kv_cache)
    limited = fitted_engine(model, tok, 8, torch.device("cpu"))
    assert limited.batch_size == 2
    assert "engine batch (auto): 2 rows, the largest that fits in memory (8, 4 did not)" in capsys.readouterr().out
    answers = [run_generative(e, tok, task, list(range(6)), max_tokens=16) for e in (free, limited)]
    assert answers[0] == answers[1] and len(answers[0][1]) == 6


def test_generative_eval_batches_grades_and_shows_progress(tok, monkeypatch):
    @dataclass
    class Request:
        prompt_ids: list
        num_samples: int = 1
        max_tokens: int = 256
        temperature: float = 1.0
        top_k: int = None
        top_p: float = None
        seed: int = None
        stop_tokens: list = None
        use_tools: bool = True

    @dataclass
    class Completion:
        tokens: list
        logprobs: list = field(default_factory=list)
        mask: list = field(default_factory=list)
        status: str = "completed"
        prompt_len: int = 0

    fake = types.ModuleType("nanorl.engine")
    fake.Request = Request
    monkeypatch.setitem(sys.modules, "nanorl.engine", fake)

    task = OfflineProblems("test", n=6, levels=(1,))
    end = tok.encode_special("<|assistant_end|>")

    class Handle:
        def __init__(self, engine, completions):
            self.engine, self.completions = engine, completions

        def result(self):
            self.engine.awaited = True
            return self.completions

    class FakeEngine:
        def __init__(self):
            self.submitted, self.awaited = [], False

        def submit(self, r):
            assert not self.awaited  # every problem is queued before the first result is awaited: one batch
            j = len(self.submitted)
            self.submitted.append(r)
            label = int(task.get_example(j)["label"])
            # problem j: the first j of 4 samples are right (capped at 4)
            texts = [f"#### {label if s < j else label + 1}" for s in range(r.num_samples)]
            return Handle(self, [Completion(tokens=tok.encode(t) + [end]) for t in texts])

    lines = []
    progress = Progress("offline", 6, log=lambda line, **kw: lines.append(line))
    engine = FakeEngine()
    sums, texts = evaluate(task, None, tok, engine, list(range(6)), num_samples=4, ks=(1, 2, 4), progress=progress)
    assert len(engine.submitted) == 6 and [r.seed for r in engine.submitted] == list(range(6))
    c = [min(j, 4) for j in range(6)]
    assert sums["correct"] == pytest.approx(sum(x / 4 for x in c))
    for k in (1, 2, 4):
        assert sums[f"pass@{k}"] == pytest.approx(sum(pass_at_k(4, x, k) for x in c))
    assert texts[0][0] == f"#### {int(task.get_example(0)['label']) + 1}"  # <|assistant_end|> dropped
    # per-problem progress with the running accuracy (mean fraction of right samples so far), by hand
    running = [sum(x / 4 for x in c[: i + 1]) / (i + 1) for i in range(6)]
    assert lines == [f"[offline] {i + 1}/6 problems, running accuracy {running[i]:.4f}" for i in range(6)]
    # a prompt that leaves the engine no room is scored wrong and counted, not sent (the engine would raise)
    lengths = [len(tok.render_for_completion(task.get_example(j))) for j in range(6)]
    engine = FakeEngine()
    engine.max_len = sorted(lengths)[3]  # the 3 longest prompts do not fit
    engine.submit = lambda r: engine.submitted.append(r) or Handle(engine, [Completion(tokens=[end])] * r.num_samples)
    sums, _ = evaluate(task, None, tok, engine, list(range(6)), num_samples=2, ks=(1,))
    assert (
        sums["too_long"] == sum(n >= engine.max_len for n in lengths) and len(engine.submitted) == 6 - sums["too_long"]
    )
    assert sums["problems"] == 6 and sums["correct"] == 0


def test_offline_test_split_is_held_out_from_the_sft_mixture():
    train = TaskMixture([OfflineProblems("train", n=2000)])
    test = OfflineProblems("test", n=300, levels=(1,))
    train_q = {train.get_example(i)["messages"][0]["content"] for i in range(len(train))}
    assert not any(test.get_example(i)["messages"][0]["content"] in train_q for i in range(len(test)))


def test_problem_seed_draws_other_held_out_problems_under_their_own_card_row(monkeypatch):
    """--problem-seed: other problems of the test split (the record must generalise beyond the card's 200), each one
    held out by the split's hash like the card's, and a card row of its own so the card's row is never overwritten."""
    from nanorl import synthetic
    from scripts.chat_eval import load_task, parse_args, score_card

    monkeypatch.setattr(sys, "argv", ["chat_eval.py", "-i", "rl", "-x", "200", "--problem-seed", "1"])
    args = parse_args()
    card_task, other = load_task("offline", args, {}, {}, "1,2"), OfflineProblems("test", levels=(1, 2))
    seeded = [p["question"] for p in card_task.problems[:200]]
    assert seeded != [p["question"] for p in other.problems[:200]]
    assert all(synthetic._hash_split(p["split_key"]) == "test" for p in card_task.problems)
    result = {"offline": {"accuracy": 0.5, "problems": 200, "grader": "task", "too long for the context": 0}}
    result["offline"]["levels"] = "1,2"  # (task_result's entry for the offline task)
    card, _ = score_card(result, args, 1, 0.0)
    assert list(card) == ["offline levels 1,2 (problem seed 1) accuracy (greedy, 200 problems)"]


def test_a_pass_k_above_the_sample_count_stops_before_any_model_loads(tmp_path, monkeypatch, capsys):
    from scripts.chat_eval import parse_args

    monkeypatch.setenv("NANORL_BASE_DIR", str(tmp_path))  # no checkpoint anywhere: the flags alone must fail
    monkeypatch.setattr(sys, "argv", ["chat_eval.py", "-i", "rl", "-n", "2", "-k", "4,1"])
    with pytest.raises(SystemExit) as e:
        parse_args()
    assert e.value.code == 2 and "-k/--pass-k 1,4: each k must be at most -n/--num-samples 2" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["chat_eval.py", "--", "-s", "3", "-n", "4", "-k", "4"])  # torchrun's "--" too
    args = parse_args()
    assert (args.source, args.model_step, args.num_samples, args.pass_k) == ("sft", 3, 4, [4])


def test_run_header_names_the_model_tasks_levels_decoding_and_length():
    args = types.SimpleNamespace(
        hf_model=None,
        source="rl",
        levels=["1,2,3,4"],
        problem_seed=0,
        top_k=None,
        num_samples=1,
        max_problems=None,
        max_new_tokens=256,
    )
    meta = {"model_tag": "d20", "step": 1400}
    assert run_header(args, meta, ["offline", "gsm8k"], 0.0) == (
        "evaluating rl checkpoint d20 step 1400 on offline (levels 1,2,3,4), gsm8k (all problems): greedy, "
        "1 sample per problem, at most 256 new tokens"
    )
    args.problem_seed = 3
    assert run_header(args, meta, ["offline"], 0.0).startswith(
        "evaluating rl checkpoint d20 step 1400 on offline (levels 1,2,3,4, problem seed 3) (all problems)"
    )
    args.problem_seed = 0
    args.max_new_tokens = None  # each task's own
    assert run_header(args, meta, ["offline", "gsm8k"], 0.0).endswith(
        "at most 128 new tokens (offline), 256 new tokens (gsm8k)"
    )
    args.hf_model, args.top_k, args.num_samples, args.max_problems = "/m/qwen", 50, 8, 100
    assert run_header(args, {}, ["gsm8k"], 1.0) == (
        "evaluating Hugging Face model /m/qwen on gsm8k (at most 100 problems per task): temperature 1, top-k 50, "
        "8 samples per problem, at most 256 new tokens"
    )


# --- ranks agree on what they evaluate -----------------------------------------------------------


def _eval_ranks_worker(rank, world, ports, base_dir, bundle, out_path):
    """chat_eval -a gsm8k,offline and base_eval --eval core on 2 gloo ranks (torchrun's environment), where rank 1
    cannot load gsm8k nor the CORE bundle (a transient download failure). A tiny random GPT, a byte tokenizer."""
    import contextlib
    import io
    import os
    import runpy

    import nanorl.common
    import nanorl.core_eval
    import nanorl.model_loading
    import scripts.chat_eval as chat_eval
    from nanorl.gpt import GPTConfig, build_model

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    os.environ.update(NANORL_BASE_DIR=base_dir, OMP_NUM_THREADS="1")
    init = nanorl.common.compute_init
    # a bounded wait: ranks left in different collectives fail in 20 s rather than hang
    nanorl.common.compute_init = lambda *a, **kw: init(*a, **{**kw, "timeout_s": 20})
    tok = Tokenizer.from_ranks({bytes([i]): i for i in range(256)}, SPLIT_PATTERN)
    cfg = GPTConfig(sequence_len=256, vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_kv_head=1, n_embd=32)

    def load_model(args, device, **kw):
        torch.manual_seed(0)
        return build_model(cfg, device).eval(), tok, {"model_config": cfg.to_dict(), "model_tag": "t", "step": 0}

    def get_task(name, split, **kw):
        if name == "gsm8k":
            if rank == 1:
                raise RuntimeError("could not reach the Hub (raised by the test)")
            return OfflineProblems(split, n=4, levels=(1,))  # what rank 0 read: any small task will do
        return OfflineProblems(split, **kw)

    def get_bundle(*args):
        if rank == 1:
            raise OSError("download failed (raised by the test)")
        return bundle

    nanorl.model_loading.load_model_from_args = load_model
    chat_eval.get_task, nanorl.core_eval.get_bundle = get_task, get_bundle
    out, log = {}, io.StringIO()
    with contextlib.redirect_stdout(log):
        os.environ["MASTER_PORT"] = str(ports[0])
        sys.argv = ["chat_eval", "-a", "gsm8k,offline", "-x", "4", "-m", "8", "--levels", "1"]
        out["chat_eval"] = chat_eval.main()
        os.environ["MASTER_PORT"] = str(ports[1])
        sys.argv = ["base_eval", "--eval", "core"]
        out["base_eval"] = runpy.run_module("scripts.base_eval", run_name="__main__")["summary"]
    out["log"] = log.getvalue()
    torch.save(out, f"{out_path}.{rank}")


@pytest.mark.slow
def test_a_task_one_rank_cannot_load_is_skipped_by_every_rank(tmp_path):
    # without agreement, rank 0 evaluates gsm8k and all-reduces its sums with rank 1's offline ones, then waits
    # alone in offline's all-reduce (and in CORE's first task) until the timeout
    import socket

    import torch.multiprocessing as mp
    from test_core_eval import write_bundle

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    bundle = str(write_bundle(tmp_path))
    args = (2, ports, str(tmp_path / "base"), bundle, str(tmp_path / "out"))
    mp.spawn(_eval_ranks_worker, args=args, nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"out.{r}", weights_only=False) for r in (0, 1))
    assert list(r0["chat_eval"]) == ["offline"] and r0["chat_eval"] == r1["chat_eval"]
    assert r0["chat_eval"]["offline"]["problems"] == 4  # both ranks' halves
    assert "skipping gsm8k: rank 1 could not load it (could not reach the Hub (raised by the test))" in r0["log"]
    assert r0["base_eval"]["CORE"] == r1["base_eval"]["CORE"] == "skipped (no eval bundle)"
    assert "skipping CORE: rank 1 could not load it (download failed (raised by the test))" in r0["log"]


# --- no sandbox: only what runs the model's code is skipped --------------------------------------


def _sandbox(monkeypatch, mode):
    """This process's sandbox as sandbox_mode() decides it afresh: mode "" with bubblewrap failing its probe (no
    user namespaces), or "guard" (NANORL_SANDBOX=guard)."""
    import nanorl.execution as execution

    monkeypatch.setenv("NANORL_SANDBOX", mode)
    monkeypatch.setattr(execution, "_probe_bwrap", lambda: "bwrap probe failed: No permissions to create new namespace")
    monkeypatch.setattr(execution, "_mode", None)
    monkeypatch.setattr(execution, "_unavailable", None)


def test_without_a_sandbox_humaneval_is_skipped_with_a_line_and_a_card_row(tmp_path, monkeypatch, capsys):
    import json

    import nanorl.model_loading
    import scripts.chat_eval as chat_eval
    from nanorl.gpt import GPTConfig, build_model

    _sandbox(monkeypatch, "")
    monkeypatch.setenv("NANORL_BASE_DIR", str(tmp_path))
    tok = Tokenizer.from_ranks({bytes([i]): i for i in range(256)}, SPLIT_PATTERN)
    cfg = GPTConfig(sequence_len=256, vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_kv_head=1, n_embd=32)
    model = build_model(cfg, "cpu").eval()
    monkeypatch.setattr(nanorl.model_loading, "load_model_from_args", lambda *a, **kw: (model, tok, {"model_tag": "t"}))
    real_get_task = chat_eval.get_task

    def get_task(name, split, **kw):
        assert name != "humaneval", "a skipped task is not even loaded"
        return real_get_task(name, split, **kw)

    monkeypatch.setattr(chat_eval, "get_task", get_task)
    monkeypatch.setattr(sys, "argv", ["chat_eval", "-a", "offline,humaneval", "-x", "2", "-m", "8", "--levels", "1"])
    results = chat_eval.main()
    assert list(results) == ["offline"] and results["offline"]["problems"] == 2  # everything else runs
    why = (
        "model-written code runs only in the bubblewrap sandbox, which does not work here (bwrap probe failed: No "
        "permissions to create new namespace): install the bubblewrap package (apt-get install bubblewrap), or set "
        "NANORL_SANDBOX=guard to run it under the weaker in-process guard"
    )
    assert f"\nskipping humaneval: {why}\n" in capsys.readouterr().out
    card = json.loads(next(tmp_path.rglob("report_card.json")).read_text())["SFT"]
    assert card["HumanEval"] == "skipped: no sandbox" and len(card) == 2  # beside the offline accuracy row
    # nothing but HumanEval asked for: the run stops at its start, in the same one line
    monkeypatch.setattr(sys, "argv", ["chat_eval", "-a", "HumanEval"])
    with pytest.raises(SystemExit) as e:
        chat_eval.parse_args()
    assert str(e.value) == f"error: {why}"
    # NANORL_SANDBOX=guard opts in: nothing is skipped
    _sandbox(monkeypatch, "guard")
    monkeypatch.setattr(sys, "argv", ["chat_eval", "-a", "offline,humaneval"])
    assert chat_eval.parse_args().unsandboxed == {}


def test_each_levels_set_is_its_own_evaluation_and_card_row(tmp_path, monkeypatch, capsys):
    """--levels 1,2 --levels 3,4: the offline task twice in one run (one model load), each set's problems drawn at its
    own levels, each reported under its own line and card row, as the tiny speedrun's card shows both."""
    import nanorl.model_loading
    from scripts import chat_eval

    monkeypatch.setenv("NANORL_BASE_DIR", str(tmp_path))
    tok = Tokenizer.from_ranks({bytes([i]): i for i in range(256)}, SPLIT_PATTERN)
    cfg = GPTConfig(sequence_len=512, vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_kv_head=1, n_embd=32)
    model = build_model(cfg, "cpu").eval()
    monkeypatch.setattr(nanorl.model_loading, "load_model_from_args", lambda *a, **kw: (model, tok, {"model_tag": "t"}))
    loaded, real_get_task = [], chat_eval.get_task

    def get_task(name, split, **kw):
        task = real_get_task(name, split, **kw)
        loaded.append({p["level"] for p in task.problems[:3]})
        return task

    monkeypatch.setattr(chat_eval, "get_task", get_task)
    argv = ["chat_eval", "-i", "rl", "-x", "3", "-m", "4", "--levels", "1,2", "--levels", "3,4"]
    monkeypatch.setattr(sys, "argv", argv)
    results = chat_eval.main()
    assert list(results) == ["offline levels 1,2", "offline levels 3,4"]
    assert loaded[0] <= {1, 2} and loaded[1] <= {3, 4} and all(r["problems"] == 3 for r in results.values())
    out = capsys.readouterr().out
    assert "on offline (levels 1,2), offline (levels 3,4) (at most 3 problems per task)" in out
    assert "\noffline levels 3,4: accuracy " in out
    card = json.loads(next(tmp_path.rglob("report_card.json")).read_text())["RL"]
    assert sorted(card) == [  # (the card names a lone set's levels too: test_problem_seed_draws_...)
        "offline levels 1,2 accuracy (greedy, 3 problems)",
        "offline levels 3,4 accuracy (greedy, 3 problems)",
    ]


def test_defaults_reproduce_the_cards_offline_row_and_help_lists_the_tasks(monkeypatch, capsys):
    """`chat_eval -i rl -x 200` with no other flag evaluates what the tiny speedrun's card reports: offline levels 1,2,
    greedy, 128 new tokens (speedrun.sh's eval_rl line); --help names the tasks -a takes."""
    import re

    from scripts.chat_eval import max_new_tokens, parse_args

    script = (ROOT / "speedrun.sh").read_text()
    line = next(ln for ln in script.splitlines() if ln.strip().startswith("stage eval_rl "))
    gen = re.search(r"\bGEN=\$\(size (\d+) \d+\)", script).group(1)  # the full tiny run's size, not smoke's
    assert "-a offline" in line and "-m $GEN --levels 1,2" in line and gen == "128"
    monkeypatch.setattr(sys, "argv", ["chat_eval.py", "-i", "rl", "-x", "200"])
    args = parse_args()
    assert (args.tasks, args.levels, args.num_samples, args.temperature) == ("offline", ["1,2"], 1, None)
    assert max_new_tokens("offline", args) == 128 and max_new_tokens("gsm8k", args) == 256
    monkeypatch.setenv("COLUMNS", "300")
    monkeypatch.setattr(sys, "argv", ["chat_eval.py", "--help"])
    with pytest.raises(SystemExit):
        parse_args()
    assert (
        "task names, of offline, mmlu, mmlu-aux, arc-easy, arc-challenge, gsm8k, humaneval, spellingbee"
        in capsys.readouterr().out
    )


def test_chat_data_is_refused_in_one_line_naming_the_tasks_that_can_be_graded(tmp_path, monkeypatch, capsys):
    """-a customjson (chat data: no grader) ends before any model loads, in one line naming the gradable tasks."""
    from scripts.chat_eval import parse_args

    monkeypatch.setenv("NANORL_BASE_DIR", str(tmp_path))  # no checkpoint anywhere: the flags alone must fail
    argv = ["chat_eval.py", "-a", "customjson", "--task-path", f"customjson={tmp_path}/chat.jsonl"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as e:
        parse_args()
    assert e.value.code == 2 and capsys.readouterr().err == (
        "chat_eval.py: error: -a/--tasks: customjson is chat data to train on and has no grader, so it cannot be "
        "evaluated; chat_eval grades offline, mmlu, mmlu-aux, arc-easy, arc-challenge, gsm8k, humaneval, spellingbee "
        "(see --help)\n"
    )
