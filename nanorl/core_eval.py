"""
The CORE metric of the DCLM paper (arXiv 2406.11794): in-context-learning tasks scored by a base model's
own losses, no generation. Three kinds of task:

- multiple_choice: one query, several answers. Pick the answer whose tokens have the lowest mean loss.
- schema: several contexts, one continuation. Pick the context under which the continuation has the
  lowest mean loss (Winograd-style: which referent makes the rest of the sentence likely).
- language_modeling: a context and its continuation. Correct only if greedy prediction reproduces every
  token of the continuation (LAMBADA-style).

Each task's accuracy is centred against its random baseline, (acc - base) / (1 - base), so chance is 0 and
perfect is 1 whatever the number of choices; CORE is the mean of the centred accuracies.

The eval bundle (eval_bundle/) holds core.yaml (the tasks: label, icl_task_type, dataset_uri, num_fewshot,
continuation_delimiter), eval_meta_data.csv (the "Random baseline" of each "Eval Task", in percent) and
eval_data/<dataset_uri> (one JSON object per line).
"""

import csv
import json
import os
import random
import shutil
import tempfile
import urllib.request
import zipfile

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nanorl.common import get_base_dir
from nanorl.dataset import download_file, file_lock

EVAL_BUNDLE_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"
TASK_TYPES = ("multiple_choice", "schema", "language_modeling")


# -----------------------------------------------------------------------------------------------------
# The bundle


def get_bundle(bundle_dir=None, url=EVAL_BUNDLE_URL, opener=urllib.request.urlopen):
    """The directory of an unzipped eval bundle: bundle_dir if given, else <base>/eval_bundle, downloaded and
    unzipped on first use (under a lock, through a temp dir, so a crash or a second rank never sees half of it)."""
    if bundle_dir is not None:
        if not os.path.isfile(os.path.join(bundle_dir, "core.yaml")):
            raise FileNotFoundError(f"--bundle-dir {bundle_dir} has no core.yaml: point it at an unzipped eval_bundle")
        return bundle_dir
    base = get_base_dir()
    final = os.path.join(base, "eval_bundle")
    if os.path.isfile(os.path.join(final, "core.yaml")):
        return final
    zip_path = download_file(url, os.path.join(base, "eval_bundle.zip"), opener=opener, validate=_zip_ok)
    with file_lock(final):
        if not os.path.isfile(os.path.join(final, "core.yaml")):  # another rank may have unzipped it meanwhile
            tmp = tempfile.mkdtemp(dir=base, prefix="eval_bundle.tmp")
            with zipfile.ZipFile(zip_path) as z:
                z.extractall(tmp)
            inner = os.path.join(tmp, "eval_bundle")  # the zip holds one top-level eval_bundle/ directory
            src = inner if os.path.isdir(inner) else tmp
            if not os.path.isfile(os.path.join(src, "core.yaml")):
                shutil.rmtree(tmp)
                raise RuntimeError(f"{zip_path} (from {url}) has no eval_bundle/core.yaml")
            if os.path.isdir(final):  # a leftover without core.yaml: replace it
                shutil.rmtree(final)
            os.replace(src, final)
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _zip_ok(path):
    with zipfile.ZipFile(path) as z:  # raises BadZipFile on a truncated download
        bad = z.testzip()
    if bad is not None:
        raise zipfile.BadZipFile(f"{path}: member {bad} is corrupt")


def load_tasks(bundle_dir):
    """[{label, type, num_fewshot, delimiter, random_baseline (a fraction), rows}] of core.yaml, checked."""
    import yaml  # lazily: only CORE needs it

    with open(os.path.join(bundle_dir, "core.yaml"), encoding="utf-8") as f:
        config = yaml.safe_load(f)
    baselines = {}
    meta_path = os.path.join(bundle_dir, "eval_meta_data.csv")
    with open(meta_path, encoding="utf-8") as f:
        for row in csv.DictReader(f):
            baselines[row["Eval Task"]] = float(row["Random baseline"]) / 100  # the csv has percents
    tasks = []
    for t in config["icl_tasks"]:
        label, kind = t["label"], t["icl_task_type"]
        if kind not in TASK_TYPES:
            raise ValueError(f"core.yaml task {label!r}: icl_task_type {kind!r} is not one of {', '.join(TASK_TYPES)}")
        if label not in baselines:
            raise ValueError(f"core.yaml task {label!r} has no random baseline in {meta_path}")
        shots = t["num_fewshot"]
        path = os.path.join(bundle_dir, "eval_data", t["dataset_uri"])
        tasks.append(
            {
                "label": label,
                "type": kind,
                "num_fewshot": shots[0] if isinstance(shots, list) else shots,
                "delimiter": t.get("continuation_delimiter", " "),
                "random_baseline": baselines[label],
                "rows": _read_rows(path, kind),
            }
        )
    return tasks


REQUIRED = {
    "multiple_choice": ("query", "choices", "gold"),
    "schema": ("context_options", "continuation", "gold"),
    "language_modeling": ("context", "continuation"),
}


def _read_rows(path, kind):
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON ({e})") from e
            missing = [k for k in REQUIRED[kind] if k not in row]
            if missing:
                raise ValueError(f"{path}:{lineno}: a {kind} row needs {', '.join(missing)}")
            rows.append(row)
    return rows


# -----------------------------------------------------------------------------------------------------
# Prompts: few-shot examples first, each followed by a blank line, then the item itself


def render_prompts(item, kind, delimiter, fewshot=()):
    """The texts to score for one item: one per choice (multiple_choice) or context (schema); for
    language_modeling [context without, context with the continuation]."""
    if kind == "multiple_choice":
        shots = "".join(f"{ex['query']}{delimiter}{ex['choices'][ex['gold']]}\n\n" for ex in fewshot)
        return [f"{shots}{item['query']}{delimiter}{choice}" for choice in item["choices"]]
    if kind == "schema":
        shots = "".join(f"{ex['context_options'][ex['gold']]}{delimiter}{ex['continuation']}\n\n" for ex in fewshot)
        return [f"{shots}{context}{delimiter}{item['continuation']}" for context in item["context_options"]]
    # language modeling: contexts can carry stray whitespace, which would merge into the continuation's
    # first token; stripping it keeps the prompt without the continuation a token prefix of the one with it
    shots = "".join(f"{ex['context'].strip()}{delimiter}{ex['continuation']}\n\n" for ex in fewshot)
    prefix = f"{shots}{item['context'].strip()}{delimiter}"
    return [prefix.strip(), prefix + item["continuation"]]


def common_length(seqs, from_end=False):
    """Length of the prefix (or suffix) that every sequence shares."""
    n = 0
    for toks in zip(*(reversed(s) if from_end else s for s in seqs)):
        if any(t != toks[0] for t in toks):
            break
        n += 1
    return n


def spans(tokenizer, prompts, kind):
    """Token rows (with <|bos|>) and the [start, end) span of each row that is scored."""
    rows = tokenizer.encode(prompts, prepend=tokenizer.get_bos_token_id())
    if kind == "multiple_choice":  # same context, different answers: score after the shared prefix
        start = common_length(rows)
        # an answer that is a token prefix of another would have nothing left to score: keep its last token
        return rows, [(min(start, len(r) - 1), len(r)) for r in rows]
    if kind == "schema":  # different contexts, same continuation: score the shared suffix
        n = min(common_length(rows, from_end=True), min(len(r) for r in rows) - 1)
        return rows, [(len(r) - n, len(r)) for r in rows]
    without, with_ = rows
    if len(without) >= len(with_) or with_[: len(without)] != without:
        raise ValueError(f"the context does not tokenize to a prefix of context + continuation: {prompts[1][-80:]!r}")
    return [with_], [(len(without), len(with_))]


@torch.no_grad()
def score_example(model, tokenizer, item, kind, delimiter, fewshot, device, max_len):
    """-> (correct, mean losses of the choices or None). Rows longer than the model's context lose their oldest tokens."""
    rows, sp = spans(tokenizer, render_prompts(item, kind, delimiter, fewshot), kind)
    cropped = []
    for r, (s, e) in zip(rows, sp):
        cut = max(0, len(r) - max_len)
        cropped.append((r[cut:], max(s - cut, 1), e - cut))  # position 0 has no prediction: spans start at 1
    T = max(len(r) for r, _, _ in cropped)
    x = torch.full((len(cropped), T), tokenizer.get_bos_token_id(), dtype=torch.long)  # right padding, never scored
    for i, (r, _, _) in enumerate(cropped):
        x[i, : len(r)] = torch.tensor(r)
    x = x.to(device)
    logits = model(x).float()
    # loss[i, t] = -log p(x[i, t+1] | x[i, :t+1]); the last position predicts nothing
    losses = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="none").view(
        len(x), T - 1
    )
    if kind == "language_modeling":
        _, s, e = cropped[0]
        return bool((logits[0, s - 1 : e - 1].argmax(-1) == x[0, s:e]).all()), None
    mean_losses = [losses[i, s - 1 : e - 1].mean().item() for i, (_, s, e) in enumerate(cropped)]
    return mean_losses.index(min(mean_losses)) == item["gold"], mean_losses


def fewshot_for(rows, idx, n):
    """n examples other than idx, drawn with a seed of idx so every run (and every rank) uses the same ones."""
    if n == 0:
        return []
    if len(rows) <= n:
        raise ValueError(f"{n}-shot needs more than {n} rows, the task has {len(rows)}")
    return random.Random(1234 + idx).sample([i for i in range(len(rows)) if i != idx], n)


def evaluate_task(model, tokenizer, task, device, max_len, max_examples=-1):
    """Accuracy on one task; under DDP each rank scores every world_size-th example and the counts are summed."""
    rows = task["rows"]
    order = list(range(len(rows)))
    random.Random(1337).shuffle(order)  # a fixed subset when max_examples cuts the task short
    if max_examples > 0:
        order = order[:max_examples]
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)
    correct = torch.zeros(len(order), dtype=torch.float32, device=device)
    for j in range(rank, len(order), world):
        idx = order[j]
        shots = [rows[i] for i in fewshot_for(rows, idx, task["num_fewshot"])]
        correct[j] = float(
            score_example(model, tokenizer, rows[idx], task["type"], task["delimiter"], shots, device, max_len)[0]
        )
    if world > 1:
        dist.all_reduce(correct)
    return correct.mean().item() if len(order) else float("nan")


def centered(accuracy, random_baseline):
    """0 at chance, 1 at perfect; random_baseline is a fraction (0.25 for four choices)."""
    return (accuracy - random_baseline) / (1.0 - random_baseline)


def evaluate_core(model, tokenizer, tasks, device, max_len, max_examples=-1, log=print):
    """{"accuracy": {label: acc}, "centered": {label: centred acc}, "core": mean of the centred accuracies}."""
    acc, cen = {}, {}
    for task in tasks:
        acc[task["label"]] = evaluate_task(model, tokenizer, task, device, max_len, max_examples)
        cen[task["label"]] = centered(acc[task["label"]], task["random_baseline"])
        log(
            f"{task['label']:<32} {task['type']:<18} {task['num_fewshot']}-shot | accuracy {acc[task['label']]:.4f} | "
            f"centered {cen[task['label']]:.4f}"
        )
    return {"accuracy": acc, "centered": cen, "core": sum(cen.values()) / len(cen)}
