"""
Where the pipeline's downloads come from: their public hosts, or one mirror that holds all of them.

    NANORL_MIRROR=http://10.0.0.5:8000 bash speedrun.sh     # every download of the run from there
    NANORL_MIRROR=file:///data/mirror python -m scripts.chat_eval -a gsm8k
    python -m nanorl.mirror check                           # can the mirror be read? one line naming it if not

NANORL_MIRROR is the one setting: a URL (http://, https:// or file://) of a directory laid out as

    fineweb-edu-100b-shuffle/shard_00000.parquet ...   the FineWeb-Edu shards (nanorl/dataset.py)
    eval_bundle.zip                                    the CORE eval bundle (nanorl/core_eval.py)
    datasets/<owner>/<name>/<config>/<split>.parquet   a Hub dataset's split (tasks/common.py load_rows), e.g.
                                                       datasets/openai/gsm8k/main/train.parquet; a dataset without
                                                       a config (openai/openai_humaneval) uses "default"

A Hub split is copied once into <base>/hub_data/ (the same path under it) and read from there by the call that
reads a local --task-path file: a dataset from a mirror never goes through the `datasets` library. The
rehearsal (NANORL_REHEARSAL=1 bash speedrun.sh) serves a small mirror of this layout on 127.0.0.1 (nanorl/rehearsal.py).
"""

import os
import sys
import urllib.request

from nanorl.errors import MissingFile

SHARDS = "fineweb-edu-100b-shuffle"
BUNDLE = "eval_bundle.zip"


def mirror():
    """The mirror's URL (no trailing slash), or None when NANORL_MIRROR is unset or empty."""
    return os.environ.get("NANORL_MIRROR", "").strip().rstrip("/") or None


def url_for(path, default):
    """path's URL on the mirror when there is one, else the public `default`."""
    return f"{mirror()}/{path}" if mirror() else default


def split_path(hf_name, hf_config, hf_split):
    """Where a Hub dataset's split is on a mirror (and, once copied, under <base>/hub_data/)."""
    return f"datasets/{hf_name}/{hf_config or 'default'}/{hf_split}.parquet"


def check(opener=urllib.request.urlopen):
    """Read the first bytes of the mirror's first shard: an unreachable or wrong mirror is one line naming it."""
    url = f"{mirror()}/{SHARDS}/shard_00000.parquet"
    try:
        with opener(url, timeout=10) as response:
            response.read(4)
    except Exception as e:  # noqa: BLE001 - whatever the reason, the line names the mirror and the file
        raise MissingFile(f"NANORL_MIRROR={mirror()}: cannot read {url} ({type(e).__name__}: {e})") from e


def main(argv):
    if argv != ["check"]:
        raise SystemExit("usage: python -m nanorl.mirror check")
    if mirror() is None:
        raise SystemExit("NANORL_MIRROR is not set: there is no mirror to check")
    check()
    print(f"NANORL_MIRROR={mirror()}: readable")


if __name__ == "__main__":
    main(sys.argv[1:])
