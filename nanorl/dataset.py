"""
Where pretraining text comes from: a local directory of parquet/jsonl/txt files, or (with nothing given
and nothing downloaded) the built-in offline synthetic curriculum.
"""
import glob
import json
import os

from nanorl.common import get_base_dir, print0

TEXT_EXTS = (".parquet", ".jsonl", ".txt")


def default_data_dir():
    return os.path.join(get_base_dir(), "base_data")


def list_data_files(data_dir):
    if not os.path.isdir(data_dir):
        raise FileNotFoundError(f"--data-dir {data_dir} does not exist or is not a directory")
    files = sorted(f for f in glob.glob(os.path.join(data_dir, "**", "*"), recursive=True) if f.endswith(TEXT_EXTS))
    if not files:
        raise FileNotFoundError(f"--data-dir {data_dir} has no {'/'.join(TEXT_EXTS)} files")
    return files


def split_files(files, split):
    # the last file is the validation split (nanochat's convention), the rest is train
    if len(files) == 1:
        return files  # one file: train and val read the same file (tiny local runs)
    return files[:-1] if split == "train" else files[-1:]


def iter_file_texts(path):
    """Yield the text documents of one file; a bad row is skipped with a warning, never a crash."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq
        pf = pq.ParquetFile(path)
        for rg in range(pf.num_row_groups):
            try:
                column = pf.read_row_group(rg, columns=["text"]).column("text").to_pylist()
            except Exception as e:  # a corrupt row group: skip it, keep the run alive
                print0(f"warning: skipping row group {rg} of {path}: {type(e).__name__}: {e}")
                continue
            yield from (t for t in column if t)
    elif path.endswith(".jsonl"):
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield json.loads(line)["text"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    print0(f"warning: skipping {path}:{lineno}: not a JSON object with a 'text' field")
    else:
        with open(path, encoding="utf-8", errors="replace") as f:
            # documents are separated by blank lines
            yield from (d.strip() for d in f.read().split("\n\n") if d.strip())


def iter_documents(split="train", data_dir=None, seed=0):
    """Text documents for `split`: from data_dir, else from downloaded shards, else the synthetic curriculum."""
    if data_dir is None and os.path.isdir(default_data_dir()) and glob.glob(os.path.join(default_data_dir(), "*.parquet")):
        data_dir = default_data_dir()
    if data_dir is None:
        from nanorl import synthetic
        yield from synthetic.pretrain_documents(split, seed=seed)
        return
    files = split_files(list_data_files(data_dir), split)
    while True:  # loop over the data forever; callers decide how much they take
        for path in files:
            yield from iter_file_texts(path)
        if split != "train":
            return


def describe_source(data_dir=None):
    if data_dir is None and os.path.isdir(default_data_dir()) and glob.glob(os.path.join(default_data_dir(), "*.parquet")):
        data_dir = default_data_dir()
    return f"files in {data_dir}" if data_dir else "the offline synthetic curriculum (no data downloaded)"
