"""
Where pretraining text comes from: a local directory of parquet/jsonl/txt files, or (with nothing given
and nothing downloaded) the built-in offline synthetic curriculum.

    python -m nanorl.dataset -n 8          # download FineWeb-Edu shards 0..7 into <base>/base_data
    NANORL_MIRROR=URL python -m nanorl.dataset -n 8   # from a mirror of the run's downloads (nanorl/mirror.py)

The shards are the ones nanochat trained on before its ClimbMix switch: FineWeb-Edu 100B tokens,
shuffled and repacked into 1,823 parquet files of ~100 MB (shard_00000 .. shard_01822). The last file
of a directory is the validation split, so `-n 8` gives 7 train shards and 1 val shard.
"""

import argparse
import fcntl
import glob
import itertools
import json
import os
import socket
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from nanorl import mirror
from nanorl.common import get_base_dir
from nanorl.errors import MissingFile, Unreadable
from nanorl.logger import print0

TEXT_EXTS = (".parquet", ".jsonl", ".txt")
BASE_URL = "https://huggingface.co/datasets/karpathy/fineweb-edu-100b-shuffle/resolve/main"
NUM_SHARDS = 1823  # shard_00000.parquet .. shard_01822.parquet


def default_data_dir():
    return os.path.join(get_base_dir(), "base_data")


def shard_name(index):
    return f"shard_{index:05d}.parquet"


# -----------------------------------------------------------------------------------------------------
# Downloading: one file at a time, safe against crashes (temp file + rename) and against other processes
# (a lock per file), with retries for the network's bad moments.


def _is_permanent(e):
    """Errors a retry cannot fix: no such file/page, or no DNS at all (offline). Fail fast on those."""
    if isinstance(e, urllib.error.HTTPError):
        return 400 <= e.code < 500 and e.code not in (408, 429)
    reason = getattr(e, "reason", e)
    return isinstance(reason, (FileNotFoundError, socket.gaierror))


def parquet_ok(path):
    """A downloaded shard is kept only if pyarrow can read its footer (a truncated file has none) and it has text."""
    import pyarrow.parquet as pq

    if "text" not in pq.read_schema(path).names:  # raises on a truncated/garbled file
        raise ValueError(f"{path} has no 'text' column")


@contextmanager
def file_lock(path):
    """Hold an exclusive fcntl lock on path + ".lock" (other processes block here until it is released)."""
    with open(path + ".lock", "w") as lock:  # the lock file stays: deleting it would race a waiting process
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield  # closing the file releases the lock, also when the body raises


def download_file(url, path, opener=urllib.request.urlopen, attempts=5, backoff=2.0, validate=None, timeout=60):
    """Fetch url into path and return path; a file already at path is kept as is.

    The bytes go to a temp file in the same directory, are checked (length against Content-Length, then
    validate(tmp_path)), fsynced and renamed, so path is either absent or complete. An fcntl lock on
    path + ".lock" makes concurrent callers (DDP ranks, parallel scripts) download once: the others wait,
    then find the file and return. opener(url, timeout=...) -> file-like response; injectable for tests."""
    path = os.fspath(path)
    if os.path.exists(path):
        return path
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with file_lock(path):
        if os.path.exists(path):  # someone else downloaded it while we waited
            return path
        tmp = f"{path}.tmp{os.getpid()}"
        for attempt in range(1, attempts + 1):
            try:
                with opener(url, timeout=timeout) as response, open(tmp, "wb") as f:
                    expected = getattr(response, "headers", {}).get("Content-Length")
                    nbytes = 0
                    while chunk := response.read(1 << 20):
                        f.write(chunk)
                        nbytes += len(chunk)
                    if expected is not None and nbytes != int(expected):
                        raise OSError(f"truncated: got {nbytes:,} of {int(expected):,} bytes")
                    f.flush()
                    os.fsync(f.fileno())
                if validate is not None:
                    validate(tmp)
                os.replace(tmp, path)
                return path
            except Exception as e:
                if os.path.exists(tmp):
                    os.remove(tmp)
                if attempt == attempts or _is_permanent(e):
                    raise RuntimeError(
                        f"could not download {url} to {path} ({attempt} attempt(s)): {type(e).__name__}: {e}"
                    ) from e
                wait = backoff**attempt
                print0(
                    f"attempt {attempt}/{attempts} for {os.path.basename(path)} failed ({type(e).__name__}: {e}); "
                    f"retrying in {wait:.0f}s"
                )
                time.sleep(wait)


def download_shards(indices, data_dir=None, base_url=BASE_URL, workers=4, opener=urllib.request.urlopen, backoff=2.0):
    """Download shards (skipping those present) with `workers` threads. -> {shard name: error} of the failures."""
    data_dir = data_dir or default_data_dir()
    os.makedirs(data_dir, exist_ok=True)

    def one(i):
        name = shard_name(i)
        path = os.path.join(data_dir, name)
        if os.path.exists(path):
            print0(f"{name}: already present, skipping")
            return name, None
        try:
            download_file(f"{base_url}/{name}", path, opener=opener, backoff=backoff, validate=parquet_ok)
            print0(f"{name}: downloaded ({os.path.getsize(path) / 1e6:.1f} MB)")
            return name, None
        except RuntimeError as e:
            return name, str(e)

    with ThreadPoolExecutor(max(1, workers)) as pool:  # I/O bound: threads are enough
        results = list(pool.map(one, indices))
    return {name: err for name, err in results if err}


# -----------------------------------------------------------------------------------------------------
# Reading


def list_data_files(data_dir):
    if not os.path.isdir(data_dir):
        raise MissingFile(f"--data-dir {data_dir} does not exist or is not a directory")
    files = sorted(f for f in glob.glob(os.path.join(data_dir, "**", "*"), recursive=True) if f.endswith(TEXT_EXTS))
    if not files:
        raise MissingFile(f"--data-dir {data_dir} has no {'/'.join(TEXT_EXTS)} files")
    return files


def split_files(files, split):
    # the last file is the validation split (nanochat's convention), the rest is train
    if len(files) == 1:
        return files  # one file: train and val read the same file (tiny local runs)
    return files[:-1] if split == "train" else files[-1:]


def iter_file_texts(path, take=None, start=(0, 0)):
    """Yield (place, text) for the text documents of one file; place = (unit, doc): the unit is a parquet row group, a
    jsonl line or a txt document, doc the document's index in its unit. A file that cannot be opened, or a bad row
    group / row, is skipped with a warning naming it: one corrupt shard must not kill a long run.
    take(): asked once per unit, in order; False skips it (a skipped row group is never read or decoded: that is how
    each rank reads only its share of the data). start: the place to begin at; the units before it are passed over
    unread (parquet) or unparsed (jsonl), and take() is not asked about them."""
    take = take or (lambda: True)
    first_unit, first_doc = start
    try:
        if path.endswith(".parquet"):
            import pyarrow.parquet as pq

            pf = pq.ParquetFile(path)
        else:
            f = open(path, encoding="utf-8", errors="replace")  # noqa: SIM115 - closed by the `with f` below
    except Exception as e:  # noqa: BLE001 - whatever is wrong with the file, the run goes on without it
        print0(f"warning: skipping {path}: cannot open it ({type(e).__name__}: {e})")
        return
    if path.endswith(".parquet"):
        for rg in range(first_unit, pf.num_row_groups):
            if not take():
                continue
            try:
                column = pf.read_row_group(rg, columns=["text"]).column("text").to_pylist()
            except Exception as e:  # noqa: BLE001 - a corrupt row group: skip it, keep the run alive
                print0(f"warning: skipping row group {rg} of {path}: {type(e).__name__}: {e}")
                continue
            texts = [t for t in column if t]
            yield from (((rg, j), texts[j]) for j in range(first_doc if rg == first_unit else 0, len(texts)))
    elif path.endswith(".jsonl"):
        with f:
            for lineno, line in enumerate(f, 1):
                if lineno < first_unit or not line.strip() or not take():
                    continue
                try:
                    yield (lineno, 0), json.loads(line)["text"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    print0(f"warning: skipping {path}:{lineno}: not a JSON object with a 'text' field")
    else:
        with f:
            # documents are separated by blank lines
            docs = f.read().split("\n\n")
            yield from (((i, 0), docs[i].strip()) for i in range(first_unit, len(docs)) if docs[i].strip() and take())


def iter_documents(split="train", data_dir=None, seed=0, rank=0, world_size=1):
    """Text documents for `split`: from data_dir, else from downloaded shards, else the synthetic curriculum.
    rank/world_size: this rank's share only, parquet row groups (or jsonl/txt/synthetic documents) number
    rank, rank + world_size, ... of the whole stream."""
    return (text for _, text in iter_positioned(split, data_dir, seed, rank, world_size))


def iter_positioned(split="train", data_dir=None, seed=0, rank=0, world_size=1, start=None):
    """iter_documents' documents as (position, text): iter_positioned(..., start=position) continues at that
    document, without reading the files, row groups or lines before it (the synthetic curriculum, made rather than
    read, makes the documents before it again). A position is a dict of plain ints, for a checkpoint."""
    if (
        data_dir is None
        and os.path.isdir(default_data_dir())
        and glob.glob(os.path.join(default_data_dir(), "*.parquet"))
    ):
        data_dir = default_data_dir()
    start = start or {"pass": 0, "file": 0, "unit": 0, "doc": 0, "count": 0}
    units = itertools.count(start["count"])  # row groups / documents of every rank so far, over all files and passes
    seen = [start["count"] - 1]  # the last unit's number: the position's count

    def take():
        seen[0] = next(units)
        return seen[0] % world_size == rank

    if data_dir is None:
        from nanorl import synthetic

        docs = synthetic.pretrain_documents(split, seed=seed)
        for _ in range(start["count"]):  # made, not read: cheap next to tokenizing them
            next(docs)
        for text in docs:
            if take():
                yield {**start, "unit": seen[0], "count": seen[0]}, text
        return
    files = split_files(list_data_files(data_dir), split)
    for n_pass in itertools.count(start["pass"]):  # loop over the data forever; callers decide how much they take
        resumed = n_pass == start["pass"] and (start["file"], start["unit"], start["doc"]) != (0, 0, 0)
        ndocs, first = 0, start["file"] if n_pass == start["pass"] else 0
        for i in range(first, len(files)):
            at = (start["unit"], start["doc"]) if (n_pass, i) == (start["pass"], start["file"]) else (0, 0)
            for (unit, doc), text in iter_file_texts(files[i], take, at):
                ndocs += 1
                yield {"pass": n_pass, "file": i, "unit": unit, "doc": doc, "count": seen[0]}, text
        if split != "train":
            return
        if ndocs == 0 and not resumed:  # a whole pass, every file unreadable or empty: looping again would spin forever
            share = f" for rank {rank} of {world_size} (fewer row groups than ranks?)" if world_size > 1 else ""
            raise Unreadable(f"no readable documents{share} in the {split} files of {data_dir}: {files}")


def describe_source(data_dir=None):
    if (
        data_dir is None
        and os.path.isdir(default_data_dir())
        and glob.glob(os.path.join(default_data_dir(), "*.parquet"))
    ):
        data_dir = default_data_dir()
    return f"files in {data_dir}" if data_dir else "the offline synthetic curriculum (no data downloaded)"


def main(argv=None):
    parser = argparse.ArgumentParser(description="Download FineWeb-Edu pretraining shards")
    parser.add_argument(
        "-n", "--num-files", type=int, default=-1, help=f"shards 0..n-1 to download (-1 = all {NUM_SHARDS})"
    )
    parser.add_argument("-w", "--num-workers", type=int, default=4, help="parallel downloads")
    parser.add_argument("--data-dir", default=None, help="where the shards go (default <base>/base_data)")
    parser.add_argument(
        "--base-url",
        default=mirror.url_for(mirror.SHARDS, BASE_URL),
        help="where the shards come from (default: NANORL_MIRROR's copy when it is set, else the Hub; or file:///dir)",
    )
    args = parser.parse_args(argv)
    if args.num_files == 0 or args.num_files < -1 or args.num_files > NUM_SHARDS:
        parser.error(f"-n {args.num_files}: must be between 1 and {NUM_SHARDS}, or -1 for all")
    if args.num_workers < 1:
        parser.error(f"-w {args.num_workers}: need at least 1 worker")
    n = NUM_SHARDS if args.num_files == -1 else args.num_files
    data_dir = args.data_dir or default_data_dir()
    print0(f"downloading {n} shard(s) from {args.base_url} to {data_dir} with {args.num_workers} worker(s)")
    failed = download_shards(range(n), data_dir, args.base_url, args.num_workers)
    for name, err in failed.items():
        print(f"FAILED {name}: {err}", file=sys.stderr)
    if failed:
        sys.exit(
            f"{len(failed)} of {n} shard(s) failed: {', '.join(sorted(failed))}; rerun to retry them (the others are kept)"
        )
    print0(f"done: {n} shard(s) in {data_dir}")


if __name__ == "__main__":
    main()
