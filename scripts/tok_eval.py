"""
Evaluate the tokenizer's compression (bytes per token) on a few kinds of text, next to GPT-2 and GPT-4's
encodings when tiktoken can load them (it downloads them once; offline, that is said plainly).

    python -m scripts.tok_eval
"""

import itertools

from nanorl.dataset import iter_documents
from nanorl.flags import ArgumentParser, positive_int
from nanorl.logger import print0
from nanorl.report import log_section
from nanorl.tokenizer import get_tokenizer

parser = ArgumentParser(description="Evaluate tokenizer compression")
parser.add_argument(
    "--data-dir",
    type=str,
    default=None,
    help="directory of parquet/jsonl/txt files (default: downloaded shards, else synthetic)",
)
parser.add_argument("--num-docs", type=positive_int, default=200, help="held-out documents to measure on")
args = parser.parse_args()

code_text = '''def fib(n):
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
'''
math_text = "Tom has 3 boxes with 12 apples each. 3 * 12 = <<3*12=36>>36. He eats 5: 36 - 5 = <<36-5=31>>31.\n#### 31"
texts = {
    "held-out": "\n\n".join(itertools.islice(iter_documents("val", args.data_dir), args.num_docs)),
    "code": code_text * 20,
    "math": math_text * 20,
    "multilingual": "Привет, как дела? 你好，世界。 こんにちは。 Bonjour à tous ! ¿Qué tal? " * 20,
}

encoders = {"ours": get_tokenizer().encode}
for name in ("gpt2", "cl100k_base"):
    try:
        import tiktoken

        enc = tiktoken.get_encoding(name)
        encoders[name] = enc.encode_ordinary
    except Exception as e:  # no network and no cache: say so instead of failing
        print0(
            f"note: could not load tiktoken's {name} encoding ({type(e).__name__}); comparing against ours only (offline)"
        )

rows = {}
header = f"{'text':<14}{'bytes':>9}" + "".join(f"{n + ' tok':>16}{'B/tok':>8}" for n in encoders)
print0(header)
for tname, text in texts.items():
    nbytes = len(text.encode("utf-8"))
    line = f"{tname:<14}{nbytes:>9}"
    for ename, encode in encoders.items():
        ntok = len(encode(text))
        ratio = nbytes / max(ntok, 1)
        rows[f"{tname} bytes/token ({ename})"] = round(ratio, 3)
        line += f"{ntok:>16}{ratio:>8.2f}"
    print0(line)
log_section("Tokenizer evaluation", [rows], config=vars(args))
