"""
Benchmarks on a random-init model of a given size: print the numbers, then one final JSON line.

    python -m scripts.bench decode --depth 20 --batch 256 --prompt-len 128 --new-tokens 512
    python -m scripts.bench decode --depth 2 --batch 4 --prompt-len 32 --new-tokens 32 --vocab-size 4096 --threads 1  # CPU
"""
import argparse
import json
import resource
import time

import torch

from nanorl.common import autodetect_device_type, get_peak_bandwidth, synchronize


def bench_decode(args):
    """Sampling speed of the engine: time to first token, ms per decode step, tokens/s, peak memory and MBU
    (bytes a decode step must read - the weights once, plus every row's KV - per second, over peak bandwidth)."""
    from nanorl.engine import Engine, Request
    from nanorl.gpt import build_model, config_from_depth
    from nanorl.tokenizer import SPLIT_PATTERN, Tokenizer

    device_type = args.device_type or autodetect_device_type()
    device = torch.device(device_type)
    B, P, N = args.batch, args.prompt_len, args.new_tokens
    if min(B, P, N) < 1:
        raise SystemExit("--batch, --prompt-len and --new-tokens must all be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = config_from_depth(args.depth, args.vocab_size, sequence_len=P + N, head_dim=args.head_dim, n_kv_head=args.n_kv_head)
    model = build_model(cfg, device).eval()
    if device_type == "cuda":  # serve bf16 weights (RL samples from its fp32 master weights under autocast instead)
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
    # a byte-level tokenizer needs no training; the engine only needs its special tokens
    tok = Tokenizer.from_ranks({bytes([i]): i for i in range(256)}, SPLIT_PATTERN)
    engine = Engine(model, tok, batch_size=B, max_len=P + N, cuda_graph=False if args.no_cuda_graph else None)

    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, 256, (B, P), generator=g).tolist()

    def run(max_tokens):
        reqs = [Request(p, max_tokens=max_tokens, temperature=1.0, seed=i, stop_tokens=[], use_tools=False)
                for i, p in enumerate(prompts)]
        synchronize(device_type)
        t0 = time.perf_counter()
        out = engine.generate(reqs)
        synchronize(device_type)
        return time.perf_counter() - t0, sum(len(c[0].tokens) for c in out)

    run(2 if device_type == "cpu" else N)  # warm up (kernels, allocator; CUDA graphs were captured by Engine())
    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    ttft, _ = run(1)  # prefill of all B prompts and their first sampled token
    total, ntok = run(N)
    steps = max(N - 1, 1)
    ms_step = (total - ttft) / steps * 1e3 if N > 1 else float("nan")

    # bytes a decode step has to read: every matmul weight once (the embedding is a B-row lookup), and each
    # row's whole KV so far; rows hold P+1 .. P+N-1 tokens over the decode steps, P + N/2 on average
    weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "wte" not in n)
    kv_per_token = (engine.cache.k.nbytes + engine.cache.v.nbytes) // (B * engine.max_len)  # all layers, K and V
    kv_step = B * (P + N / 2) * kv_per_token
    step_bytes = weight_bytes + kv_step
    if device_type == "cuda":
        peak_mem = torch.cuda.max_memory_allocated() / 1e9
        name = torch.cuda.get_device_name()
    else:  # peak RSS of the whole process (Linux reports KiB)
        peak_mem = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
        name = device_type
    bw = get_peak_bandwidth(name) if device_type == "cuda" else None
    mbu = step_bytes / (ms_step / 1e3) / bw if bw and N > 1 else None

    print(f"decode | {name} | depth {args.depth} ({model.num_params() / 1e6:.1f}M params) | batch {B} | prompt {P} | "
          f"new {N} | heads {cfg.n_head}, kv heads {cfg.n_kv_head} | cuda graph {'on' if engine.use_cuda_graph else 'off'}")
    print(f"time to first token: {ttft * 1e3:.1f} ms (prefill of all {B} prompts + first token)")
    print(f"decode: {ms_step:.2f} ms/step, {B / ms_step * 1e3:.0f} tok/s; end to end {ntok / total:.0f} tok/s")
    print(f"per step: weights {weight_bytes / 1e6:.1f} MB + KV {kv_step / 1e6:.1f} MB "
          f"({kv_per_token / 1e3:.2f} KB of KV per token); peak memory {peak_mem:.2f} GB")
    print(f"MBU: {mbu:.1%}" if mbu is not None else "MBU: n/a (no peak bandwidth known for this device)")
    print(json.dumps({"bench": "decode", "device": name, "depth": args.depth, "batch": B, "prompt_len": P,
                      "new_tokens": N, "n_head": cfg.n_head, "n_kv_head": cfg.n_kv_head,
                      "cuda_graph": engine.use_cuda_graph, "ttft_ms": round(ttft * 1e3, 2),
                      "ms_per_step": round(ms_step, 3), "decode_tok_per_s": round(B / ms_step * 1e3, 1),
                      "tok_per_s": round(ntok / total, 1), "weight_bytes": weight_bytes,
                      "kv_bytes_per_token": kv_per_token, "kv_bytes_per_step": int(kv_step),
                      "peak_mem_gb": round(peak_mem, 3), "mbu": None if mbu is None else round(mbu, 4)}))


def main():
    parser = argparse.ArgumentParser(description="nanorl benchmarks")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("decode", help="sampling engine: TTFT, ms/step, tok/s, peak memory, MBU")
    p.add_argument("--depth", type=int, default=20)
    p.add_argument("--batch", type=int, default=64, help="engine batch slots (all filled)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--n-kv-head", type=int, default=None, help="KV heads (default: as many as query heads)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=32768)
    p.add_argument("--no-cuda-graph", action="store_true", help="decode eagerly on CUDA")
    p.add_argument("--device-type", type=str, default=None, help="cuda|cpu|mps (default: autodetect)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's choice; 1 is steadier on a busy machine)")
    p.set_defaults(func=bench_decode)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
