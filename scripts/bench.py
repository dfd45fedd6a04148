"""
Benchmarks on a random-init model of a given size: print the numbers, then one final JSON line.

    python -m scripts.bench decode --depth 20 --batch 256 --prompt-len 128 --new-tokens 512
    python -m scripts.bench decode --depth 2 --batch 4 --prompt-len 32 --new-tokens 32 --vocab-size 4096 --threads 1  # CPU
    python -m scripts.bench decode --depth 4 --batch 64 --requests 1 --prompt-len 32 --new-tokens 64 --threads 1  # one user, big engine
    python -m scripts.bench train --depth 20 --batch 32 --seq-len 2048
    python -m scripts.bench train --depth 2 --batch 4 --seq-len 64 --head-dim 64 --vocab-size 4096 --threads 1  # CPU
    python -m scripts.bench rl --depth 20 --prompts 16 --samples 16 --prompt-len 150 --new-tokens 256
    python -m scripts.bench rl --depth 2 --prompts 4 --samples 4 --prompt-len 32 --new-tokens 32 --vocab-size 4096 --threads 1  # CPU
"""
import argparse
import json
import resource
import time

import torch

from nanorl.common import ArgumentParser, nonneg_float, nonneg_int, positive_float, positive_int, autocast_ctx, autodetect_device_type, get_peak_bandwidth, get_peak_flops, synchronize


def peak_memory_gb(device_type):
    if device_type == "cuda":
        return torch.cuda.max_memory_allocated() / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # peak RSS of the whole process (Linux: KiB)


def bench_train(args):
    """Throughput of base_train's step on random tokens: forward + backward under bf16 autocast (CUDA), gradient
    clipping, a MuonAdamW step; the model is torch.compile'd on CUDA. Warm-up steps (compilation, allocator) are
    not timed. MFU = estimate_flops() per token x tokens/s over the GPU's peak bf16 FLOP/s."""
    from nanorl.gpt import build_model, config_from_depth
    from nanorl.optim import build_optimizer

    device_type = args.device_type or autodetect_device_type()
    device = torch.device(device_type)
    B, T = args.batch, args.seq_len
    if min(B, T, args.steps) < 1 or args.warmup < 0:
        raise SystemExit("--batch, --seq-len and --steps must be >= 1, --warmup >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = config_from_depth(args.depth, args.vocab_size, sequence_len=T, head_dim=args.head_dim, n_kv_head=args.n_kv_head)
    model = build_model(cfg, device)
    model.train()
    optimizer = build_optimizer(model)
    compile_it = device_type == "cuda" and not args.no_compile
    compiled = torch.compile(model, dynamic=False) if compile_it else model
    autocast = autocast_ctx(device_type)
    tokens = torch.randint(0, args.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(1)).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def step():
        with autocast:
            loss = compiled(x, targets=y)
        loss.backward()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        model.zero_grad(set_to_none=True)
        return loss.detach()

    t0 = time.perf_counter()
    for _ in range(args.warmup):
        step()
    synchronize(device_type)
    warmup_s = time.perf_counter() - t0
    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    name = torch.cuda.get_device_name() if device_type == "cuda" else device_type
    peak = get_peak_flops(name) if device_type == "cuda" else None
    flops_per_token = model.estimate_flops()
    print(f"train | {name} | depth {args.depth} ({model.num_params() / 1e6:.1f}M params) | batch {B} x seq {T} = {B * T:,} tokens/step | "
          f"compiled {'yes' if compile_it else 'no'} | {'bf16 autocast' if device_type == 'cuda' else 'fp32'} | "
          f"warm-up {args.warmup} steps {warmup_s:.1f}s")
    print(f"{'step':>5} | {'ms':>9} | {'tok/s':>12} | {'loss':>8}")
    times, losses = [], []
    for i in range(args.steps):
        synchronize(device_type)
        t0 = time.perf_counter()
        loss = step()
        synchronize(device_type)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())  # after the timer: the sync it costs is not the step's
        print(f"{i + 1:>5} | {times[-1] * 1e3:>9.2f} | {B * T / times[-1]:>12,.0f} | {losses[-1]:>8.4f}")
    tok_s = B * T * len(times) / sum(times)
    mfu = flops_per_token * tok_s / peak if peak else None
    peak_mem = peak_memory_gb(device_type)
    print(f"mean {sum(times) / len(times) * 1e3:.2f} ms/step, {tok_s:,.0f} tok/s, {flops_per_token:.3e} FLOPs/token, "
          f"peak memory {peak_mem:.2f} GB; " + (f"MFU {mfu:.1%}" if mfu is not None else "MFU: n/a (no peak FLOP/s known for this device)"))
    print(json.dumps({"bench": "train", "device": name, "depth": args.depth, "params": model.num_params(), "batch": B, "seq_len": T,
                      "n_head": cfg.n_head, "n_kv_head": cfg.n_kv_head, "compiled": compile_it, "warmup": args.warmup,
                      "steps": args.steps, "ms_per_step": round(sum(times) / len(times) * 1e3, 3), "tok_per_s": round(tok_s, 1),
                      "flops_per_token": flops_per_token, "mfu": None if mfu is None else round(mfu, 4),
                      "peak_mem_gb": round(peak_mem, 3), "loss_first": round(losses[0], 4), "loss_last": round(losses[-1], 4)}))


def bench_decode(args):
    """Sampling speed of the engine on the path chat_rl and chat_eval take (the fp32 model in, the engine's own
    inference copy of the weights: bf16 on CUDA): time to first token, ms per decode step, tokens/s, peak memory,
    MBU (bytes a decode step must read - the weights once, plus every busy row's KV - per second, over peak
    bandwidth) and the cost of refreshing the engine's weights from the model (chat_rl does it every step)."""
    from nanorl.engine import Engine, Request
    from nanorl.gpt import build_model, config_from_depth
    from nanorl.tokenizer import SPLIT_PATTERN, Tokenizer

    device_type = args.device_type or autodetect_device_type()
    device = torch.device(device_type)
    B, P, N = args.batch, args.prompt_len, args.new_tokens
    R = B if args.requests is None else args.requests
    if min(B, P, N) < 1 or not 1 <= R <= B:
        raise SystemExit("--batch, --prompt-len and --new-tokens must all be >= 1, and --requests in [1, --batch]")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = config_from_depth(args.depth, args.vocab_size, sequence_len=P + N, head_dim=args.head_dim, n_kv_head=args.n_kv_head)
    model = build_model(cfg, device).eval()  # fp32 master weights, as the trainer holds them
    # a byte-level tokenizer needs no training; the engine only needs its special tokens
    tok = Tokenizer.from_ranks({bytes([i]): i for i in range(256)}, SPLIT_PATTERN)
    engine = Engine(model, tok, batch_size=B, max_len=P + N, cuda_graph=False if args.no_cuda_graph else None)

    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, 256, (R, P), generator=g).tolist()

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
    refresh = []
    for _ in range(5):  # the engine's weights refreshed from the model, as after each optimizer step
        synchronize(device_type)
        t0 = time.perf_counter()
        engine.load_weights(model)
        synchronize(device_type)
        refresh.append(time.perf_counter() - t0)
    refresh_ms = sorted(refresh)[2] * 1e3  # the median

    # bytes a decode step has to read: every matmul weight once (the embedding is a B-row lookup), and each
    # row's whole KV so far; rows hold P+1 .. P+N-1 tokens over the decode steps, P + N/2 on average
    weight_bytes = sum(p.numel() * p.element_size() for n, p in engine.model.named_parameters() if "wte" not in n)
    kv_per_token = (engine.cache.k.nbytes + engine.cache.v.nbytes) // (B * engine.max_len)  # all layers, K and V
    kv_step = R * (P + N / 2) * kv_per_token
    step_bytes = weight_bytes + kv_step
    peak_mem = peak_memory_gb(device_type)
    name = torch.cuda.get_device_name() if device_type == "cuda" else device_type
    bw = get_peak_bandwidth(name) if device_type == "cuda" else None
    mbu = step_bytes / (ms_step / 1e3) / bw if bw and N > 1 else None

    weights = str(engine.model.lm_head.weight.dtype).removeprefix("torch.")
    print(f"decode | {name} | depth {args.depth} ({model.num_params() / 1e6:.1f}M params, engine copy in {weights}) | "
          f"batch {B} | requests {R} | prompt {P} | new {N} | heads {cfg.n_head}, kv heads {cfg.n_kv_head} | "
          f"cuda graph {'on' if engine.use_cuda_graph else 'off'}")
    print(f"time to first token: {ttft * 1e3:.1f} ms (prefill of all {R} prompts + first token)")
    print(f"decode: {ms_step:.2f} ms/step, {R / ms_step * 1e3:.0f} tok/s; end to end {ntok / total:.0f} tok/s")
    print(f"weight refresh (engine.load_weights): {refresh_ms:.2f} ms")
    print(f"per step: weights {weight_bytes / 1e6:.1f} MB + KV {kv_step / 1e6:.1f} MB "
          f"({kv_per_token / 1e3:.2f} KB of KV per token); peak memory {peak_mem:.2f} GB")
    print(f"MBU: {mbu:.1%}" if mbu is not None else "MBU: n/a (no peak bandwidth known for this device)")
    print(json.dumps({"bench": "decode", "device": name, "depth": args.depth, "batch": B, "requests": R, "prompt_len": P,
                      "new_tokens": N, "n_head": cfg.n_head, "n_kv_head": cfg.n_kv_head,
                      "cuda_graph": engine.use_cuda_graph, "ttft_ms": round(ttft * 1e3, 2),
                      "ms_per_step": round(ms_step, 3), "decode_tok_per_s": round(R / ms_step * 1e3, 1),
                      "engine_weights": weights, "weight_refresh_ms": round(refresh_ms, 3),
                      "tok_per_s": round(ntok / total, 1), "weight_bytes": weight_bytes,
                      "kv_bytes_per_token": kv_per_token, "kv_bytes_per_step": int(kv_step),
                      "peak_mem_gb": round(peak_mem, 3), "mbu": None if mbu is None else round(mbu, 4)}))


def bench_rl(args):
    """One GRPO step of chat_rl's shape on a random-init model: rollout (the engine, every response forced to the
    full --new-tokens, the worst case of a GSM8K rollout), rewards, then chat_rl's own training step
    (nanorl.rl_trainer.Trainer: advantages, the loss over micro-batches, one optimizer step), with chat_rl's
    defaults for every training flag. Time split rollout / train, tok/s of each, peak memory."""
    from nanorl import rl_trainer
    from nanorl.common import Timer
    from nanorl.engine import Engine, Request
    from nanorl.gpt import build_model, config_from_depth
    from nanorl.optim import build_optimizer
    from nanorl.rollout import Sample
    from nanorl.tokenizer import SPLIT_PATTERN, Tokenizer

    device_type = args.device_type or autodetect_device_type()
    device = torch.device(device_type)
    n_prompts, n, P, N = args.prompts, args.samples, args.prompt_len, args.new_tokens
    if min(n_prompts, P, N, args.steps) < 1:
        raise SystemExit("--prompts, --prompt-len, --new-tokens and --steps must all be >= 1")
    if n < 2:
        raise SystemExit(f"--samples must be >= 2 (GRPO normalises by the group's std), got {n}")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = config_from_depth(args.depth, args.vocab_size, sequence_len=P + N, head_dim=args.head_dim, n_kv_head=args.n_kv_head)
    # like chat_rl: fp32 master weights, bf16 autocast on CUDA for both the engine and the trainer
    model = build_model(cfg, device)
    optimizer = build_optimizer(model)
    for g in optimizer.param_groups:
        g["initial_lr"] = g["lr"] = g["initial_lr"] * args.lr_scale
    # chat_rl's training flags at their defaults, with this benchmark's shape
    p = argparse.ArgumentParser()
    rl_trainer.add_args(p)
    targs = p.parse_args(["--max-tokens-per-gpu", str(args.max_tokens_per_gpu)])
    targs.advantage_estimator, targs.temperature, targs.n_samples_per_prompt, targs.max_response_len = "grpo", 1.0, n, N
    trainer = rl_trainer.Trainer(targs, model, optimizer, device)
    tok = Tokenizer.from_ranks({bytes([i]): i for i in range(256)}, SPLIT_PATTERN)  # the engine needs only its specials
    engine = Engine(model, tok, batch_size=args.engine_batch_size or n_prompts * n, max_len=P + N)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, 256, (n_prompts, P), generator=g).tolist()

    def rl_step(step):
        """Returns (rollout seconds, train seconds, generated tokens, trained tokens, mean reward, grad norm)."""
        model.eval()
        synchronize(device_type)
        t0 = time.perf_counter()
        # stop_tokens=[]: a random model rarely ends a response, so every response runs to the budget
        reqs = [Request(p, num_samples=n, max_tokens=N, temperature=1.0, seed=step * n_prompts + i, stop_tokens=[],
                        use_tools=False) for i, p in enumerate(prompts)]
        samples = [Sample(tokens=list(p) + list(c.tokens), response_length=len(c.tokens), loss_mask=list(c.mask),
                          rollout_log_probs=list(c.logprobs), status=c.status, group_index=gi, index=si, weight_version=step)
                   for gi, (p, comps) in enumerate(zip(prompts, engine.generate(reqs))) for si, c in enumerate(comps)]
        # a cheap deterministic reward from the sampled tokens (parity of their sum): about half right, so
        # every group has a non-zero advantage, as in a useful rollout
        for s in samples:
            s.reward = float(sum(s.tokens[s.prompt_length:]) % 2)
        synchronize(device_type)
        t1 = time.perf_counter()
        m = trainer.train_step(step, samples, Timer())
        engine.load_weights(model)  # as chat_rl: the engine samples from its own copy of the weights
        synchronize(device_type)
        t2 = time.perf_counter()
        gen_tok = sum(s.response_length for s in samples)
        reward = sum(s.reward for s in samples) / len(samples)
        return t1 - t0, t2 - t1, gen_tok, sum(len(s.tokens) for s in samples), reward, m["train/grad_norm"]

    rl_step(0)  # warm up: kernels, allocator, the optimizer's state
    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    runs = [rl_step(k + 1) for k in range(args.steps)]
    t_roll = sum(r[0] for r in runs) / len(runs)
    t_train = sum(r[1] for r in runs) / len(runs)
    gen_tok, train_tok, reward = runs[-1][2], runs[-1][3], sum(r[4] for r in runs) / len(runs)
    peak_mem = peak_memory_gb(device_type)
    name = torch.cuda.get_device_name() if device_type == "cuda" else device_type

    print(f"rl | {name} | depth {args.depth} ({model.num_params() / 1e6:.1f}M params) | {n_prompts} prompts x {n} samples | "
          f"prompt {P} | new {N} (forced) | engine batch {engine.batch_size} | cuda graph {'on' if engine.use_cuda_graph else 'off'} "
          f"| mean of {len(runs)} step(s) after a warm-up")
    print(f"{'phase':<8} {'seconds':>9} {'share':>7} {'tok/s':>10}")
    print(f"{'rollout':<8} {t_roll:>9.3f} {t_roll / (t_roll + t_train):>7.1%} {gen_tok / t_roll:>10,.0f}")
    print(f"{'train':<8} {t_train:>9.3f} {t_train / (t_roll + t_train):>7.1%} {train_tok / t_train:>10,.0f}")
    print(f"{'total':<8} {t_roll + t_train:>9.3f} {1:>7.0%}")
    print(f"generated {gen_tok:,} tokens, trained on {train_tok:,} (prompt + response); mean reward {reward:.3f}; "
          f"peak memory {peak_mem:.2f} GB")
    print(json.dumps({"bench": "rl", "device": name, "depth": args.depth, "params": model.num_params(), "prompts": n_prompts,
                      "samples": n, "prompt_len": P, "new_tokens": N, "steps": len(runs),
                      "rollout_s": round(t_roll, 6), "train_s": round(t_train, 6), "total_s": round(t_roll + t_train, 6),
                      "rollout_tok_per_s": round(gen_tok / t_roll, 1), "train_tok_per_s": round(train_tok / t_train, 1),
                      "generated_tokens": gen_tok, "trained_tokens": train_tok, "reward_mean": round(reward, 4),
                      "grad_norm": round(runs[-1][5], 6), "peak_mem_gb": round(peak_mem, 3)}))


def model_and_device_args(p):
    """The flags every benchmark shares: the random-init model's shape (besides --depth) and where it runs."""
    p.add_argument("--n-kv-head", type=positive_int, default=None, help="KV heads (default: as many as query heads)")
    p.add_argument("--head-dim", type=positive_int, default=128)
    p.add_argument("--vocab-size", type=positive_int, default=32768)
    p.add_argument("--device-type", type=str, default=None, help="cuda|cpu|mps (default: autodetect)")
    p.add_argument("--threads", type=positive_int, default=None, help="CPU threads (default: torch's choice; 1 is steadier on a busy machine)")


def main():
    parser = ArgumentParser(description="nanorl benchmarks")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("decode", help="sampling engine: TTFT, ms/step, tok/s, peak memory, MBU")
    p.add_argument("--depth", type=positive_int, default=20)
    p.add_argument("--batch", type=positive_int, default=64, help="engine batch slots")
    p.add_argument("--requests", type=positive_int, default=None, help="requests in flight, one sample each (default: --batch, all slots busy)")
    p.add_argument("--prompt-len", type=positive_int, default=128)
    p.add_argument("--new-tokens", type=positive_int, default=256)
    p.add_argument("--no-cuda-graph", action="store_true", help="decode eagerly on CUDA")
    model_and_device_args(p)
    p.set_defaults(func=bench_decode)
    p = sub.add_parser("train", help="base_train's step on random tokens: tok/s, MFU, peak memory")
    p.add_argument("--depth", type=positive_int, default=20)
    p.add_argument("--batch", type=positive_int, default=32, help="rows per step (one micro-batch)")
    p.add_argument("--seq-len", type=positive_int, default=2048)
    p.add_argument("--warmup", type=nonneg_int, default=5, help="untimed steps first (torch.compile, allocator)")
    p.add_argument("--steps", type=positive_int, default=10, help="timed steps")
    p.add_argument("--grad-clip", type=nonneg_float, default=1.0, help="as base_train; 0 = off")
    p.add_argument("--no-compile", action="store_true", help="run eagerly on CUDA")
    model_and_device_args(p)
    p.set_defaults(func=bench_train)
    p = sub.add_parser("rl", help="one GRPO step (rollout + train) of chat_rl's GSM8K shape: time split, tok/s, peak memory")
    p.add_argument("--depth", type=positive_int, default=20)
    p.add_argument("--prompts", type=positive_int, default=16, help="prompts per rollout")
    p.add_argument("--samples", type=positive_int, default=16, help="samples per prompt (the group)")
    p.add_argument("--prompt-len", type=positive_int, default=150, help="prompt tokens (GSM8K questions are ~150)")
    p.add_argument("--new-tokens", type=positive_int, default=256, help="response tokens, all generated (no stop tokens)")
    p.add_argument("--steps", type=positive_int, default=1, help="timed steps after the warm-up step (their mean is reported)")
    p.add_argument("--engine-batch-size", type=positive_int, default=None, help="engine rows (default: prompts x samples, all at once)")
    p.add_argument("--max-tokens-per-gpu", type=positive_int, default=8192, help="tokens per packed training micro-batch (chat_rl's flag)")
    p.add_argument("--lr-scale", type=positive_float, default=0.05, help="multiplier on the optimizer LRs (chat_rl's default)")
    model_and_device_args(p)
    p.set_defaults(func=bench_rl)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
