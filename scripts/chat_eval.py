"""
Evaluate a chat model on tasks: generative ones by sampling through the engine and grading the text,
multiple-choice ones by comparing the logits of the answer letters after the prompt.

    python -m scripts.chat_eval -i rl                             # the held-out offline problems, as the card's row
    python -m scripts.chat_eval -i sft -a gsm8k,arc-easy,mmlu --task-path gsm8k=/data/gsm8k
    python -m scripts.chat_eval -i rl -a offline --num-samples 8 -k 1,8 --levels 3,4
    torchrun --nproc_per_node=8 -m scripts.chat_eval -i sft -a gsm8k,humaneval,arc-challenge

Reports accuracy, pass@k (the unbiased estimator from n samples per problem), with running accuracy as
problems finish, and ChatCORE when all of its tasks ran greedily: each task's accuracy minus its random
baseline, over (1 - baseline), averaged over tasks.CHATCORE_TASKS. Generative tasks are graded by the
task's own grader (task.evaluate), the same verdict RL's default reward (--rm-type task) pays.
"""

import sys
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist

from nanorl.common import skipped_on_any_rank
from nanorl.execution import require_sandbox, sandbox_missing
from nanorl.flags import ArgumentParser, int_list, nonneg_float, nonneg_int, positive_int
from nanorl.logger import print0
from nanorl.rl import pass_at_k
from nanorl.synthetic import levels_flag
from tasks import CHATCORE_TASKS, GRADED_TASKS, RANDOM_BASELINE, TASKS, get_task, task_class

NO_SANDBOX = "no sandbox"  # why a task that runs the model's code was skipped (nanorl/execution.py says more)


def centered(accuracy, baseline):
    """Accuracy with random guessing mapped to 0 and perfect to 1 (ChatCORE's per-task score)."""
    return (accuracy - baseline) / (1.0 - baseline)


@torch.no_grad()
def run_categorical(model, tokenizer, task, indices, batch_size=32, autocast=None, progress=None):
    """One bool per problem: is the reference letter the most likely of the problem's letters right after
    the prompt? Prompts are right-padded into batches; each row's logits are computed at its last position alone
    (model.logits_at). The batch is the largest of batch_size, batch_size / 2, ... whose forward at the longest prompt
    fits in memory (categorical_batch). None for a prompt longer than the model's context (scored as wrong, and
    counted)."""
    device = next(model.parameters()).device
    context = getattr(getattr(model, "config", None), "sequence_len", None)
    autocast = autocast if autocast is not None else nullcontext()
    all_convs = [task.get_example(i) for i in indices]
    all_prompts = [tokenizer.render_for_completion(c) for c in all_convs]
    longest = max((len(p) for p in all_prompts if context is None or len(p) <= context), default=1)
    batch_size = categorical_batch(model, batch_size, longest, autocast, device)
    out = []
    for s in range(0, len(indices), batch_size):
        convs, prompts = all_convs[s : s + batch_size], all_prompts[s : s + batch_size]
        fits = [context is None or len(p) <= context for p in prompts]
        convs, prompts, verdicts = [c for c, f in zip(convs, fits) if f], [p for p, f in zip(prompts, fits) if f], []
        if not prompts:
            out += [None] * len(fits)
            continue
        T = max(len(p) for p in prompts)
        x = torch.full((len(prompts), T), tokenizer.get_bos_token_id(), dtype=torch.long)
        for b, p in enumerate(prompts):
            x[b, : len(p)] = torch.tensor(p)
        last = torch.tensor([len(p) - 1 for p in prompts], device=device)
        with autocast:
            logits = model.logits_at(x.to(device), last)  # (B, V)
        for b, conv in enumerate(convs):
            letter_ids = [letter_token(tokenizer, l) for l in conv["letters"]]
            pred = conv["letters"][int(logits[b, letter_ids].argmax())]
            verdicts.append(pred == conv["label"])
        out += [verdicts.pop(0) if f else None for f in fits]
        for r in out[-len(fits) :]:
            if progress is not None:
                progress.add(float(bool(r)))
    return out


def categorical_batch(model, largest, T, autocast, device):
    """The prompts per categorical batch: the largest of largest, largest / 2, ... 1 whose forward at T tokens fits in
    memory, agreed by every rank (nanorl.batch_fit.fit_batch, as the training stages fit theirs)."""
    from nanorl.batch_fit import fit_batch
    from nanorl.logger import synchronize

    def trial(batch):
        x = torch.zeros(batch, T, dtype=torch.long, device=device)
        with autocast:
            model.logits_at(x, torch.full((batch,), T - 1, device=device))
        synchronize(device.type)

    candidates = [largest >> i for i in range(largest.bit_length())]
    batch, line = fit_batch(trial, candidates, device, what="categorical batch")
    if batch < largest:
        print0(line)
    return batch


def fitted_engine(model, tokenizer, largest, device):
    """The generative tasks' Engine at the most rows of largest, largest / 2, ... 1 whose KV cache, full-context
    prefill and decode step fit in memory, agreed by every rank (nanorl.batch_fit.fit_batch): -b is also the rows the
    engine decodes at once, and a large model's cache at -b 64 may not fit beside its weights."""
    from nanorl.batch_fit import fit_batch
    from nanorl.engine import Engine, Request
    from nanorl.logger import synchronize

    def trial(batch):  # every row a prompt of the whole context but one token, then one decoded token: the peak
        engine = Engine(model, tokenizer, batch_size=batch, cuda_graph=False)
        prompt = [tokenizer.get_bos_token_id()] * (engine.max_len - 1)
        engine.submit_and_wait([Request(prompt, num_samples=batch, max_tokens=1, stop_tokens=[], use_tools=False)])
        synchronize(device.type)

    candidates = [largest >> i for i in range(largest.bit_length())]
    batch, line = fit_batch(trial, candidates, device, what="engine batch")
    if batch < largest:
        print0(line)
    return Engine(model, tokenizer, batch_size=batch)


class Progress:
    """Running accuracy while problems finish: one line rewritten in place on a terminal, a line every tenth of
    the problems in a log file. Counts this rank's problems."""

    def __init__(self, name, total, log=print, tty=None):
        self.name, self.total, self.log, self.done, self.right = name, total, log, 0, 0.0
        self.tty = sys.stdout.isatty() if tty is None else tty
        self.every = max(1, total // 10)

    def add(self, correct_fraction):
        self.done += 1
        self.right += correct_fraction
        if self.tty or self.done % self.every == 0 or self.done == self.total:
            line = f"[{self.name}] {self.done}/{self.total} problems, running accuracy {self.right / self.done:.4f}"
            self.log("\r\033[K" + line if self.tty else line, **({"end": ""} if self.tty else {}))
            if self.tty and self.done == self.total:
                self.log("")


def letter_token(tokenizer, letter):
    ids = tokenizer.encode(letter)
    if len(ids) != 1:
        raise ValueError(f"answer letter {letter!r} is {len(ids)} tokens in this tokenizer; categorical eval needs one")
    return ids[0]


def run_generative(
    engine, tokenizer, task, indices, num_samples=1, max_tokens=256, temperature=0.0, top_k=None, seed=0, progress=None
):
    """Per problem, how many of its num_samples responses grade correct, plus the responses' text.
    Every problem is queued in the engine before the first result is awaited, so it batches and schedules them
    all itself; results are graded (task.evaluate, the task's one grader) as they arrive, in order.
    None for a prompt that leaves the engine no room to answer (scored as wrong, and counted)."""
    from nanorl.engine import Request

    convs = [task.get_example(i) for i in indices]
    prompts = [tokenizer.render_for_completion(c) for c in convs]
    max_len = getattr(engine, "max_len", None)
    fits = [max_len is None or len(p) < max_len for p in prompts]
    handles = iter(
        [
            engine.submit(
                Request(
                    prompt_ids=p,
                    num_samples=num_samples,
                    max_tokens=max_tokens,
                    temperature=temperature,
                    top_k=top_k,
                    seed=seed + i,
                )
            )
            for p, i, f in zip(prompts, indices, fits)
            if f
        ]
    )
    drop = {tokenizer.encode_special("<|assistant_end|>"), tokenizer.get_bos_token_id()}
    counts, texts = [], []
    for conv, f in zip(convs, fits):
        if not f:
            counts.append(None)
            texts.append([])
        else:
            responses = [tokenizer.decode([t for t in c.tokens if t not in drop]) for c in next(handles).result()]
            counts.append(sum(bool(task.evaluate(conv, r)) for r in responses))
            texts.append(responses)
        if progress is not None:
            progress.add((counts[-1] or 0) / num_samples)
    return counts, texts


def evaluate(
    task,
    model,
    tokenizer,
    engine,
    indices,
    num_samples=1,
    ks=(1,),
    max_tokens=256,
    temperature=0.0,
    top_k=None,
    seed=0,
    batch_size=32,
    autocast=None,
    progress=None,
):
    """Sums over this rank's problems: {"problems", "correct" (mean-per-problem accuracy sum), "pass@k" sums,
    "too_long" (prompts that do not fit the context: wrong)}. Sums, not means, so ranks can all_reduce them."""
    sums = {"problems": float(len(indices))}
    if task.eval_type == "categorical":
        right = run_categorical(model, tokenizer, task, indices, batch_size, autocast, progress)
        sums["correct"] = float(sum(bool(r) for r in right))
        sums["too_long"] = float(sum(r is None for r in right))
        return sums, None
    counts, texts = run_generative(
        engine, tokenizer, task, indices, num_samples, max_tokens, temperature, top_k, seed, progress
    )
    sums["too_long"] = float(sum(c is None for c in counts))
    counts = [c or 0 for c in counts]
    sums["correct"] = sum(c / num_samples for c in counts)
    for k in ks:
        sums[f"pass@{k}"] = sum(pass_at_k(num_samples, c, k) for c in counts)
    return sums, texts


def offline_name(args, levels):
    """The offline task as the card names it: its levels, and the problems' seed when it is not the card's."""
    return f"offline levels {levels}" + (f" (problem seed {args.problem_seed})" if args.problem_seed else "")


def task_runs(args, names):
    """(key, task name, offline levels) of each evaluation: every task once under its own name, the offline task once
    per --levels set (keyed by its card name when there are several), each set its own card row."""
    runs = []
    for name in names:
        sets = args.levels if name == "offline" else [None]
        runs += [(offline_name(args, lv) if len(sets) > 1 else name, name, lv) for lv in sets]
    return runs


def run_header(args, meta, task_names, temperature):
    """The line printed before the first problem: which model (source, tag, step), which tasks (the offline
    problems' levels), how answers are decoded, and how long they may be."""
    model = (
        f"Hugging Face model {args.hf_model}"
        if args.hf_model
        else f"{args.source} checkpoint {meta.get('model_tag')} step {meta.get('step')}"
    )
    seed = f", problem seed {args.problem_seed}" if args.problem_seed else ""
    tasks = ", ".join(
        f"offline (levels {lv}{seed})" if t == "offline" else t for _, t, lv in task_runs(args, task_names)
    )
    decoding = "greedy" if temperature == 0 else f"temperature {temperature:g}"
    decoding += f", top-k {args.top_k}" if args.top_k and temperature > 0 else ""
    samples = f"{args.num_samples} sample{'s' if args.num_samples > 1 else ''} per problem"
    problems = "all problems" if args.max_problems is None else f"at most {args.max_problems} problems per task"
    lengths = {t: max_new_tokens(t, args) for t in task_names}
    length = (
        f"at most {lengths[task_names[0]]} new tokens"
        if len(set(lengths.values())) == 1
        else "at most " + ", ".join(f"{n} new tokens ({t})" for t, n in lengths.items())
    )
    return f"evaluating {model} on {tasks} ({problems}): {decoding}, {samples}, {length}"


def max_new_tokens(name, args):
    """-m, else the task's own answer length (the offline problems' is shorter: their answers are one short line)."""
    return args.max_new_tokens or task_class(name).max_new_tokens


def all_reduce_sums(sums, device):
    if not (dist.is_available() and dist.is_initialized()):
        return sums
    keys = sorted(sums)
    t = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return dict(zip(keys, t.tolist()))


def add_offline_args(parser):
    """The offline task's flags: which levels (one card row per set) and which held-out problems."""
    parser.add_argument(
        "--levels",
        type=levels_flag,
        action="append",
        default=None,
        help="offline task: difficulty levels to evaluate (default: 1,2, the tiny speedrun's card row); repeat it for "
        "more sets, each evaluated and reported on its own (--levels 1,2 --levels 3,4)",
    )
    parser.add_argument(
        "--problem-seed",
        type=nonneg_int,
        default=0,
        help="offline task: the seed its held-out problems are drawn with (0: the card's; any seed draws only from "
        "the test split, which no stage trains on)",
    )


def parse_args():
    from nanorl.model_loading import add_model_args

    parser = ArgumentParser(description="Evaluate a chat model on tasks")
    add_model_args(parser, "sft", short=True)
    parser.add_argument(
        "-a",
        "--tasks",
        default="offline",
        help=f"comma-separated task names, of {', '.join(GRADED_TASKS)} (default: the held-out offline problems)",
    )
    parser.add_argument(
        "--task-path", action="append", default=[], metavar="NAME=PATH", help="local data for a Hub task (repeatable)"
    )
    parser.add_argument(
        "-x",
        "--max-problems",
        type=positive_int,
        default=None,
        help="evaluate at most this many problems per task (default: all)",
    )
    parser.add_argument(
        "-n", "--num-samples", type=positive_int, default=1, help="samples per problem (generative tasks)"
    )
    parser.add_argument(
        "-k", "--pass-k", type=int_list, default=None, help="comma-separated k for pass@k (default: 1 and n)"
    )
    parser.add_argument(
        "-t", "--temperature", type=nonneg_float, default=None, help="default: 0 (greedy) for 1 sample, else 1.0"
    )
    parser.add_argument(
        "--top-k", type=positive_int, default=None, help="sample from the k most likely tokens (default: all)"
    )
    parser.add_argument(
        "-m",
        "--max-new-tokens",
        "--max-tokens",
        type=positive_int,
        default=None,
        help="the most tokens an answer may have (default: the task's own: 128 for offline, 256 for the others)",
    )
    parser.add_argument(
        "-b", "--batch-size", type=positive_int, default=64, help="engine rows / categorical prompts at once"
    )
    add_offline_args(parser)
    parser.add_argument("--seed", type=nonneg_int, default=0, help="seed of the sampled answers")
    parser.add_argument("--device-type", default=None, help="cuda | cpu | mps (default: autodetect)")
    args = parser.parse_args()
    args.levels = args.levels or ["1,2"]
    ks = sorted(set(args.pass_k or [1]))
    if ks[-1] > args.num_samples:  # before any model is loaded
        parser.error(
            f"-k/--pass-k {','.join(map(str, ks))}: each k must be at most -n/--num-samples {args.num_samples}"
        )
    names = [t.strip().lower() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in names if t not in TASKS]
    if unknown:
        parser.error(f"-a/--tasks: unknown task {unknown[0]!r}; chat_eval grades {', '.join(GRADED_TASKS)}")
    ungraded = [t for t in names if t not in GRADED_TASKS]
    if ungraded:  # chat data (customjson, smoltalk, offline-chat) has no right answer to check a response against
        parser.error(
            f"-a/--tasks: {ungraded[0]} is chat data to train on and has no grader, so it cannot be evaluated; "
            f"chat_eval grades {', '.join(GRADED_TASKS)}"
        )
    code = [t for t in names if getattr(TASKS.get(t), "runs_code", False)]  # HumanEval runs the model's code
    if code and len(code) == len(names):
        require_sandbox()  # nothing else to evaluate: with no sandbox here, stop now in one line
    # beside other tasks, only these are skipped where there is no sandbox: {task: why} (a line and a card row each)
    why = sandbox_missing() if code else None
    args.unsandboxed = {name: why for name in code} if why else {}
    return args


def load_task(name, args, paths, skipped, levels=None):
    """The task's test split, or None for a Hub task that cannot be read here (no network, no --task-path): it is
    recorded in `skipped` with why, and the other tasks go on. A malformed data file stops with its name and row."""
    kw = {"path": paths[name]} if name in paths else {}
    if name == "offline":
        kw.update(levels=tuple(int(x) for x in levels.split(",")), seed=args.problem_seed)
    try:
        return get_task(name, "test", **kw)
    except RuntimeError as e:
        print0(f"skipping {name}: {e}")
        skipped[name] = str(e).splitlines()[0][:200]
        return None
    except ValueError as e:
        raise SystemExit(f"{name}: {e}")


def task_result(name, task, sums, levels=None):
    """All ranks' sums -> the task's means: accuracy, pass@k, the centred score, and which grader judged it."""
    from nanorl.rewards import make_reward

    res = {
        "accuracy": sums["correct"] / max(sums["problems"], 1),
        "problems": int(sums["problems"]),
        "too long for the context": int(sums["too_long"]),
    }
    res.update({k: v / max(sums["problems"], 1) for k, v in sums.items() if k.startswith("pass@")})
    res["centered"] = centered(res["accuracy"], RANDOM_BASELINE.get(name, 0.0))
    res["grader"] = "letter logits" if task.eval_type == "categorical" else make_reward("task", task=task)[1]
    if levels is not None:  # the offline problems' levels: their card row says which
        res["levels"] = levels
    return res


def print_result(name, res, texts, t0):
    """One response to read, then the task's line: accuracy, pass@k, seconds since t0."""
    shown = next((t[0] for t in texts or [] if t), None)
    if shown is not None:
        print0(f"[{name}] example response: {shown[:300]!r}")
    n_long = res["too long for the context"]
    too_long = f" ({n_long} too long for the context)" if n_long else ""
    print0(
        f"{name}: accuracy {res['accuracy']:.4f} on {res['problems']} problems{too_long}"
        + "".join(f", {k} {v:.4f}" for k, v in res.items() if k.startswith("pass@"))
        + f" ({time.time() - t0:.1f}s)"
    )


def score_card(results, args, n, temperature, skipped=None):
    """-> (the metrics card, one row per task saying how it was graded). Every number is labelled with its task,
    its size and greedy/sampled, so no two measurements share a row; ChatCORE joins them when it can be computed.
    A task skipped for want of a sandbox gets its row too, saying so."""
    from nanorl.report import eval_label

    card_names = {
        "gsm8k": "GSM8K",
        "arc-easy": "ARC-Easy",
        "arc-challenge": "ARC-Challenge",
        "mmlu": "MMLU",
        "humaneval": "HumanEval",
        "spellingbee": "SpellingBee",
    }
    card, rows, greedy = {}, [], n == 1 and temperature == 0
    for name, r in results.items():
        task_name = offline_name(args, r["levels"]) if "levels" in r else card_names.get(name, name)
        rows.append(
            {"task": task_name, "graded by": r["grader"], "too long for the context": r["too long for the context"]}
        )
        if greedy or r["grader"] == "letter logits":  # a letter's logits are read, never sampled: always greedy
            card[eval_label(task_name, "accuracy", r["problems"])] = r["accuracy"]
        else:  # sampled: pass@k rows (RL optimises pass@1, the expected reward), beside the greedy ones
            sampled = {k: v for k, v in r.items() if k.startswith("pass@")}
            card.update({eval_label(task_name, k, r["problems"], n, temperature): v for k, v in sampled.items()})
    for name, why in (skipped or {}).items():
        if why.endswith(NO_SANDBOX):  # (on another rank: "rank R: no sandbox")
            card[card_names.get(name, name)] = "skipped: no sandbox"
    # ChatCORE is the centred mean over its own tasks: computed only when every one of them ran greedily
    if greedy and all(t in results for t in CHATCORE_TASKS):
        chatcore = sum(results[t]["centered"] for t in CHATCORE_TASKS) / len(CHATCORE_TASKS)
        per_task = "" if args.max_problems is None else f", at most {args.max_problems} problems each"
        card[f"ChatCORE (greedy, {len(CHATCORE_TASKS)} tasks{per_task})"] = chatcore
        print0(f"ChatCORE (centred mean over {', '.join(CHATCORE_TASKS)}): {chatcore:.4f}")
    return card, rows


def main():
    from nanorl.common import compute_cleanup, compute_init
    from nanorl.model_loading import load_model_from_args
    from nanorl.precision import autocast_ctx
    from nanorl.report import log_section, record_metrics
    from nanorl.sft_data import task_paths

    args = parse_args()

    _, rank, _, world_size, device = compute_init(args.device_type)
    model, tokenizer, meta = load_model_from_args(args, device, phase="eval")
    engine = fitted_engine(model, tokenizer, args.batch_size, device)
    print0(engine.attention_kernels())
    n = args.num_samples
    ks = sorted(set(args.pass_k)) if args.pass_k else sorted({1, n})
    temperature = args.temperature if args.temperature is not None else (0.0 if n == 1 else 1.0)
    # how every task is decoded and batched: evaluate()'s keyword arguments
    decode = dict(num_samples=n, ks=ks, temperature=temperature, top_k=args.top_k)
    decode.update(seed=args.seed, batch_size=args.batch_size, autocast=autocast_ctx(device.type))
    paths = task_paths(args)
    results, skipped, t_all = {}, {}, time.time()
    names = [t.strip().lower() for t in args.tasks.split(",") if t.strip()]
    print0(run_header(args, meta, names, temperature))
    for name, why in args.unsandboxed.items():
        print0(f"skipping {name}: {why}")
        skipped[name] = NO_SANDBOX
    # every rank loads every task before the first is evaluated, and all skip any that one of them could not load
    runs = task_runs(args, names)
    tasks = {key: load_task(name, args, paths, skipped, lv) for key, name, lv in runs if name not in skipped}
    skipped = skipped_on_any_rank(skipped)
    for key, name, levels in runs:
        if name in skipped:
            continue
        task = tasks[key]
        N = len(task) if args.max_problems is None else min(len(task), args.max_problems)
        indices = list(range(rank, N, world_size))  # each rank a strided slice
        t0 = time.time()
        progress = Progress(key, len(indices), print0)
        tokens = max_new_tokens(name, args)
        sums, texts = evaluate(task, model, tokenizer, engine, indices, max_tokens=tokens, progress=progress, **decode)
        results[key] = task_result(name, task, all_reduce_sums(sums, device), levels)
        print_result(key, results[key], texts, t0)
    if not results:
        raise SystemExit(f"no task could be evaluated ({', '.join(skipped)}); with no network, use -a offline")
    card, rows = score_card(results, args, n, temperature, skipped)
    greedy = n == 1 and temperature == 0
    print0(f"total {time.time() - t_all:.1f}s")
    record_metrics(args.source, card, rank=rank)
    log_section(
        f"Chat eval {args.source}" + ("" if greedy else " sampled"),
        [
            {
                "source": f"{args.source} ({meta.get('model_tag', args.model_tag)})",
                "ranks": world_size,
                "decoding": "greedy" if greedy else f"sampled, T={temperature:g}, {n} samples per problem",
            },
            *rows,
            card,
            *([{f"skipped {k}": v for k, v in skipped.items()}] if skipped else []),
        ],
        config=vars(args),
        rank=rank,
    )
    compute_cleanup()
    return results


if __name__ == "__main__":
    main()
