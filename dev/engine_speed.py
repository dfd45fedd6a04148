"""
Engine speed on fixed shapes, A/B interleaved: this checkout's nanorl engine against another nanorl checkout (a git
ref or a directory) and, when given its directory, nanochat's engine. Random weights, fp32, one thread, vocab 8192,
128-wide heads, 64-token prompts, 128 new tokens at temperature 1 (no top-k), no stop tokens, at depths 4 and 8 with
1 prompt x 1 sample, 1 x 8, 1 x 32 and 8 distinct prompts x 4 samples; the timed call is one whole generation
(prefill included).

    python dev/engine_speed.py                                     # this checkout alone
    python dev/engine_speed.py --nanochat /path/to/nanochat --hf --rounds 3     # the table in docs/benchmarks.md
    python dev/engine_speed.py --compare-ref main --nanochat /path/to/nanochat --rounds 3
    python dev/engine_speed.py --compare-ref main --engine-only --out /tmp/engine_only.json  # the engine's own work
    python dev/engine_speed.py --hf --out dev/engine_speed_hf.json  # vs transformers' generate, on one Llama

Each engine runs in its own process (imports never mix); the processes take turns shape by shape and round by
round, so a busy machine slows them alike. A speed-up is the median of the per-round ratios (each round's runs are
back to back) with their min and max; they, the medians, MBU and the CPU's name go to dev/engine_speed.json. For two
nanorl checkouts it also checks that both gave exactly the same tokens and log-probs (bit_identical). nanochat's
model is its own architecture at the same depth and width, built with its own init, without value embeddings and with every layer
over the full context so that it reads the same weights and KV per token as nanorl's (smear and its per-layer
scalars stay); its engine generates one prompt at a time, so 8 distinct prompts are 8 calls there and one batched
call here. Each engine's MBU is the bytes its decode steps read (weights once a step, each row's KV) per second,
over the one-thread copy bandwidth measured after the runs (nanorl.benchmark.copy_bandwidth).

--hf times the same Llama model both ways at the shapes of batch 1 and 8: a random-weight LlamaForCausalLM of nanorl's
width and depth (its MLP as wide in parameters), saved once, then generated from by transformers' `generate`
(sampling at T=1, no top-k/top-p) and by nanorl's engine after the --hf-model import ("llama" below). Their random draws differ, so their
tokens are not compared here (bench hf checks greedy tokens equal).
"""

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

# name -> (depth, number of distinct prompts, samples per prompt): batch 1, the samples of one prompt (GRPO's group)
# and distinct prompts (a rollout's batch), at two depths
SHAPES = {f"d{d}_{k}x{n}": (d, k, n) for d in (4, 8) for k, n in ((1, 1), (1, 8), (1, 32), (8, 4))}
HF_SHAPES = [s for s, (_, k, n) in SHAPES.items() if k * n <= 8]  # generate has no prefix sharing: batch 1 and 8
VOCAB, SEQ_LEN, HEAD_DIM = 8192, 2048, 128


# --- worker: one engine, driven over stdin/stdout ----------------------------------------------


def prompts_for(n, length):
    import torch

    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, 256, (length,), generator=g).tolist() for _ in range(n)]


def nanorl_runner(depth, n_prompts, n_samples, prompt_len, new_tokens, engine_only=False):
    import torch

    from nanorl.engine import Engine
    from nanorl.gpt import build_model, config_from_depth
    from nanorl.tokenizer import SPLIT_PATTERN, Tokenizer

    tok = Tokenizer.from_ranks({bytes([i]): i for i in range(256)}, SPLIT_PATTERN)
    torch.manual_seed(0)
    model = build_model(config_from_depth(depth, VOCAB, sequence_len=SEQ_LEN, head_dim=HEAD_DIM), "cpu")
    with torch.no_grad():  # init zeroes the output projections: perturb so attention and MLPs matter
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    engine = Engine(model.eval(), tok, batch_size=n_prompts * n_samples)
    if engine_only:  # the decode forward replaced by fixed logits: what is left is the engine's own work per step
        fixed = torch.randn(engine.batch_size, VOCAB)
        engine._decode_logits = lambda size: fixed[:size]
    return engine_run(engine, prompts_for(n_prompts, prompt_len), n_samples)


def engine_run(engine, prompts, n_samples):
    """run(tokens) for a nanorl engine: n_samples of each prompt at T=1 -> [(tokens, log-probs)] of every sample."""
    from nanorl.engine import Request

    def run(tokens):
        reqs = [
            Request(
                p, num_samples=n_samples, max_tokens=tokens, temperature=1.0, seed=i, stop_tokens=[], use_tools=False
            )
            for i, p in enumerate(prompts)
        ]
        return [(c.tokens, c.logprobs) for cs in engine.submit_and_wait(reqs) for c in cs]

    return run


def save_llama(depth, directory):
    """A random LlamaForCausalLM of nanorl's shape at `depth` (swiglu MLP with as many parameters as relu2's 4x)."""
    import torch
    import transformers

    n_embd = depth * 64
    cfg = transformers.LlamaConfig(
        hidden_size=n_embd,
        num_hidden_layers=depth,
        num_attention_heads=n_embd // HEAD_DIM,
        num_key_value_heads=n_embd // HEAD_DIM,
        intermediate_size=8 * n_embd // 3,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ_LEN,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(directory)


def llama_runner(directory, n_prompts, n_samples, prompt_len, new_tokens):
    from nanorl.engine import Engine
    from nanorl.hf import load_hf_model
    from nanorl.tokenizer import SPLIT_PATTERN, Tokenizer

    tok = Tokenizer.from_ranks({bytes([i]): i for i in range(256)}, SPLIT_PATTERN)
    model, _ = load_hf_model(directory, "cpu")
    engine = Engine(model, tok, batch_size=n_prompts * n_samples)
    return engine_run(engine, prompts_for(n_prompts, prompt_len), n_samples)


def hf_runner(directory, n_prompts, n_samples, prompt_len, new_tokens):
    import torch
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(directory).eval()
    x = torch.tensor(prompts_for(n_prompts, prompt_len))  # equal lengths: one batch, no padding

    def run(tokens):
        with torch.no_grad():
            out = model.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                num_return_sequences=n_samples,
                max_new_tokens=tokens,
                min_new_tokens=tokens,
            )
        return [(r, []) for r in out[:, prompt_len:].tolist()]

    return run


def nanochat_runner(depth, n_prompts, n_samples, prompt_len, new_tokens):
    import nanochat.gpt
    import torch
    from nanochat.engine import Engine
    from nanochat.gpt import GPT, GPTConfig

    # the same model as nanorl's: no value embeddings (nanochat decides per layer with has_ve) and every layer
    # attending over the full context (window pattern "L"); smear and the residual scalars stay, a few vectors
    nanochat.gpt.has_ve = lambda layer_idx, n_layer: False

    class Specials:  # ids outside the vocab: never sampled, so no row stops and no tool runs (as stop_tokens=[] here)
        def encode_special(self, s):
            return 10**9 + hash(s) % 1000

        def get_bos_token_id(self):
            return 10**9 - 1

    n_embd = depth * 64
    cfg = GPTConfig(
        sequence_len=SEQ_LEN,
        vocab_size=VOCAB,
        n_layer=depth,
        n_head=n_embd // HEAD_DIM,
        n_kv_head=n_embd // HEAD_DIM,
        n_embd=n_embd,
        window_pattern="L",
    )
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(cfg)
    model.to_empty(device="cpu")
    model.init_weights()
    assert not model.value_embeds, "nanochat still built value embeddings"
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    engine = Engine(model.eval(), Specials())
    prompts = prompts_for(n_prompts, prompt_len)

    def run(tokens):
        out = []
        for i, p in enumerate(prompts):  # one prompt per call: nanochat's engine shares one prompt per batch
            rows = [[] for _ in range(n_samples)]
            for column, _ in engine.generate(p, num_samples=n_samples, max_tokens=tokens, temperature=1.0, seed=i):
                for r, t in zip(rows, column):
                    r.append(t)
            out += [(r, []) for r in rows]
        return out

    return run


def worker(kind, path, prompt_len, new_tokens, engine_only):
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, path)
    runners = {}
    for line in sys.stdin:
        ask = json.loads(line)
        name = ask["shape"]
        if name not in runners:
            depth, n_prompts, n_samples = SHAPES[name]
            if kind in ("llama", "hf"):  # the same saved Llama, by nanorl's engine or by transformers
                make = llama_runner if kind == "llama" else hf_runner
                runners[name] = make(ask["llama_dir"], n_prompts, n_samples, prompt_len, new_tokens)
            elif kind == "nanorl":
                runners[name] = nanorl_runner(depth, n_prompts, n_samples, prompt_len, new_tokens, engine_only)
            else:
                runners[name] = nanochat_runner(depth, n_prompts, n_samples, prompt_len, new_tokens)
            runners[name](4)  # warm-up: allocations, first-call paths
        t0 = time.perf_counter()
        out = runners[name](new_tokens)
        seconds = time.perf_counter() - t0
        digest = hashlib.sha256(repr(out).encode()).hexdigest()[:16]
        print(json.dumps({"seconds": seconds, "digest": digest, "tokens": sum(len(t) for t, _ in out)}), flush=True)


# --- driver ------------------------------------------------------------------------------------


def checkout_of(ref, tmp):
    """A directory holding nanorl/ at ref: ref itself if it is a directory, else `git archive ref nanorl`."""
    if os.path.isdir(ref):
        return os.path.abspath(ref)
    dest = os.path.join(tmp, "ref")
    os.makedirs(dest)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        archive = subprocess.run(["git", "-C", root, "archive", ref, "nanorl"], check=True, capture_output=True).stdout
    except subprocess.CalledProcessError as e:
        sys.exit(f"--compare-ref {ref}: not a directory, and git cannot archive it ({e.stderr.decode().strip()})")
    subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
    return dest


def start(kind, path, args):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        kind,
        "--path",
        path,
        "--prompt-len",
        str(args.prompt_len),
        "--new-tokens",
        str(args.new_tokens),
    ]
    cmd += ["--engine-only"] if args.engine_only else []
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def ask(proc, shape, llama_dir=None):
    proc.stdin.write(json.dumps({"shape": shape, "llama_dir": llama_dir}) + "\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    if not line:
        sys.exit(f"a worker died on {shape} (its error is above)")
    return json.loads(line)


def main():
    parser = argparse.ArgumentParser(description="nanorl engine speed, A/B interleaved")
    parser.add_argument("--compare-ref", type=str, default=None, help="a git ref or a nanorl checkout to time against")
    parser.add_argument("--nanochat", type=str, default=None, help="a nanochat checkout to time against")
    parser.add_argument("--rounds", type=int, default=3, help="timed runs of each engine at each shape")
    parser.add_argument("--shapes", type=str, default=",".join(SHAPES), help="comma-separated: " + ", ".join(SHAPES))
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    here = os.path.dirname(os.path.abspath(__file__))
    parser.add_argument("--out", type=str, default=os.path.join(here, "engine_speed.json"))
    parser.add_argument(
        "--engine-only",
        action="store_true",
        help="nanorl only: fixed logits instead of the decode forward, to time the engine's own work",
    )
    parser.add_argument(
        "--hf",
        action="store_true",
        help="also time one random Llama through nanorl's engine (--hf-model import) and transformers' generate",
    )
    parser.add_argument("--worker", choices=["nanorl", "nanochat", "llama", "hf"], help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.path, args.prompt_len, args.new_tokens, args.engine_only)
    shapes = args.shapes.split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        sys.exit(f"--shapes: unknown {unknown}; valid: {', '.join(SHAPES)}")
    if args.engine_only and (args.nanochat or args.hf):
        sys.exit("--engine-only replaces nanorl's decode forward; it has no meaning for --nanochat or --hf")
    if args.nanochat and not os.path.isfile(os.path.join(args.nanochat, "nanochat", "engine.py")):
        sys.exit(f"--nanochat {args.nanochat}: no nanochat/engine.py there")
    with tempfile.TemporaryDirectory() as tmp:
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        engines = {"this": start("nanorl", here, args)}
        if args.compare_ref:
            engines["ref"] = start("nanorl", checkout_of(args.compare_ref, tmp), args)
        if args.nanochat:
            engines["nanochat"] = start("nanochat", os.path.abspath(args.nanochat), args)
        llama_dirs = {}
        if args.hf:
            engines["llama"], engines["hf"] = start("llama", here, args), start("hf", here, args)
            for depth in sorted({SHAPES[s][0] for s in shapes}):
                llama_dirs[depth] = os.path.join(tmp, f"llama_d{depth}")
                save_llama(depth, llama_dirs[depth])
        timed_at = {s: [e for e in engines if e not in ("llama", "hf") or s in HF_SHAPES] for s in shapes}
        runs = {s: {e: [] for e in timed_at[s]} for s in shapes}
        for r in range(args.rounds):
            for s in shapes:
                order = (
                    timed_at[s][r % len(timed_at[s]) :] + timed_at[s][: r % len(timed_at[s])]
                )  # rotate who goes first
                for e in order:
                    runs[s][e].append(ask(engines[e], s, llama_dirs.get(SHAPES[s][0])))
                    print(f"round {r + 1} {s:10s} {e:8s} {runs[s][e][-1]['seconds']:7.2f} s", flush=True)
        for p in engines.values():
            p.stdin.close()
            p.wait()
    import torch

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's nanorl
    from nanorl.benchmark import copy_bandwidth  # here, not at the top: a worker imports another checkout's nanorl

    torch.set_num_threads(1)  # the bandwidth each one-thread engine could have had
    report(args, shapes, runs, copy_bandwidth())


def cpu_model():
    """The CPU's model name (lscpu's "Model name"), for the record: ratios move with the CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


def bytes_read(shape, prompt_len, new_tokens, calls, shared_prompt=False):
    """Bytes a whole generation's decode steps read, made in `calls` engine calls of equal rows: every matmul
    weight once per step (12 d^2 a layer + the d x V unembedding, fp32; as nanochat's and the Llama's, to a few
    vectors) and each row's KV so far (P + N/2 tokens on average, keys and values of every layer). shared_prompt:
    the samples of one prompt read its KV once a step (nanorl's engine, decode.attend_shared_prefix)."""
    depth, n_prompts, n_samples = SHAPES[shape]
    d = depth * 64
    weights = 4 * (12 * depth * d * d + d * VOCAB)
    kv_per_token = 4 * 2 * depth * d
    rows = n_prompts * n_samples // calls
    kv_tokens = rows * (prompt_len + new_tokens / 2)
    if shared_prompt and n_prompts == 1:
        kv_tokens = prompt_len + rows * new_tokens / 2
    return calls * new_tokens * (weights + kv_tokens * kv_per_token)


def ratio(runs, slow, fast):
    """slow's time over fast's, round by round (the two ran back to back, so a busy moment slows both alike) ->
    (median, min, max) of the per-round ratios."""
    rs = [a["seconds"] / b["seconds"] for a, b in zip(runs[slow], runs[fast])]
    return round(statistics.median(rs), 3), round(min(rs), 3), round(max(rs), 3)


def tree():
    """The nanorl commit timed ("-dirty" when the work tree differs from it), or None outside a git checkout."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "-uno"], cwd=root, capture_output=True, text=True)
    except OSError:
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "") if head.returncode == 0 else None


def report(args, shapes, runs, bandwidth):
    result = {
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "nanorl": tree(),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "compare_ref": args.compare_ref,
        "nanochat": args.nanochat,
        "engine_only": args.engine_only,
        "hf": args.hf,
        "setup": f"random weights, fp32, 1 thread, CPU, vocab {VOCAB}, head_dim {HEAD_DIM}, {args.prompt_len}-token "
        f"prompts, {args.new_tokens} new tokens at T=1, no top-k, {args.rounds} interleaved rounds; speed-ups are "
        "medians of per-round ratios [min, max]",
        "copy_bandwidth_bytes_per_s": round(bandwidth),
        "shapes": {},
    }
    print(f"CPU: {result['cpu']} ({result['cores']} cores), copy bandwidth {bandwidth / 1e9:.1f} GB/s on one thread")
    for s in shapes:
        row = {}
        for e, rs in runs[s].items():
            seconds = [x["seconds"] for x in rs]
            row[e] = {
                "median_s": statistics.median(seconds),
                "runs_s": [round(t, 3) for t in seconds],
                "tokens": rs[0]["tokens"],
            }
            row[e]["tokens_per_s"] = round(row[e]["tokens"] / row[e]["median_s"], 1)
            # MBU: nanochat's engine takes one call per distinct prompt, so it reads the weights that many times;
            # this tree's engine reads a prompt's KV once for its samples (a --compare-ref tree is counted without)
            calls = SHAPES[s][1] if e == "nanochat" else 1
            nbytes = bytes_read(s, args.prompt_len, args.new_tokens, calls, shared_prompt=e in ("this", "llama"))
            row[e]["mbu"] = round(nbytes / row[e]["median_s"] / bandwidth, 3)
        if "ref" in row:
            row["speedup_vs_ref"] = ratio(runs[s], "ref", "this")
            pairs = zip(runs[s]["this"], runs[s]["ref"])
            row["bit_identical_to_ref"] = all(a["digest"] == b["digest"] for a, b in pairs)
        if "nanochat" in row:
            row["speedup_vs_nanochat"] = ratio(runs[s], "nanochat", "this")
        if "hf" in row:  # the same Llama: nanorl's engine on it against transformers' generate
            row["llama_speedup_vs_hf"] = ratio(runs[s], "hf", "llama")
        result["shapes"][s] = row
        print(s, {k: v if not isinstance(v, dict) else (v["tokens_per_s"], v["mbu"]) for k, v in row.items()})
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
