"""
Train the BPE tokenizer.

    python -m scripts.tok_train                       # offline synthetic curriculum (or downloaded shards)
    python -m scripts.tok_train --data-dir DIR --max-chars 2000000000
"""

import os
import time

from nanorl.common import get_base_dir
from nanorl.dataset import describe_source, iter_documents
from nanorl.flags import ArgumentParser, positive_int
from nanorl.logger import print0
from nanorl.report import log_section, vocab_words
from nanorl.tokenizer import Tokenizer

parser = ArgumentParser(description="Train a BPE tokenizer")
parser.add_argument("--vocab-size", type=positive_int, default=32768, help="vocabulary size, special tokens included")
parser.add_argument(
    "--max-chars", type=positive_int, default=2_000_000_000, help="stop after this many characters of text"
)
parser.add_argument(
    "--doc-cap", type=positive_int, default=10_000, help="truncate each document to this many characters"
)
parser.add_argument(
    "--data-dir",
    type=str,
    default=None,
    help="directory of parquet/jsonl/txt files (default: downloaded shards, else synthetic)",
)
parser.add_argument("--out-dir", type=str, default=None, help="where to save (default: <base>/tokenizer)")
args = parser.parse_args()
print0(
    f"training a {args.vocab_size}-token tokenizer on {describe_source(args.data_dir)}, up to {args.max_chars:,} chars"
)


def text_iterator():
    # bounded by --max-chars, each document capped so one huge document cannot dominate the counts
    nchars = 0
    for doc in iter_documents("train", args.data_dir):
        doc = doc[: args.doc_cap]
        nchars += len(doc)
        yield doc
        if nchars >= args.max_chars:
            return


t0 = time.time()
tokenizer = Tokenizer.train(text_iterator(), args.vocab_size)
train_time = time.time() - t0
out_dir = args.out_dir or os.path.join(get_base_dir(), "tokenizer")
path = tokenizer.save(out_dir)
print0(f"trained in {train_time:.1f}s, vocab {tokenizer.vocab_size}, saved to {path}")
if tokenizer.vocab_size < args.vocab_size:
    print0(
        f"note: the text ran out of pairs to merge, so the vocabulary is {tokenizer.vocab_size} < --vocab-size {args.vocab_size}"
    )

# sanity check: round trip, and a quick compression figure on held-out text
sample = "Hello world! 12345 ünïcödé 🤖 <|bos|>"
assert tokenizer.decode(tokenizer.encode(sample)) == sample, "tokenizer does not round-trip"
val = [d for _, d in zip(range(200), iter_documents("val", args.data_dir))]
nbytes = sum(len(d.encode("utf-8")) for d in val)
ntok = sum(len(ids) for ids in tokenizer.encode(val))
print0(f"held-out compression: {nbytes / max(ntok, 1):.2f} bytes/token over {len(val)} documents")
log_section(
    "Tokenizer training",
    [
        {
            "source": describe_source(args.data_dir),
            "vocab_size": vocab_words(tokenizer.vocab_size, args.vocab_size),
            "max_chars": args.max_chars,
            "train_time_s": round(train_time, 2),
            "val_bytes_per_token": round(nbytes / max(ntok, 1), 3),
        }
    ],
    config=vars(args),
)
