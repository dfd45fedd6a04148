"""
Benchmarks on a random-init model of a given size: print the numbers, then one final JSON line.

    python -m scripts.bench decode --depth 20 --batch 256 --prompt-len 128 --new-tokens 512
    python -m scripts.bench decode --depth 2 --batch 4 --prompt-len 32 --new-tokens 32 --vocab-size 4096 --threads 1  # CPU
    python -m scripts.bench decode --depth 4 --batch 64 --requests 1 --prompt-len 32 --new-tokens 64 --threads 1  # one user, big engine
    python -m scripts.bench train --depth 20 --batch 32 --seq-len 2048
    python -m scripts.bench train --depth 2 --batch 4 --seq-len 64 --head-dim 64 --vocab-size 4096 --threads 1  # CPU
    python -m scripts.bench train --depth 20 --batch 32 --seq-len 2048 --fsdp  # one process: FSDP2 over one rank
    python -m scripts.bench rl --depth 20 --prompts 16 --samples 16 --prompt-len 150 --new-tokens 256
    python -m scripts.bench rl --depth 2 --prompts 4 --samples 4 --prompt-len 32 --new-tokens 32 --vocab-size 4096 --threads 1  # CPU
    python -m scripts.bench rl --depth 20 --prompts 16 --samples 16 --prompt-len 150 --new-tokens 256 --lora-rank 16
    python -m scripts.bench hf --arch qwen2 --size 0.5b --batches 1 64 256  # Qwen2.5-0.5B's shape, random weights
    python -m scripts.bench hf --size 7b --batches 1 64 --lora-rank 16  # Qwen2.5-7B's shape, RL with LoRA on one GPU
    python -m scripts.bench hf --size tiny --batches 1 2 --prompt-len 8 --new-tokens 8 --rl-prompt-len 8 --rl-new-tokens 8  # CPU
    python -m scripts.bench serve http://127.0.0.1:8000 --clients 64 --max-tokens 128  # a running chat_web server

The hf subcommand lives in scripts/bench_hf.py; the timers, memory and byte accounting, the GRPO stepper and the
load tester shared by them in nanorl/benchmark.py.
"""

import json
import os

import torch

from nanorl import lora
from nanorl.benchmark import (
    bandwidth,
    byte_tokenizer,
    decode_step_bytes,
    device_name,
    get_peak_flops,
    grpo_stepper,
    load_test,
    median_ms,
    peak_memory_gb,
    reset_peak_memory,
    timed,
)
from nanorl.common import autodetect_device_type
from nanorl.flags import ArgumentParser, nonneg_float, nonneg_int, positive_float, positive_int
from nanorl.precision import autocast_ctx, low_precision_dtype
from scripts.bench_hf import HF_SIZES, bench_hf


def one_process_group(device_type):
    """FSDP2 needs a process group: not under torchrun, a one-process group of its own -> the device."""
    import socket

    from nanorl.common import compute_init

    if "RANK" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if os.environ["WORLD_SIZE"] != "1":
        raise SystemExit("bench train --fsdp measures the wrapping's cost on one device: run it as one process")
    return compute_init(device_type)[4]


def gather_ms(model, cfg, device):
    """RL's sampler refresh under FSDP: the full weights gathered into an unsharded copy (bf16 on CUDA), median ms."""
    from nanorl.fsdp import gather_full_state
    from nanorl.gpt import build_model

    sampler = build_model(cfg, device).to(low_precision_dtype(device))
    gathers = [gather_full_state(model, sampler) for _ in range(6)][1:]  # the first call warms up
    ms = sorted(gathers)[2] * 1e3  # the median
    print(f"sampler weight gather (nanorl.fsdp.gather_full_state): {ms:.2f} ms (median of 5)")
    return ms


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
    if args.fsdp:
        device = one_process_group(device_type)
    torch.manual_seed(0)
    cfg = config_from_depth(
        args.depth, args.vocab_size, sequence_len=T, head_dim=args.head_dim, n_kv_head=args.n_kv_head
    )
    model = build_model(cfg, device)
    if args.fsdp:  # as base_train --fsdp: sharded (over one rank here), then the same optimizer and compile
        from nanorl.fsdp import shard_model

        shard_model(model, device)
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

    warmup_s, _ = timed(device_type, lambda: [step() for _ in range(args.warmup)])
    reset_peak_memory(device_type)
    name = device_name(device_type)
    print(
        f"train | {name} | depth {args.depth} ({model.num_params() / 1e6:.1f}M params) | batch {B} x seq {T} = "
        f"{B * T:,} tokens/step | compiled {'yes' if compile_it else 'no'} | "
        f"fsdp {'yes (1 rank)' if args.fsdp else 'no'} | {'bf16 autocast' if device_type == 'cuda' else 'fp32'} | "
        f"warm-up {args.warmup} steps {warmup_s:.1f}s"
    )
    print(f"{'step':>5} | {'ms':>9} | {'tok/s':>12} | {'loss':>8}")
    times, losses = [], []
    for i in range(args.steps):
        seconds, loss = timed(device_type, step)
        times.append(seconds)
        losses.append(loss.item())  # after the timer: the sync it costs is not the step's
        print(f"{i + 1:>5} | {times[-1] * 1e3:>9.2f} | {B * T / times[-1]:>12,.0f} | {losses[-1]:>8.4f}")
    report_train(args, model, cfg, name, compile_it, times, losses, device)
    if args.fsdp:
        from nanorl.common import compute_cleanup

        compute_cleanup()


def report_train(args, model, cfg, name, compile_it, times, losses, device):
    """The summary line and the JSON of bench train (and the FSDP weight gather, timed after the steps)."""
    B, T, device_type = args.batch, args.seq_len, device.type
    peak = get_peak_flops(name) if device_type == "cuda" else None
    flops_per_token = model.estimate_flops()
    tok_s = B * T * len(times) / sum(times)
    mfu = flops_per_token * tok_s / peak if peak else None
    peak_mem = peak_memory_gb(device_type)
    gather = gather_ms(model, cfg, device) if args.fsdp else None
    print(
        f"mean {sum(times) / len(times) * 1e3:.2f} ms/step, {tok_s:,.0f} tok/s, {flops_per_token:.3e} FLOPs/token, "
        f"peak memory {peak_mem:.2f} GB; "
        + (f"MFU {mfu:.1%}" if mfu is not None else "MFU: n/a (no peak FLOP/s known for this device)")
    )
    result = dict(bench="train", device=name, depth=args.depth, params=model.num_params(), batch=B, seq_len=T)
    result.update(n_head=cfg.n_head, n_kv_head=cfg.n_kv_head, compiled=compile_it, fsdp=args.fsdp)
    result.update(warmup=args.warmup, steps=args.steps, ms_per_step=round(sum(times) / len(times) * 1e3, 3))
    result.update(
        tok_per_s=round(tok_s, 1), flops_per_token=flops_per_token, mfu=None if mfu is None else round(mfu, 4)
    )
    result.update(peak_mem_gb=round(peak_mem, 3), loss_first=round(losses[0], 4), loss_last=round(losses[-1], 4))
    result.update(gather_ms=None if gather is None else round(gather, 3))
    print(json.dumps(result))


def bench_decode(args):
    """Sampling speed of the engine on the path chat_rl and chat_eval take (the fp32 model in, the engine's own
    inference copy of the weights: bf16 on CUDA): time to first token, ms per decode step, tokens/s, peak memory,
    MBU (bytes a decode step must read - the weights once, plus every busy row's KV - per second, over peak
    bandwidth) and the cost of refreshing the engine's weights from the model (chat_rl does it every step)."""
    from nanorl.engine import Engine, Request
    from nanorl.gpt import build_model, config_from_depth

    device_type = args.device_type or autodetect_device_type()
    device = torch.device(device_type)
    B, P, N = args.batch, args.prompt_len, args.new_tokens
    R = B if args.requests is None else args.requests
    if min(B, P, N) < 1 or not 1 <= R <= B:
        raise SystemExit("--batch, --prompt-len and --new-tokens must all be >= 1, and --requests in [1, --batch]")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = config_from_depth(
        args.depth, args.vocab_size, sequence_len=P + N, head_dim=args.head_dim, n_kv_head=args.n_kv_head
    )
    model = build_model(cfg, device).eval()  # fp32 master weights, as the trainer holds them
    engine = Engine(
        model, byte_tokenizer(), batch_size=B, max_len=P + N, cuda_graph=False if args.no_cuda_graph else None
    )
    prompts = torch.randint(0, 256, (R, P), generator=torch.Generator().manual_seed(1)).tolist()

    def run(max_tokens):
        reqs = [
            Request(p, max_tokens=max_tokens, temperature=1.0, seed=i, stop_tokens=[], use_tools=False)
            for i, p in enumerate(prompts)
        ]
        seconds, out = timed(device_type, engine.submit_and_wait, reqs)
        return seconds, sum(len(c[0].tokens) for c in out)

    run(2 if device_type == "cpu" else N)  # warm up (kernels, allocator; CUDA graphs were captured by Engine())
    reset_peak_memory(device_type)
    ttft, _ = run(1)  # prefill of all B prompts and their first sampled token
    total, ntok = run(N)
    ms_step = (total - ttft) / max(N - 1, 1) * 1e3 if N > 1 else float("nan")
    # the engine's weights refreshed from the model, as after each optimizer step
    refresh_ms = median_ms(device_type, lambda: engine.load_weights(model))
    report_decode(args, engine, cfg, R, ttft, ms_step, total, ntok, refresh_ms)


def report_decode(args, engine, cfg, R, ttft, ms_step, total, ntok, refresh_ms):
    """The lines and the JSON of bench decode: the timings, and the bytes a step reads against peak bandwidth."""
    B, P, N = args.batch, args.prompt_len, args.new_tokens
    device_type = engine.device.type
    weight_bytes, kv_per_token, kv_step = decode_step_bytes(engine, R, P, N)
    peak_mem = peak_memory_gb(device_type)
    name = device_name(device_type)
    bw, bw_source = bandwidth(device_type, name)
    mbu = (weight_bytes + kv_step) / (ms_step / 1e3) / bw if bw and N > 1 else None
    weights = str(engine.model.lm_head.weight.dtype).removeprefix("torch.")
    params = engine.source.num_params()  # the model the engine was built from
    print(
        f"decode | {name} | depth {args.depth} ({params / 1e6:.1f}M params, engine copy in {weights}) | "
        f"batch {B} | requests {R} | prompt {P} | new {N} | heads {cfg.n_head}, kv heads {cfg.n_kv_head} | "
        f"cuda graph {'on' if engine.use_cuda_graph else 'off'}"
    )
    print(f"time to first token: {ttft * 1e3:.1f} ms (prefill of all {R} prompts + first token)")
    mbu_text = f"MBU {mbu:.1%}" if mbu is not None else "MBU n/a"
    print(
        f"decode: {ms_step:.2f} ms/step, {R / ms_step * 1e3:.0f} tok/s, {mbu_text}; end to end {ntok / total:.0f} tok/s"
    )
    print(f"weight refresh (engine.load_weights): {refresh_ms:.2f} ms")
    print(
        f"per step: weights {weight_bytes / 1e6:.1f} MB + KV {kv_step / 1e6:.1f} MB "
        f"({kv_per_token / 1e3:.2f} KB of KV per token); peak memory {peak_mem:.2f} GB"
    )
    bw_text = f"{bw / 1e9:.1f} GB/s, {bw_source}" if bw else bw_source
    print(f"MBU: {mbu:.1%} of {bw_text}" if mbu is not None else f"MBU: n/a ({bw_text})")
    result = dict(bench="decode", device=name, depth=args.depth, batch=B, requests=R, prompt_len=P, new_tokens=N)
    result.update(n_head=cfg.n_head, n_kv_head=cfg.n_kv_head, cuda_graph=engine.use_cuda_graph)
    result.update(ttft_ms=round(ttft * 1e3, 2), ms_per_step=round(ms_step, 3))
    result.update(decode_tok_per_s=round(R / ms_step * 1e3, 1), engine_weights=weights)
    result.update(weight_refresh_ms=round(refresh_ms, 3), tok_per_s=round(ntok / total, 1), weight_bytes=weight_bytes)
    result.update(kv_bytes_per_token=kv_per_token, kv_bytes_per_step=int(kv_step), peak_mem_gb=round(peak_mem, 3))
    result.update(
        mbu=None if mbu is None else round(mbu, 4), bandwidth_bytes_per_s=bw and round(bw), bandwidth_source=bw_source
    )
    print(json.dumps(result))


def bench_rl(args):
    """One GRPO step of chat_rl's shape on a random-init model: rollout (the engine, every response forced to the
    full --new-tokens, the worst case of a GSM8K rollout), rewards, then chat_rl's own training step
    (nanorl.rl_trainer.Trainer: advantages, the loss over micro-batches, one optimizer step), with chat_rl's
    defaults for every training flag. Time split rollout / train, tok/s of each, peak memory."""
    from nanorl.engine import Engine
    from nanorl.gpt import build_model, config_from_depth
    from nanorl.optim import build_optimizer

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
    cfg = config_from_depth(
        args.depth, args.vocab_size, sequence_len=P + N, head_dim=args.head_dim, n_kv_head=args.n_kv_head
    )
    # like chat_rl: fp32 master weights, bf16 autocast on CUDA for both the engine and the trainer
    model = build_model(cfg, device)
    if args.lora_rank:  # like chat_rl --lora-rank: a frozen base (bf16 on CUDA), AdamW on the adapters, one model
        lora.apply_lora(model, lora.LoraConfig(args.lora_rank, 2.0 * args.lora_rank))
        optimizer = lora.build_lora_optimizer(model, args.lora_lr)
    else:
        optimizer = build_optimizer(model, lr_scale=args.lr_scale)
    engine = Engine(
        model,
        byte_tokenizer(),
        batch_size=args.engine_batch_size or n_prompts * n,
        max_len=P + N,
        share_weights=bool(args.lora_rank),  # LoRA: the engine samples through the trainer's model, nothing to sync
    )
    prompts = torch.randint(0, 256, (n_prompts, P), generator=torch.Generator().manual_seed(1)).tolist()
    rl_step = grpo_stepper(model, optimizer, engine, prompts, n, N, args.max_tokens_per_gpu, device)

    rl_step(0)  # warm up: kernels, allocator, the optimizer's state
    reset_peak_memory(device_type)
    runs = [rl_step(k + 1) for k in range(args.steps)]
    t_roll = sum(r[0] for r in runs) / len(runs)
    t_train = sum(r[1] for r in runs) / len(runs)
    gen_tok, train_tok, reward = runs[-1][2], runs[-1][3], sum(r[4] for r in runs) / len(runs)
    peak_mem = peak_memory_gb(device_type)
    name = device_name(device_type)

    params = sum(p.numel() for k, p in model.named_parameters() if ".lora_" not in k)  # the base's
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    lora_note = f" | LoRA rank {args.lora_rank} ({trainable / 1e6:.2f}M trained)" if args.lora_rank else ""
    print(
        f"rl | {name} | depth {args.depth} ({params / 1e6:.1f}M params){lora_note} | {n_prompts} prompts x {n} "
        f"samples | prompt {P} | new {N} (forced) | engine batch {engine.batch_size} | "
        f"cuda graph {'on' if engine.use_cuda_graph else 'off'} | mean of {len(runs)} step(s) after a warm-up"
    )
    print(f"{'phase':<8} {'seconds':>9} {'share':>7} {'tok/s':>10}")
    print(f"{'rollout':<8} {t_roll:>9.3f} {t_roll / (t_roll + t_train):>7.1%} {gen_tok / t_roll:>10,.0f}")
    print(f"{'train':<8} {t_train:>9.3f} {t_train / (t_roll + t_train):>7.1%} {train_tok / t_train:>10,.0f}")
    print(f"{'total':<8} {t_roll + t_train:>9.3f} {1:>7.0%}")
    print(
        f"generated {gen_tok:,} tokens, trained on {train_tok:,} (prompt + response); mean reward {reward:.3f}; "
        f"peak memory {peak_mem:.2f} GB"
    )
    result = dict(bench="rl", device=name, depth=args.depth, params=params, prompts=n_prompts, samples=n)
    result.update(lora_rank=args.lora_rank, trainable_params=trainable)
    result.update(prompt_len=P, new_tokens=N, steps=len(runs), rollout_s=round(t_roll, 6))
    result.update(train_s=round(t_train, 6), total_s=round(t_roll + t_train, 6))
    result.update(rollout_tok_per_s=round(gen_tok / t_roll, 1), train_tok_per_s=round(train_tok / t_train, 1))
    result.update(generated_tokens=gen_tok, trained_tokens=train_tok, reward_mean=round(reward, 4))
    result.update(grad_norm=round(runs[-1][5], 6), peak_mem_gb=round(peak_mem, 3))
    print(json.dumps(result))


def bench_serve(args):
    """Load-test a running chat_web server (python -m scripts.chat_web ...): tok/s and time to first token."""
    url = args.url.rstrip("/")
    r = load_test(url, args.clients, args.max_tokens)
    print(
        f"{args.clients} clients x max_tokens={args.max_tokens}: {r['tokens']} tokens in {r['wall']:.2f}s = "
        f"{r['tokens'] / r['wall']:.1f} tok/s aggregate, TTFT p50 {r['ttft_p50'] * 1000:.0f} ms, "
        f"p95 {r['ttft_p95'] * 1000:.0f} ms, {len(r['errors'])} errors"
    )
    for e in r["errors"][:3]:
        print(f"  error: {e}")
    result = dict(bench="serve", url=url, clients=args.clients, max_tokens=args.max_tokens, tokens=r["tokens"])
    result.update(wall_s=round(r["wall"], 6), tok_per_s=round(r["tokens"] / r["wall"], 2))
    result.update(ttft_p50_s=round(r["ttft_p50"], 6), ttft_p95_s=round(r["ttft_p95"], 6), errors=len(r["errors"]))
    print(json.dumps(result))


def model_and_device_args(p):
    """The flags every benchmark shares: the random-init model's shape (besides --depth) and where it runs."""
    p.add_argument("--n-kv-head", type=positive_int, default=None, help="KV heads (default: as many as query heads)")
    p.add_argument("--head-dim", type=positive_int, default=128, help="attention head width")
    p.add_argument("--vocab-size", type=positive_int, default=32768, help="vocabulary size of the random model")
    p.add_argument("--device-type", type=str, default=None, help="cuda|cpu|mps (default: autodetect)")
    p.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="CPU threads (default: torch's choice; 1 is steadier on a busy machine)",
    )


def add_decode(sub):
    p = sub.add_parser("decode", help="sampling engine: TTFT, ms/step, tok/s, peak memory, MBU")
    p.add_argument("--depth", type=positive_int, default=20, help="model depth (width = depth x 64)")
    p.add_argument("--batch", type=positive_int, default=64, help="engine batch slots")
    p.add_argument(
        "--requests",
        type=positive_int,
        default=None,
        help="requests in flight, one sample each (default: --batch, all slots busy)",
    )
    p.add_argument("--prompt-len", type=positive_int, default=128, help="prompt tokens per request")
    p.add_argument("--new-tokens", type=positive_int, default=256, help="tokens generated per sample")
    p.add_argument("--no-cuda-graph", action="store_true", help="decode eagerly on CUDA")
    model_and_device_args(p)
    p.set_defaults(func=bench_decode)


def add_train(sub):
    p = sub.add_parser("train", help="base_train's step on random tokens: tok/s, MFU, peak memory")
    p.add_argument("--depth", type=positive_int, default=20, help="model depth (width = depth x 64)")
    p.add_argument("--batch", type=positive_int, default=32, help="rows per step (one micro-batch)")
    p.add_argument("--seq-len", type=positive_int, default=2048, help="tokens per row")
    p.add_argument("--warmup", type=nonneg_int, default=5, help="untimed steps first (torch.compile, allocator)")
    p.add_argument("--steps", type=positive_int, default=10, help="timed steps")
    p.add_argument("--grad-clip", type=nonneg_float, default=1.0, help="as base_train; 0 = off")
    p.add_argument("--no-compile", action="store_true", help="run eagerly on CUDA")
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="as base_train --fsdp (FSDP2 over one rank: the wrapping's cost), plus the sampler weight-gather time",
    )
    model_and_device_args(p)
    p.set_defaults(func=bench_train)


def add_rl(sub):
    p = sub.add_parser(
        "rl", help="one GRPO step (rollout + train) of chat_rl's GSM8K shape: time split, tok/s, peak memory"
    )
    p.add_argument("--depth", type=positive_int, default=20, help="model depth (width = depth x 64)")
    p.add_argument("--prompts", type=positive_int, default=16, help="prompts per rollout")
    p.add_argument("--samples", type=positive_int, default=16, help="samples per prompt (the group)")
    p.add_argument("--prompt-len", type=positive_int, default=150, help="prompt tokens (GSM8K questions are ~150)")
    p.add_argument(
        "--new-tokens", type=positive_int, default=256, help="response tokens, all generated (no stop tokens)"
    )
    p.add_argument(
        "--steps", type=positive_int, default=1, help="timed steps after the warm-up step (their mean is reported)"
    )
    p.add_argument(
        "--engine-batch-size",
        type=positive_int,
        default=None,
        help="engine rows (default: prompts x samples, all at once)",
    )
    p.add_argument(
        "--max-tokens-per-gpu",
        type=positive_int,
        default=8192,
        help="tokens per packed training micro-batch (chat_rl's flag)",
    )
    p.add_argument(
        "--lr-scale", type=positive_float, default=0.05, help="multiplier on the optimizer LRs (chat_rl's default)"
    )
    p.add_argument("--lora-rank", type=int, default=0, help="train rank-R adapters (alpha 2R) on a frozen base")
    p.add_argument("--lora-lr", type=positive_float, default=lora.DEFAULT_LR, help="the adapters' AdamW LR")
    model_and_device_args(p)
    p.set_defaults(func=bench_rl)


def add_hf(sub):
    p = sub.add_parser(
        "hf",
        help="a Hugging Face model's shape on random weights: --hf-model load, nanorl vs transformers decode, a GRPO step",
    )
    p.add_argument(
        "--arch", choices=["qwen2", "llama"], default="qwen2", help="transformers architecture (qwen2: Qwen2.5's)"
    )
    p.add_argument(
        "--size", choices=sorted(HF_SIZES), default="0.5b", help="0.5b / 7b: Qwen2.5's shapes; tiny: a CPU-sized one"
    )
    p.add_argument(
        "--lora-rank",
        type=nonneg_int,
        default=0,
        help="RL with rank-R LoRA adapters on a frozen base (0: full weights)",
    )
    p.add_argument("--batches", type=positive_int, nargs="+", default=[1, 64, 256], help="decode batch sizes")
    p.add_argument("--prompt-len", type=positive_int, default=128, help="prompt tokens per request")
    p.add_argument(
        "--new-tokens", type=positive_int, default=128, help="greedy tokens per row, all generated (no stop tokens)"
    )
    p.add_argument("--rl-prompts", type=positive_int, default=8, help="GRPO step: prompts")
    p.add_argument("--rl-samples", type=positive_int, default=8, help="GRPO step: samples per prompt")
    p.add_argument("--rl-prompt-len", type=positive_int, default=150, help="prompt tokens of the GRPO step")
    p.add_argument("--rl-new-tokens", type=positive_int, default=256, help="response tokens of the GRPO step (forced)")
    p.add_argument(
        "--max-tokens-per-gpu",
        type=positive_int,
        default=8192,
        help="tokens per packed training micro-batch (chat_rl's flag)",
    )
    p.add_argument("--device-type", type=str, default=None, help="cuda|cpu|mps (default: autodetect)")
    p.add_argument("--threads", type=positive_int, default=None, help="CPU threads")
    p.set_defaults(func=bench_hf)


def add_serve(sub):
    p = sub.add_parser("serve", help="load-test a running chat_web server: aggregate tok/s, time to first token")
    p.add_argument("url", type=str, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--clients", type=positive_int, default=64, help="concurrent streaming clients, one request each")
    p.add_argument("--max-tokens", type=positive_int, default=128, help="max_tokens of each request")
    p.set_defaults(func=bench_serve)


def main():
    parser = ArgumentParser(description="nanorl benchmarks")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (add_decode, add_train, add_rl, add_hf, add_serve):
        add(sub)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
