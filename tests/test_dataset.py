"""Shard download (offline: file:// URLs and fake openers) and reading past corrupt files."""

import io
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nanorl.dataset import download_file, download_shards, iter_documents, iter_file_texts, main, parquet_ok, shard_name

ROOT = Path(__file__).resolve().parents[1]


def write_shard(path, texts):
    pq.write_table(pa.table({"text": texts}), path, row_group_size=2)


@pytest.fixture
def source(tmp_path):
    """A local 'hub': three small shards served through file:// URLs."""
    src = tmp_path / "hub"
    src.mkdir()
    for i in range(3):
        write_shard(src / shard_name(i), [f"shard {i} doc {j}" for j in range(5)])
    return src


class Response(io.BytesIO):
    def __init__(self, data, length=None):
        super().__init__(data)
        self.headers = {} if length is None else {"Content-Length": str(length)}


def leftovers(d):
    return sorted(p.name for p in Path(d).iterdir() if not p.name.endswith(".lock"))


def test_download_shards_from_file_url_and_skip_present(source, tmp_path, capsys):
    dst = tmp_path / "data"
    main(["-n", "3", "-w", "2", "--base-url", f"file://{source}", "--data-dir", str(dst)])
    assert leftovers(dst) == [shard_name(i) for i in range(3)]
    for i in range(3):
        assert (dst / shard_name(i)).read_bytes() == (source / shard_name(i)).read_bytes()
    assert list(iter_file_texts(str(dst / shard_name(1))))[4][1] == "shard 1 doc 4"
    capsys.readouterr()
    main(["-n", "3", "--base-url", "file:///nonexistent", "--data-dir", str(dst)])  # nothing to fetch: all present
    assert capsys.readouterr().out.count("already present, skipping") == 3


def test_cli_reports_the_failed_shard_and_exits_nonzero(source, tmp_path):
    dst = tmp_path / "data"
    out = subprocess.run(
        [sys.executable, "-m", "nanorl.dataset", "-n", "4", "--base-url", f"file://{source}", "--data-dir", str(dst)],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    # shard 3 is not on the "hub": a missing file is permanent, so it fails at once, named, with a non-zero exit
    assert out.returncode != 0 and "FAILED shard_00003.parquet" in out.stderr and "1 of 4 shard(s) failed" in out.stderr
    assert leftovers(dst) == [shard_name(i) for i in range(3)]  # the good ones are kept, nothing partial
    bad = subprocess.run(
        [sys.executable, "-m", "nanorl.dataset", "-n", "0"],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "-n 0: must be between 1 and 1823" in bad.stderr


def test_retries_until_success(source, tmp_path):
    data = (source / shard_name(0)).read_bytes()
    calls = []

    def flaky(url, timeout):
        calls.append(url)
        if len(calls) <= 2:
            raise ConnectionResetError("connection reset by peer")
        return Response(data, len(data))

    failed = download_shards([0], str(tmp_path), "https://example.invalid/x", opener=flaky, backoff=0.0)
    assert failed == {} and len(calls) == 3 and calls[0] == f"https://example.invalid/x/{shard_name(0)}"
    assert (tmp_path / shard_name(0)).read_bytes() == data


def test_always_failing_gives_up_and_leaves_nothing(tmp_path):
    calls = []

    def down(url, timeout):
        calls.append(url)
        raise TimeoutError("timed out")

    failed = download_shards([5], str(tmp_path), "https://example.invalid", opener=down, backoff=0.0)
    assert (
        list(failed) == [shard_name(5)]
        and "5 attempt(s)" in failed[shard_name(5)]
        and "timed out" in failed[shard_name(5)]
    )
    assert len(calls) == 5 and leftovers(tmp_path) == []


def test_truncated_download_never_becomes_a_shard(source, tmp_path):
    data = (source / shard_name(0)).read_bytes()
    dst = tmp_path / "data"
    # the server says how long the file is but the connection drops halfway
    with pytest.raises(RuntimeError, match="truncated: got"):
        download_file(
            "u",
            dst / "a.parquet",
            opener=lambda url, timeout: Response(data[: len(data) // 2], len(data)),
            attempts=2,
            backoff=0.0,
        )
    # no Content-Length to compare against: the parquet footer check catches it
    with pytest.raises(RuntimeError, match="a.parquet"):
        download_file(
            "u",
            dst / "a.parquet",
            opener=lambda url, timeout: Response(data[: len(data) // 2]),
            attempts=2,
            backoff=0.0,
            validate=parquet_ok,
        )
    assert leftovers(dst) == []


def _slow_download(src, dst, log):
    def opener(url, timeout):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.5)  # long enough for the other process to reach the lock
        return Response(Path(src).read_bytes())

    download_file("u", dst, opener=opener, backoff=0.0)


def test_two_processes_download_the_same_shard_once(source, tmp_path):
    dst, log = tmp_path / shard_name(0), tmp_path / "opened.log"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_slow_download, args=(source / shard_name(0), dst, log)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0, 0]
    assert len(log.read_text().split()) == 1  # the second waited on the lock, then found the file
    assert dst.read_bytes() == (source / shard_name(0)).read_bytes()


def test_corrupt_files_are_skipped_with_a_warning(tmp_path, capsys):
    d = tmp_path / "data"
    d.mkdir()
    write_shard(d / "a_good.parquet", ["good one", "good two"])
    (d / "b_garbage.parquet").write_bytes(os.urandom(300))
    (d / "c_empty.parquet").write_bytes(b"")
    write_shard(d / "z_val.parquet", ["val doc"])
    assert list(iter_file_texts(str(d / "b_garbage.parquet"))) == []
    assert f"warning: skipping {d / 'b_garbage.parquet'}: cannot open it" in capsys.readouterr().out
    train = iter_documents("train", str(d))
    assert [next(train) for _ in range(4)] == ["good one", "good two"] * 2  # the bad files are passed over, every epoch
    out = capsys.readouterr().out
    assert "b_garbage.parquet: cannot open it" in out and "c_empty.parquet: cannot open it" in out
    assert list(iter_documents("val", str(d))) == ["val doc"]
    # nothing readable at all: a clear error instead of spinning forever
    (d / "a_good.parquet").write_bytes(b"PAR1 broken")
    with pytest.raises(RuntimeError, match="no readable documents"):
        next(iter_documents("train", str(d)))
