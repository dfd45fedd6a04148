"""
The rehearsal's data: a small mirror of the GPU pipeline's downloads (nanorl/mirror.py's layout), in their real
formats and schemas, and a server for it on 127.0.0.1.

    python -m nanorl.rehearsal make DIR         # write the mirror into DIR (a new directory)
    python -m nanorl.rehearsal serve DIR FILE   # serve DIR on a free port of 127.0.0.1; its URL goes to FILE

NANORL_REHEARSAL=1 bash speedrun.sh runs both, then the GPU branch's stages with NANORL_MIRROR set to the URL, so the
real code paths download, validate and read every file (docs/testing.md). What the mirror holds:
  - fineweb-edu-100b-shuffle/shard_0000N.parquet: a `text` column in several row groups (each rank reads its share
    of a shard by row group), documents of the offline curriculum, and GSM8K's training solutions when present
  - eval_bundle.zip: eval_bundle/core.yaml, eval_meta_data.csv and eval_data/, one task of each CORE type
  - datasets/...: SmolTalk, MMLU (all, auxiliary_train), ARC-Easy/Challenge, HumanEval and GSM8K in the Hub's
    schemas. GSM8K is the real one where NANORL_REHEARSAL_GSM8K names a directory with its train.jsonl and
    test.jsonl (the tests point it at a copy they have); otherwise the offline curriculum's problems in its format. The others are made here, a few dozen rows each.
SpellingBee needs no download (tasks/spellingbee.py makes its words' problems itself).
"""

import argparse
import http.server
import io
import json
import os
import random
import sys
import zipfile
from functools import partial

from nanorl import mirror, synthetic

ROWS = 48  # rows of each made-up split: every task sees a handful, chat_eval's -x takes fewer
GSM8K_DIR = os.environ.get("NANORL_REHEARSAL_GSM8K", "")  # the real GSM8K's jsonl files, when someone has them


def write_parquet(path, rows, row_group_size=None):
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)


def write_split(root, hf_name, hf_config, hf_split, rows):
    write_parquet(os.path.join(root, *mirror.split_path(hf_name, hf_config, hf_split).split("/")), rows)


# -----------------------------------------------------------------------------------------------
# the Hub datasets, each in its own schema


def gsm8k_rows(split, gsm8k_dir):
    """{question, answer} rows: the real file when there is one, else offline problems (`#### N`, <<a*b=c>> calls)."""
    path = os.path.join(gsm8k_dir, f"{split}.jsonl")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    return [{"question": p["question"], "answer": p["answer"]} for p in synthetic.problems(split, ROWS)]


def text_of(content):
    """A conversation message's text: SmolTalk's messages are plain strings (no tool-call parts)."""
    return content if isinstance(content, str) else "".join(part["text"] for part in content)


def smoltalk_rows(split):
    convs = synthetic.conversations(split, ROWS, seed=7)
    return [
        {"messages": [{"content": text_of(m["content"]), "role": m["role"]} for m in c["messages"]], "source": "made"}
        for c in convs
    ]


def arithmetic_choice(rng):
    """(question, four choices, index of the right one): a sum with three wrong answers near it."""
    a, b = rng.randint(2, 40), rng.randint(2, 40)
    wrong = rng.sample([a + b + d for d in (-3, -2, -1, 1, 2, 3)], 3)
    choices = [a + b, *wrong]
    rng.shuffle(choices)
    return f"What is {a} + {b}?", [str(c) for c in choices], choices.index(a + b)


def mmlu_rows(rng, n, nested=False):
    rows = []
    for _ in range(n):
        question, choices, answer = arithmetic_choice(rng)
        row = {"question": question, "subject": "elementary_mathematics", "choices": choices, "answer": answer}
        rows.append({"train": row} if nested else row)  # auxiliary_train nests each row under "train"
    return rows


def arc_rows(rng, n, subset):
    rows = []
    for i in range(n):
        animal = rng.choice(synthetic.ANIMALS)
        others = rng.sample(synthetic.ITEMS, 3)
        choices = [animal, *others]
        rng.shuffle(choices)
        # a few rows of the real dataset label their choices 1-4, not A-D
        labels = ["1", "2", "3", "4"] if i % 8 == 7 else ["A", "B", "C", "D"]
        rows.append(
            {
                "id": f"{subset}-made-{i}",
                "question": "Which of these is an animal?",
                "choices": {"text": choices, "label": labels},
                "answerKey": labels[choices.index(animal)],
            }
        )
    return rows


HUMANEVAL = [  # (entry point, signature and docstring, body, asserts)
    (
        "add",
        "a: int, b: int) -> int",
        "Return the sum of a and b.",
        "    return a + b\n",
        [("2, 3", "5"), ("-1, 1", "0")],
    ),
    ("double", "x: int) -> int", "Return twice x.", "    return 2 * x\n", [("4", "8"), ("0", "0")]),
    ("is_even", "n: int) -> bool", "Whether n is even.", "    return n % 2 == 0\n", [("4", "True"), ("7", "False")]),
    ("first", "xs: list) -> int", "The first element of xs.", "    return xs[0]\n", [("[3, 1]", "3"), ("[5]", "5")]),
]


def humaneval_rows():
    rows = []
    for i, (entry, signature, doc, body, cases) in enumerate(HUMANEVAL):
        asserts = "".join(f"    assert candidate({args}) == {want}\n" for args, want in cases)
        rows.append(
            {
                "task_id": f"HumanEval/{i}",
                "prompt": f'def {entry}({signature}:\n    """{doc}"""\n',
                "canonical_solution": body,
                "test": f"\n\nMETADATA = {{}}\n\n\ndef check(candidate):\n{asserts}",
                "entry_point": entry,
            }
        )
    return rows


# -----------------------------------------------------------------------------------------------
# the CORE bundle: one task of each type, in the DCLM bundle's layout

CORE_TASKS = [  # (label, dataset_uri, icl_task_type, shots, random baseline in percent)
    ("hellaswag_zeroshot", "language_understanding/hellaswag.jsonl", "multiple_choice", 0, 25.0),
    ("winograd", "language_understanding/winograd_wsc.jsonl", "schema", 0, 50.0),
    ("lambada_openai", "language_understanding/lambada_openai.jsonl", "language_modeling", 1, 0.0),
]


def core_rows(kind, rng):
    rows = []
    for _ in range(ROWS // 4):
        name, place, animal = rng.choice(synthetic.NAMES), rng.choice(synthetic.PLACES), rng.choice(synthetic.ANIMALS)
        if kind == "multiple_choice":
            question, choices, gold = arithmetic_choice(rng)
            rows.append({"query": f"Question: {question}\nAnswer:", "choices": choices, "gold": gold})
        elif kind == "schema":
            other = rng.choice([p for p in synthetic.PLACES if p != place])
            options = [f"{name} went to the {place}", f"{name} went to the {other}"]
            rows.append({"context_options": options, "continuation": f"and saw a {animal} there.", "gold": 0})
        else:
            rows.append(
                {"context": f"{name} saw a {animal} at the {place}. Where was {name}? At the", "continuation": place}
            )
    return rows


def core_bundle():
    """The bytes of eval_bundle.zip: eval_bundle/{core.yaml, eval_meta_data.csv, eval_data/...}."""
    rng = random.Random("core")
    yaml = "icl_tasks:\n" + "".join(
        f"- label: {label}\n  dataset_uri: {uri}\n  num_fewshot: [{shots}]\n  icl_task_type: {kind}\n"
        "  continuation_delimiter: ' '\n"
        for label, uri, kind, shots, _ in CORE_TASKS
    )
    meta = "Eval Task,Task Category,Task Type,#shots,#datapoints,Random baseline,Centered Metric?,Description\n"
    meta += "".join(
        f"{label},language understanding,{kind},{shots},{ROWS // 4},{base},,made for the rehearsal\n"
        for label, _, kind, shots, base in CORE_TASKS
    )
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("eval_bundle/core.yaml", yaml)
        z.writestr("eval_bundle/eval_meta_data.csv", meta)
        for _, uri, kind, _, _ in CORE_TASKS:
            z.writestr(f"eval_bundle/eval_data/{uri}", "".join(json.dumps(r) + "\n" for r in core_rows(kind, rng)))
    return buf.getvalue()


# -----------------------------------------------------------------------------------------------
# the whole mirror, and its server


def make(final, shards=3, docs_per_shard=360, row_groups=4, gsm8k_dir=GSM8K_DIR):
    """Write the mirror into a temp directory beside `final`, then rename it: `final` is absent or whole."""
    root = f"{final}.tmp{os.getpid()}"
    gsm8k = {split: gsm8k_rows(split, gsm8k_dir) for split in ("train", "test")}
    solutions = (f"Question: {r['question']}\nAnswer: {r['answer']}" for r in gsm8k["train"])
    for i in range(shards):  # the last one is the val split: held-out documents
        split = "test" if i == shards - 1 else "train"
        docs = synthetic.pretrain_documents(split, seed=i)
        texts = []
        for j in range(docs_per_shard):  # every 4th training document a GSM8K solution, while they last
            solution = next(solutions, None) if split == "train" and j % 4 == 0 else None
            texts.append(solution or next(docs))
        write_parquet(
            os.path.join(root, mirror.SHARDS, f"shard_{i:05d}.parquet"),
            [{"text": t} for t in texts],
            row_group_size=-(-docs_per_shard // row_groups),
        )
    with open(os.path.join(root, mirror.BUNDLE), "wb") as f:
        f.write(core_bundle())
    rng = random.Random("hub")
    for split in ("train", "test"):
        write_split(root, "openai/gsm8k", "main", split, gsm8k[split])
        write_split(root, "HuggingFaceTB/smol-smoltalk", "default", split, smoltalk_rows(split))
    for split in ("test", "validation", "dev"):
        write_split(root, "cais/mmlu", "all", split, mmlu_rows(rng, ROWS))
    write_split(root, "cais/mmlu", "auxiliary_train", "train", mmlu_rows(rng, ROWS, nested=True))
    for subset in ("ARC-Easy", "ARC-Challenge"):
        for split in ("train", "validation", "test"):
            write_split(root, "allenai/ai2_arc", subset, split, arc_rows(rng, ROWS, subset))
    write_split(root, "openai/openai_humaneval", None, "test", humaneval_rows())
    os.replace(root, final)
    real = "real GSM8K" if os.path.isfile(os.path.join(gsm8k_dir, "train.jsonl")) else "made-up GSM8K"
    print(f"mirror made in {final}: {shards} shards, the CORE bundle, 6 Hub datasets ({real})")


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # one line a request would bury the stages' output
        pass


def serve(root, url_file):
    """Serve root on a free port of 127.0.0.1 until killed; url_file gets the URL once the port is open."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(QuietHandler, directory=root))
    with open(url_file + ".tmp", "w") as f:
        f.write(f"http://127.0.0.1:{server.server_address[1]}\n")
    os.replace(url_file + ".tmp", url_file)  # whoever waits for the file sees the whole URL
    server.serve_forever()


def main(argv=None):
    parser = argparse.ArgumentParser(description="The rehearsal's mirror: make it, serve it")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("make", help="write a small mirror into DIR")
    p.add_argument("dir")
    p.add_argument("--shards", type=int, default=3, help="FineWeb-style shards (the last is the val split)")
    p.add_argument("--gsm8k-dir", default=GSM8K_DIR, help="GSM8K's train.jsonl and test.jsonl, when present")
    p = sub.add_parser("serve", help="serve DIR on 127.0.0.1 and write its URL to FILE")
    p.add_argument("dir")
    p.add_argument("url_file")
    args = parser.parse_args(argv)
    if args.cmd == "make":
        make(args.dir, args.shards, gsm8k_dir=args.gsm8k_dir)
    else:
        serve(args.dir, args.url_file)


if __name__ == "__main__":
    main(sys.argv[1:])
