"""CORE: a fixture bundle in the DCLM format, scored by a rigged model whose answers are known by hand."""

import json
import os
import re
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import warm_python  # pytest puts tests/ on sys.path

from nanorl import core_eval
from nanorl.core_eval import centered, evaluate_core, get_bundle, load_tasks, render_prompts, score_example
from nanorl.gpt import GPTConfig, build_model
from nanorl.tokenizer import SPLIT_PATTERN, Tokenizer

ROOT = Path(__file__).resolve().parents[1]
# a byte-level tokenizer: one token per character, so spans can be counted in characters
TOK = Tokenizer.from_ranks({bytes([i]): i for i in range(256)}, SPLIT_PATTERN)


class Successor(torch.nn.Module):
    """A rigged bigram 'model': it predicts the next byte is the current byte + 1 (a -> b -> c ...), with logit 10.
    A continuation made of successors costs ~0.01 nats a token, any other token ~10."""

    def forward(self, idx):
        logits = torch.zeros(*idx.shape, TOK.vocab_size)
        logits.scatter_(-1, ((idx + 1) % 256)[..., None], 10.0)
        return logits


# (label, type, shots, delimiter, random baseline %, rows, accuracy the Successor model must get)
# multiple choice: the model picks the choice with the most successor pairs; schema: the context whose last
# letter precedes the continuation's first; language modeling: right iff the continuation is all successors
TASKS = [
    (
        "mc_zero",
        "multiple_choice",
        0,
        " ",
        25,
        [
            {
                "query": "Q1",
                "choices": ["abcd", "kxqz", "mnoz", "wqrs"],
                "gold": 0,
            },  # abcd: 3 successor pairs, the most
            {"query": "Q2", "choices": ["zyxw", "efgh", "pqxz", "lmzo"], "gold": 1},
            {"query": "Q3", "choices": ["qwer", "tyui", "ghij", "bnbn"], "gold": 2},
            {"query": "Q4", "choices": ["rstu", "hjkl", "vbnm", "cxzq"], "gold": 3},  # the model picks rstu: wrong
        ],
        3 / 4,
    ),
    (
        "mc_one_shot",
        "multiple_choice",
        1,
        ": ",
        50,
        [
            {
                "query": "Which?",
                "choices": ["defg", "dzyx"],
                "gold": 0,
            },  # shared first letter: only "efg" vs "zyx" scored
            {"query": "Next?", "choices": ["hqhq", "mnop"], "gold": 1},
            {"query": "Odd?", "choices": ["stuv", "svsv"], "gold": 1},  # wrong
        ],
        2 / 3,
    ),
    (
        "schema_zero",
        "schema",
        0,
        "",
        50,
        [
            {"context_options": ["xyz", "abc"], "continuation": "defg", "gold": 1},  # c -> d
            {"context_options": ["mno", "qrs"], "continuation": "pqr", "gold": 1},  # o -> p: the model picks 0, wrong
        ],
        1 / 2,
    ),
    (
        "schema_one_shot",
        "schema",
        1,
        "",
        50,
        [
            {"context_options": ["ab", "fg"], "continuation": "hij", "gold": 1},
            {"context_options": ["tu", "kl"], "continuation": "vw", "gold": 0},
            {"context_options": ["qr", "ij"], "continuation": "klm", "gold": 0},  # wrong
        ],
        2 / 3,
    ),
    (
        "lm_zero",
        "language_modeling",
        0,
        "",
        0,
        [
            {"context": "abc", "continuation": "defg"},
            {"context": "klm ", "continuation": "nop"},  # trailing space in the data: stripped from the context
            {"context": "rst", "continuation": "uvx"},  # x is not w's successor... u, v right, then x: wrong
        ],
        2 / 3,
    ),
    (
        "lm_one_shot",
        "language_modeling",
        1,
        "",
        0,
        [
            {"context": "hij", "continuation": "klm"},
            {"context": "pq", "continuation": "rst"},
            {"context": "ab", "continuation": "cdf"},  # wrong
        ],
        2 / 3,
    ),
]


def write_bundle(root):
    """The real layout: core.yaml, eval_meta_data.csv (baselines in percent), eval_data/<category>/<task>.jsonl."""
    b = root / "eval_bundle"
    yaml_lines = ["icl_tasks:"]
    csv_lines = ["Eval Task,Task Category,Task Type,#shots,Random baseline,Centered Metric?,Description"]
    for label, kind, shots, delim, base, rows, _ in TASKS:
        uri = f"{kind}/{label}.jsonl"
        (b / "eval_data" / kind).mkdir(parents=True, exist_ok=True)
        (b / "eval_data" / uri).write_text("".join(json.dumps(r) + "\n" for r in rows))
        yaml_lines += [
            "-",
            f"  label: {label}",
            f"  dataset_uri: {uri}",
            f"  num_fewshot: [{shots}]",
            f"  icl_task_type: {kind}",
            f"  continuation_delimiter: {json.dumps(delim)}",
        ]
        csv_lines.append(f'{label},test,{kind},{shots},{base},yes,"a fixture task, {kind}"')
    (b / "core.yaml").write_text("\n".join(yaml_lines) + "\n")
    (b / "eval_meta_data.csv").write_text("\n".join(csv_lines) + "\n")
    return b


def test_prompt_rendering_with_few_shot():
    shot = {"query": "2+2=", "choices": ["3", "4"], "gold": 1}
    assert render_prompts({"query": "1+1=", "choices": ["2", "5"], "gold": 0}, "multiple_choice", " ", [shot]) == [
        "2+2= 4\n\n1+1= 2",
        "2+2= 4\n\n1+1= 5",
    ]
    shot = {"context_options": ["Tom", "Ann"], "continuation": "ran.", "gold": 0}
    assert render_prompts(
        {"context_options": ["A", "B"], "continuation": "sat.", "gold": 1}, "schema", " ", [shot]
    ) == ["Tom ran.\n\nA sat.", "Tom ran.\n\nB sat."]
    shot = {"context": " The sky is ", "continuation": "blue"}
    assert render_prompts({"context": "Grass is  ", "continuation": "green"}, "language_modeling", " ", [shot]) == [
        "The sky is blue\n\nGrass is",
        "The sky is blue\n\nGrass is green",
    ]


def test_centering():
    assert centered(0.25, 0.25) == 0 and centered(1.0, 0.25) == 1
    assert centered(0.625, 0.25) == pytest.approx(0.5) and centered(0.1, 0.25) == pytest.approx(-0.2)
    assert centered(0.3, 0.0) == pytest.approx(0.3)  # language modeling: no chance level


def test_rigged_model_scores_known_accuracies(tmp_path):
    tasks = load_tasks(write_bundle(tmp_path))
    assert [t["random_baseline"] for t in tasks] == [0.25, 0.5, 0.5, 0.5, 0.0, 0.0] and tasks[1]["delimiter"] == ": "
    expected = {label: acc for label, *_, acc in TASKS}
    for max_len in (
        64,
        8,
    ):  # 8: rows lose their oldest tokens; the bigram model only needs the scored spans' left neighbours
        out = evaluate_core(Successor(), TOK, tasks, "cpu", max_len, log=lambda *a: None)
        assert out["accuracy"] == pytest.approx(expected)
        cen = {label: (expected[label] - base / 100) / (1 - base / 100) for label, _, _, _, base, _, _ in TASKS}
        assert out["centered"] == pytest.approx(cen)
        # by hand: (2/3 + 1/3 + 0 + 1/3 + 2/3 + 2/3) / 6 = 4/9
        assert out["core"] == pytest.approx(4 / 9)
    # --max-per-task: a fixed subset, the same one every time
    a = evaluate_core(Successor(), TOK, tasks, "cpu", 64, max_examples=2, log=lambda *a: None)
    assert a == evaluate_core(Successor(), TOK, tasks, "cpu", 64, max_examples=2, log=lambda *a: None)


def test_choice_is_argmin_of_independently_computed_losses(tmp_path):
    """A random GPT: the harness's padded batch must give each choice the mean loss that the choice's own
    unpadded row gives over its differing characters (byte tokens: characters = tokens)."""
    torch.manual_seed(0)
    model = build_model(
        GPTConfig(sequence_len=64, vocab_size=TOK.vocab_size, n_layer=2, n_head=2, n_kv_head=1, n_embd=32), "cpu"
    ).eval()
    tasks = {t["label"]: t for t in load_tasks(write_bundle(tmp_path))}
    for label, kind in (("mc_zero", "multiple_choice"), ("schema_zero", "schema")):
        for item in tasks[label]["rows"]:
            texts = render_prompts(item, kind, tasks[label]["delimiter"])
            if kind == "multiple_choice":  # scored: each text after the characters all texts share
                n_shared = len(os.path.commonprefix(texts))
                span_lens = [len(t) - n_shared for t in texts]
            else:  # scored: the continuation, shared at the end
                span_lens = [len(os.path.commonprefix([t[::-1] for t in texts]))] * len(texts)
            ref = []
            for text, n in zip(texts, span_lens):
                ids = torch.tensor([TOK.encode(text, prepend=TOK.get_bos_token_id())])
                with torch.no_grad():
                    per_token = model(ids[:, :-1], targets=ids[:, 1:], loss_reduction="none")
                ref.append(per_token[-n:].mean().item())
            correct, got = score_example(model, TOK, item, kind, tasks[label]["delimiter"], [], "cpu", 64)
            assert got == pytest.approx(ref, rel=1e-5, abs=1e-6)
            assert correct == (ref.index(min(ref)) == item["gold"])


def test_bundle_download_and_unzip(tmp_path, monkeypatch):
    monkeypatch.setenv("NANORL_BASE_DIR", str(tmp_path / "base"))
    write_bundle(tmp_path / "src")
    zpath = tmp_path / "eval_bundle.zip"
    with zipfile.ZipFile(zpath, "w") as z:
        for p in (tmp_path / "src").rglob("*"):
            z.write(p, p.relative_to(tmp_path / "src"))
    d = get_bundle(url=f"file://{zpath}")
    assert d == str(tmp_path / "base" / "eval_bundle") and len(load_tasks(d)) == len(TASKS)

    def no_network(url, timeout):
        raise AssertionError("must not download again")

    assert get_bundle(url="https://example.invalid/x.zip", opener=no_network) == d
    assert not [p for p in (tmp_path / "base").iterdir() if ".tmp" in p.name]  # no temp leftovers
    with pytest.raises(FileNotFoundError, match="--bundle-dir .* has no core.yaml"):
        get_bundle(str(tmp_path))


def test_bad_bundle_rows_are_named(tmp_path):
    b = write_bundle(tmp_path)
    (b / "eval_data" / "schema" / "schema_zero.jsonl").write_text('{"context_options": ["a"], "gold": 0}\n')
    with pytest.raises(ValueError, match=r"schema_zero.jsonl:1: a schema row needs continuation"):
        core_eval.load_tasks(str(b))


@pytest.mark.slow
def test_base_eval_script(tmp_path):
    """The script end to end on a tiny checkpoint: bpb, samples, CORE from --bundle-dir; then offline with no bundle."""
    env = {**os.environ, "NANORL_BASE_DIR": str(tmp_path / "base"), "OMP_NUM_THREADS": "1"}

    def run(*cmd):
        out = warm_python.run(
            [sys.executable, "-m", *cmd], check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
        return out.stdout

    run("scripts.tok_train", "--vocab-size", "300", "--max-chars", "100000")
    run(
        "scripts.base_train",
        "--depth",
        "1",
        "--aspect-ratio",
        "32",
        "--head-dim",
        "32",
        "--max-seq-len",
        "64",
        "--device-batch-size",
        "2",
        "--total-batch-size",
        "128",
        "--num-iterations",
        "3",
        "--eval-every",
        "-1",
        "--sample-every",
        "-1",
    )
    bundle = write_bundle(tmp_path)
    log = run("scripts.base_eval", "--device-batch-size", "2", "--split-tokens", "256", "--bundle-dir", str(bundle))
    assert re.search(r"val bpb: \d+\.\d{4}", log) and log.count("  sample: ") == 6
    assert len(re.findall(r"accuracy \d\.\d{4} \| centered -?\d\.\d{4}", log)) == len(TASKS) and re.search(
        r"CORE: -?\d\.\d{4}", log
    )
    section = (tmp_path / "base" / "report" / "base-model-evaluation.md").read_text()
    assert "- CORE: " in section and "mc_zero (centered)" in section
    card = json.loads((tmp_path / "base" / "report" / "report_card.json").read_text())
    assert set(card["BASE"]) == {
        "val bpb (final model, 256 tokens)",
        f"CORE ({len(TASKS)} tasks)",
    }  # rows say what they measured
    log = run(
        "scripts.base_eval",
        "--eval",
        "core,bpb,sample",
        "--split-tokens",
        "256",
        "--bundle-url",
        f"file://{tmp_path}/missing.zip",
    )
    assert "CORE skipped: no eval bundle" in log and "--bundle-dir" in log and re.search(r"val bpb: \d+\.\d{4}", log)
