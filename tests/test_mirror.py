"""NANORL_MIRROR: the shards, the CORE bundle and the Hub splits from one mirror (nanorl/mirror.py), here the
rehearsal's small one (nanorl/rehearsal.py) served on 127.0.0.1; a mirror that cannot be read is one line naming it."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from nanorl import rehearsal
from nanorl.core_eval import get_bundle, load_tasks
from nanorl.errors import MissingFile
from tasks import ARC, GSM8K, MMLU, HumanEval, SmolTalk
from tasks.humaneval import build_program

ROOT = Path(__file__).resolve().parents[1]
RUN = {"capture_output": True, "text": True}
SHARED_GSM8K = ROOT.parent / "shared" / "data" / "gsm8k"  # the real GSM8K beside the checkout (as in CI), if there


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(the mirror's directory, its URL): made once, served by `python -m nanorl.rehearsal serve` for the module."""
    tmp = tmp_path_factory.mktemp("mirror")
    root, url_file = tmp / "mirror", tmp / "url"
    rehearsal.make(str(root), gsm8k_dir=str(SHARED_GSM8K))
    server = subprocess.Popen([sys.executable, "-m", "nanorl.rehearsal", "serve", str(root), str(url_file)], cwd=ROOT)
    for _ in range(200):
        if url_file.exists():
            break
        time.sleep(0.05)
    yield root, url_file.read_text().strip()
    server.kill()
    server.wait()


@pytest.fixture
def mirrored(served, tmp_path, monkeypatch):
    monkeypatch.setenv("NANORL_MIRROR", served[1] + "/")  # a trailing slash is fine
    monkeypatch.setenv("NANORL_BASE_DIR", str(tmp_path / "base"))
    return served[0]


def closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once the socket is closed


def test_hub_tasks_load_the_mirrors_splits_through_load_rows(mirrored, tmp_path):
    gsm8k = GSM8K("test")
    src = SHARED_GSM8K / "test.jsonl"
    if src.is_file():  # the real GSM8K, row for row
        rows = [json.loads(line) for line in src.read_text().splitlines() if line.strip()]
        assert len(gsm8k) == len(rows) == 1319 and gsm8k.rows[5] == rows[5]
    copy = tmp_path / "base" / "hub_data" / "datasets" / "openai" / "gsm8k" / "main" / "test.parquet"
    assert copy.is_file()  # copied once, then read as a local file is
    assert (
        pq.read_table(copy).to_pylist()
        == pq.read_table(mirrored / "datasets/openai/gsm8k/main/test.parquet").to_pylist()
    )
    # MMLU's auxiliary_train nests each row under "train", as on the Hub; the task takes it apart
    aux = MMLU("train", subset="auxiliary_train")
    assert len(aux) == rehearsal.ROWS and set(aux.rows[0]) == {"question", "subject", "choices", "answer"}
    conv = aux.get_example(0)
    a, b = (int(x) for x in aux.rows[0]["question"][len("What is ") : -1].split(" + "))
    assert conv["label"] == "ABCD"[aux.rows[0]["choices"].index(str(a + b))]
    # ARC: a row labelled 1-4 is relabelled A-D by position
    arc = ARC("ARC-Challenge", "test")
    numbered = next(i for i, r in enumerate(arc.rows) if r["choices"]["label"][0] == "1")
    assert arc.get_example(numbered)["letters"] == ["A", "B", "C", "D"]
    assert [m["role"] for m in SmolTalk("train").get_example(0)["messages"]][:2] == ["user", "assistant"]
    # HumanEval: each canonical solution passes its own test (run here in a subprocess: our own code, not a model's)
    he = HumanEval()
    for i in range(len(he)):
        problem = he.get_example(i)
        program = build_program(problem, problem["messages"][1]["content"])
        assert subprocess.run([sys.executable, "-c", program], **RUN).returncode == 0, program
        assert subprocess.run([sys.executable, "-c", build_program(problem, "    return None\n")], **RUN).returncode


def test_shards_and_the_core_bundle_come_through_the_real_downloaders(mirrored, tmp_path):
    out = subprocess.run([sys.executable, "-m", "nanorl.dataset", "-n", "3"], cwd=ROOT, env=os.environ, **RUN)
    assert out.returncode == 0, out.stderr
    data = tmp_path / "base" / "base_data"
    assert sorted(p.name for p in data.glob("*.parquet")) == [f"shard_{i:05d}.parquet" for i in range(3)]
    shard = pq.ParquetFile(data / "shard_00000.parquet")
    assert shard.schema_arrow.names == ["text"] and shard.num_row_groups == 4  # a share for each of several ranks
    from nanorl import mirror

    bundle = get_bundle(url=mirror.url_for(mirror.BUNDLE, "unused"))
    assert bundle == str(tmp_path / "base" / "eval_bundle")
    tasks = load_tasks(bundle)
    assert [(t["label"], t["type"], t["num_fewshot"], t["random_baseline"]) for t in tasks] == [
        ("hellaswag_zeroshot", "multiple_choice", 0, 0.25),
        ("winograd", "schema", 0, 0.5),
        ("lambada_openai", "language_modeling", 1, 0.0),
    ]
    assert all(len(t["rows"]) == rehearsal.ROWS // 4 for t in tasks)


def test_a_mirror_without_the_file_or_out_of_reach_is_one_line_naming_it(served, tmp_path, monkeypatch):
    monkeypatch.setenv("NANORL_BASE_DIR", str(tmp_path / "base"))
    monkeypatch.setenv("NANORL_MIRROR", served[1] + "/nothing-here")
    with pytest.raises(MissingFile, match=r"^NANORL_MIRROR=http://127\.0\.0\.1:\d+/nothing-here: cannot read "):
        GSM8K("train")  # a MissingFile, not the RuntimeError --data hub would take for "offline" and fall back from
    assert not (tmp_path / "base" / "hub_data" / "datasets" / "openai" / "gsm8k" / "main" / "train.parquet").exists()
    for url in (served[1] + "/nothing-here", f"http://127.0.0.1:{closed_port()}"):
        env = {**os.environ, "NANORL_MIRROR": url}
        out = subprocess.run([sys.executable, "-m", "nanorl.mirror", "check"], cwd=ROOT, env=env, **RUN)
        assert out.returncode == 1 and len(out.stderr.splitlines()) == 1, out.stderr
        assert out.stderr.startswith(
            f"mirror.py: error: NANORL_MIRROR={url}: cannot read {url}/fineweb-edu-100b-shuffle/shard_00000.parquet ("
        )
    env = {**os.environ, "NANORL_MIRROR": served[1]}
    out = subprocess.run([sys.executable, "-m", "nanorl.mirror", "check"], cwd=ROOT, env=env, **RUN)
    assert out.returncode == 0 and out.stdout == f"NANORL_MIRROR={served[1]}: readable\n", out.stderr


def test_speedrun_stops_before_any_stage_when_the_mirror_cannot_be_read(tmp_path):
    url = f"http://127.0.0.1:{closed_port()}"
    env = {k: v for k, v in os.environ.items() if k not in ("NANORL_TINY", "NANORL_SMOKE")}
    env.update(NANORL_REHEARSAL="1", NANORL_SKIP_INSTALL="1", NANORL_BASE_DIR=str(tmp_path), NANORL_MIRROR=url)
    out = subprocess.run(["bash", "speedrun.sh"], cwd=ROOT, env=env, **RUN, timeout=120)
    assert out.returncode == 1 and out.stderr.strip().splitlines()[-1].startswith(
        f"mirror.py: error: NANORL_MIRROR={url}: cannot read "
    ), out.stdout + out.stderr
    assert "-- " not in out.stdout and os.listdir(tmp_path / "rehearsal" / "done") == []
    assert not (tmp_path / "rehearsal" / "mirror").exists()  # the caller's mirror is used, none is made
