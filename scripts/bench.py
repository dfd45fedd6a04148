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
    python -m scripts.bench hf --arch qwen2 --size 0.5b --batches 1 64 256  # Qwen2.5-0.5B's shape, random weights
    python -m scripts.bench hf --size 7b --batches 1 64 --lora-rank 16  # Qwen2.5-7B's shape, RL with LoRA on one GPU
    python -m scripts.bench hf --size tiny --batches 1 2 --prompt-len 8 --new-tokens 8 --rl-prompt-len 8 --rl-new-tokens 8  # CPU
    python -m scripts.bench serve http://127.0.0.1:8000 --clients 64 --max-tokens 128  # a running chat_web server
"""
import json
import os
import resource
import threading
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
    if args.fsdp:
        from nanorl.common import compute_init
        from nanorl.fsdp import gather_full_state, shard_model
        if "RANK" not in os.environ:  # not under torchrun: a one-process group of its own (FSDP2 needs one)
            import socket
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if os.environ["WORLD_SIZE"] != "1":
            raise SystemExit("bench train --fsdp measures the wrapping's cost on one device: run it as one process")
        _, _, _, _, device = compute_init(device_type)
    torch.manual_seed(0)
    cfg = config_from_depth(args.depth, args.vocab_size, sequence_len=T, head_dim=args.head_dim, n_kv_head=args.n_kv_head)
    model = build_model(cfg, device)
    if args.fsdp:  # as base_train --fsdp: sharded (over one rank here), then the same optimizer and compile
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
          f"compiled {'yes' if compile_it else 'no'} | fsdp {'yes (1 rank)' if args.fsdp else 'no'} | {'bf16 autocast' if device_type == 'cuda' else 'fp32'} | "
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
    gather_ms = None
    if args.fsdp:  # RL's sampler refresh under FSDP: the full weights gathered into an unsharded copy (bf16 on CUDA)
        sampler = build_model(cfg, device).to(torch.bfloat16 if device_type == "cuda" else torch.float32)
        gathers = [gather_full_state(model, sampler) for _ in range(6)][1:]  # the first call warms up
        gather_ms = sorted(gathers)[2] * 1e3  # the median
        del sampler
        print(f"sampler weight gather (nanorl.fsdp.gather_full_state): {gather_ms:.2f} ms (median of 5)")
    print(f"mean {sum(times) / len(times) * 1e3:.2f} ms/step, {tok_s:,.0f} tok/s, {flops_per_token:.3e} FLOPs/token, "
          f"peak memory {peak_mem:.2f} GB; " + (f"MFU {mfu:.1%}" if mfu is not None else "MFU: n/a (no peak FLOP/s known for this device)"))
    print(json.dumps({"bench": "train", "device": name, "depth": args.depth, "params": model.num_params(), "batch": B, "seq_len": T,
                      "n_head": cfg.n_head, "n_kv_head": cfg.n_kv_head, "compiled": compile_it, "fsdp": args.fsdp, "warmup": args.warmup,
                      "steps": args.steps, "ms_per_step": round(sum(times) / len(times) * 1e3, 3), "tok_per_s": round(tok_s, 1),
                      "flops_per_token": flops_per_token, "mfu": None if mfu is None else round(mfu, 4),
                      "peak_mem_gb": round(peak_mem, 3), "loss_first": round(losses[0], 4), "loss_last": round(losses[-1], 4),
                      "gather_ms": None if gather_ms is None else round(gather_ms, 3)}))
    if args.fsdp:
        from nanorl.common import compute_cleanup
        compute_cleanup()


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


def grpo_stepper(model, optimizer, engine, prompts, n, N, max_tokens_per_gpu, device):
    """chat_rl's GRPO step as a function of the step number: rollout (n samples of each prompt, every response forced
    to N tokens), a reward, nanorl.rl_trainer.Trainer's training step with chat_rl's defaults for every training flag,
    and the engine's weights refreshed. Each call returns (rollout seconds, train seconds, generated tokens, trained
    tokens, mean reward, grad norm)."""
    from nanorl.common import Timer
    from nanorl.engine import Request
    from nanorl.rl_trainer import Trainer, TrainerConfig
    from nanorl.samples import Sample

    device_type = device.type
    cfg = TrainerConfig(n_samples_per_prompt=n, max_response_len=N, max_tokens_per_gpu=max_tokens_per_gpu)
    trainer = Trainer(cfg, model, optimizer, device)

    def rl_step(step):
        model.eval()
        synchronize(device_type)
        t0 = time.perf_counter()
        # stop_tokens=[]: a random model rarely ends a response, so every response runs to the budget
        reqs = [Request(p, num_samples=n, max_tokens=N, temperature=1.0, seed=step * len(prompts) + i, stop_tokens=[],
                        use_tools=False) for i, p in enumerate(prompts)]
        samples = [Sample(tokens=list(p) + list(c.tokens), response_length=len(c.tokens), loss_mask=list(c.mask),
                          rollout_log_probs=list(c.logprobs), status=c.status, group_index=gi, index=si, weight_version=step,
                          temperature=1.0)
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

    return rl_step


def bench_rl(args):
    """One GRPO step of chat_rl's shape on a random-init model: rollout (the engine, every response forced to the
    full --new-tokens, the worst case of a GSM8K rollout), rewards, then chat_rl's own training step
    (nanorl.rl_trainer.Trainer: advantages, the loss over micro-batches, one optimizer step), with chat_rl's
    defaults for every training flag. Time split rollout / train, tok/s of each, peak memory."""
    from nanorl.engine import Engine
    from nanorl.gpt import build_model, config_from_depth
    from nanorl.optim import build_optimizer
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
    optimizer = build_optimizer(model, lr_scale=args.lr_scale)
    tok = Tokenizer.from_ranks({bytes([i]): i for i in range(256)}, SPLIT_PATTERN)  # the engine needs only its specials
    engine = Engine(model, tok, batch_size=args.engine_batch_size or n_prompts * n, max_len=P + N)
    prompts = torch.randint(0, 256, (n_prompts, P), generator=torch.Generator().manual_seed(1)).tolist()
    rl_step = grpo_stepper(model, optimizer, engine, prompts, n, N, args.max_tokens_per_gpu, device)

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


# Qwen2.5-0.5B's shape (its config.json); --size tiny is a CPU-sized model of the same architecture
HF_SIZES = {"0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=151936),
            "7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       intermediate_size=18944, vocab_size=152064),
            "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=96, vocab_size=512)}


def save_random_hf(directory, arch, size, context, device, dtype):
    """A random-weight HF model of Qwen2.5's (or Llama's) shape written with save_pretrained, plus a small
    byte-level BPE (the `tokenizers` package) whose few hundred tokens sit in the model's full vocabulary, as
    Qwen's tokenizer leaves spare embedding rows. Nothing is downloaded."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    torch.manual_seed(0)
    shape = dict(HF_SIZES[size], max_position_embeddings=max(context, 32768 if size != "tiny" else context))
    if arch == "qwen2":
        cfg, cls = transformers.Qwen2Config(**shape, tie_word_embeddings=size != "7b", rope_theta=1000000.0, rms_norm_eps=1e-6), transformers.Qwen2ForCausalLM
    else:
        cfg, cls = transformers.LlamaConfig(**shape, tie_word_embeddings=False, rms_norm_eps=1e-5), transformers.LlamaForCausalLM
    if size == "tiny":
        cfg.initializer_range = 0.3  # far from uniform next-token distributions: greedy tokens vary and ties are rare
    with torch.device(device):
        model = cls(cfg).to(dtype)
    model.save_pretrained(directory)
    del model
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    text = ["What is 12 plus 30? The answer is 42.", "Natalia sold clips to 48 of her friends in April."] * 10
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(os.path.join(directory, "tokenizer.json"))
    template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template, "eos_token": "<|im_end|>",
                   "pad_token": "<|endoftext|>", "bos_token": None}, f)
    return tok.get_vocab_size()


def bench_hf(args):
    """A Hugging Face model through nanorl, on random weights of a real model's shape: the --hf-model load (seconds,
    peak memory), greedy decode through nanorl's Engine vs transformers' generate on the same prompts at each
    --batches size (tok/s of each, and whether they pick the same tokens), and one GRPO step of chat_rl's trainer."""
    import tempfile

    import transformers

    from nanorl.checkpoint import load_hf
    transformers.utils.logging.disable_progress_bar()  # the log's last line stays the JSON
    from nanorl.engine import Engine, Request
    from nanorl.optim import build_optimizer

    device_type = args.device_type or autodetect_device_type()
    device = torch.device(device_type)
    P, N, batches = args.prompt_len, args.new_tokens, args.batches
    if args.rl_samples < 2:
        raise SystemExit(f"--rl-samples must be >= 2 (GRPO normalises by the group's std), got {args.rl_samples}")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if device_type == "cuda" else torch.float32  # what the Hub's checkpoints hold / CPU math
    name = torch.cuda.get_device_name() if device_type == "cuda" else device_type
    context = max(P + N, args.rl_prompt_len + args.rl_new_tokens)
    with tempfile.TemporaryDirectory() as directory:
        t0 = time.perf_counter()
        tok_vocab = save_random_hf(directory, args.arch, args.size, context, device, dtype)
        save_s = time.perf_counter() - t0
        disk = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
        if device_type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        synchronize(device_type)
        t0 = time.perf_counter()
        model, tokenizer, _ = load_hf(directory, device, phase="train")  # chat_rl --hf-model: fp32 master weights
        synchronize(device_type)
        load_s = time.perf_counter() - t0
        if args.lora_rank:  # chat_rl --lora-rank: the base frozen (bf16 on CUDA), adapters trained, the engines share it
            from nanorl.lora import LoraConfig, apply_lora, build_lora_optimizer
            apply_lora(model, LoraConfig(args.lora_rank, 2.0 * args.lora_rank))
        load_mem = peak_memory_gb(device_type)
        hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to(device).eval()
    hf.generation_config.eos_token_id = None  # as the engine's stop_tokens=[]: every row runs N tokens
    hf.generation_config.pad_token_id = 0
    params = sum(p.numel() for k, p in model.named_parameters() if ".lora_" not in k)  # the base's
    print(f"hf | {name} | {args.arch} {args.size} random weights ({params / 1e6:.1f}M params, {model.config.n_layer} layers, "
          f"width {model.config.n_embd}, {model.config.n_head} heads / {model.config.n_kv_head} kv, vocab {model.config.vocab_size:,}) | "
          f"saved {disk / 1e9:.2f} GB in {save_s:.1f}s | --hf-model load {load_s:.2f}s, peak memory {load_mem:.2f} GB")

    g = torch.Generator().manual_seed(1)
    print(f"greedy decode, prompt {P}, {N} new tokens, end to end (prefill included)")
    print(f"{'batch':>6} | {'nanorl tok/s':>12} | {'hf tok/s':>10} | {'speed-up':>8} | {'same tokens':>11} | {'rows equal':>10}")
    decode = []
    for B in batches:
        prompts = torch.randint(0, tok_vocab, (B, P), generator=g)
        engine = Engine(model, tokenizer, batch_size=B, max_len=P + N,  # the engine chat_rl samples with (bf16 on CUDA)
                        share_weights=bool(args.lora_rank))

        def run_engine(n_new):
            reqs = [Request(p, max_tokens=n_new, temperature=0.0, stop_tokens=[], use_tools=False) for p in prompts.tolist()]
            return [c[0].tokens for c in engine.generate(reqs)]

        def run_hf(n_new):
            with torch.no_grad():
                x = prompts.to(device)
                out = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False)
            return out[:, P:].tolist()

        row = {"batch": B}
        for who, fn in (("nanorl", run_engine), ("hf", run_hf)):
            fn(2)  # warm up: kernels, allocator
            synchronize(device_type)
            t0 = time.perf_counter()
            row[who + "_tokens"] = fn(N)
            synchronize(device_type)
            row[who + "_tok_per_s"] = round(B * N / (time.perf_counter() - t0), 1)
        a, b = row.pop("nanorl_tokens"), row.pop("hf_tokens")
        # greedy paths fork at the first near-tie and never rejoin: count the tokens before each row's first difference
        same = sum(next((i for i, (x, y) in enumerate(zip(r, s)) if x != y), N) for r, s in zip(a, b)) / (B * N)
        row.update(speedup=round(row["nanorl_tok_per_s"] / row["hf_tok_per_s"], 3), same_token_frac=round(same, 4),
                   rows_equal=sum(r == s for r, s in zip(a, b)), distinct_tokens=len({t for r in a for t in r}))
        decode.append(row)
        print(f"{B:>6} | {row['nanorl_tok_per_s']:>12,.0f} | {row['hf_tok_per_s']:>10,.0f} | {row['speedup']:>7.2f}x | "
              f"{same:>11.1%} | {row['rows_equal']:>4}/{B:<5}")
        del engine
    hf = None  # its memory back before training
    if device_type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

    # one GRPO step of chat_rl's trainer on the loaded model (after an untimed warm-up step)
    n_prompts, n, RP, RN = args.rl_prompts, args.rl_samples, args.rl_prompt_len, args.rl_new_tokens
    if args.lora_rank:  # adapters only (the engine then samples through the trainer's model: nothing to sync)
        optimizer = build_lora_optimizer(model, 1e-3)
    else:
        optimizer = build_optimizer(model, lr_scale=0.05)  # chat_rl's default --lr-scale
    engine = Engine(model, tokenizer, batch_size=n_prompts * n, max_len=RP + RN, share_weights=bool(args.lora_rank))
    rl_prompts = torch.randint(0, tok_vocab, (n_prompts, RP), generator=g).tolist()
    rl_step = grpo_stepper(model, optimizer, engine, rl_prompts, n, RN, args.max_tokens_per_gpu, device)
    rl_step(0)
    t_roll, t_train, gen_tok, train_tok, reward, grad_norm = rl_step(1)
    rl_mem = peak_memory_gb(device_type)
    print(f"GRPO step ({n_prompts} prompts x {n} samples, prompt {RP}, {RN} new tokens forced): rollout {t_roll:.2f}s "
          f"({gen_tok / t_roll:,.0f} tok/s) + train {t_train:.2f}s ({train_tok / t_train:,.0f} tok/s) = {t_roll + t_train:.2f}s; "
          f"peak memory {rl_mem:.2f} GB")
    print(json.dumps({"bench": "hf", "device": name, "arch": args.arch, "size": args.size, "params": params,
                      "lora_rank": args.lora_rank,
                      "vocab_size": model.config.vocab_size, "tokenizer_vocab": tok_vocab, "save_s": round(save_s, 3),
                      "load_s": round(load_s, 3), "load_peak_mem_gb": round(load_mem, 3), "prompt_len": P, "new_tokens": N,
                      "decode": decode, "rl_prompts": n_prompts, "rl_samples": n, "rl_rollout_s": round(t_roll, 6),
                      "rl_train_s": round(t_train, 6), "rl_total_s": round(t_roll + t_train, 6), "rl_generated_tokens": gen_tok,
                      "rl_trained_tokens": train_tok, "rl_reward_mean": round(reward, 4), "rl_grad_norm": round(grad_norm, 6),
                      "peak_mem_gb": round(max(load_mem, rl_mem) if device_type == "cuda" else rl_mem, 3)}))


def load_test(url, clients, max_tokens, prompt="Tell me a story about a robot."):
    """Hit a running chat_web server with `clients` concurrent streaming requests (one each) and measure aggregate
    tokens/s (from /stats: the tokens the engine generated, not text chunks) and time to first token p50/p95."""
    import httpx  # a dev dependency: only this benchmark needs it

    ttft, errors = [], []
    before = httpx.get(url + "/stats").json()["tokens_generated"]
    barrier = threading.Barrier(clients)
    # one shared client, made up front: a new httpx client per request builds an SSL context (~tens of ms of
    # CPU each), which would be counted as time to first token
    http = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=clients, max_keepalive_connections=clients))

    def client(i):
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stream": True, "seed": i}
        barrier.wait()  # all start together, as a burst of users would
        t0 = time.perf_counter()
        try:
            with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
                first = None
                for line in r.iter_lines():
                    text = line.startswith("data: {") and '"content": "' in line and '"content": ""' not in line
                    if first is None and text:
                        first = time.perf_counter() - t0
                ttft.append(first if first is not None else time.perf_counter() - t0)
        except Exception as e:
            errors.append(repr(e))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    http.close()
    tokens = httpx.get(url + "/stats").json()["tokens_generated"] - before
    ttft.sort()
    pct = lambda q: ttft[min(len(ttft) - 1, int(q * len(ttft)))] if ttft else float("nan")  # noqa: E731
    return dict(tokens=tokens, wall=wall, ttft_p50=pct(0.5), ttft_p95=pct(0.95), errors=errors)


def bench_serve(args):
    """Load-test a running chat_web server (python -m scripts.chat_web ...): tok/s and time to first token."""
    url = args.url.rstrip("/")
    r = load_test(url, args.clients, args.max_tokens)
    print(f"{args.clients} clients x max_tokens={args.max_tokens}: {r['tokens']} tokens in {r['wall']:.2f}s = "
          f"{r['tokens'] / r['wall']:.1f} tok/s aggregate, TTFT p50 {r['ttft_p50'] * 1000:.0f} ms, "
          f"p95 {r['ttft_p95'] * 1000:.0f} ms, {len(r['errors'])} errors")
    for e in r["errors"][:3]:
        print(f"  error: {e}")
    print(json.dumps({"bench": "serve", "url": url, "clients": args.clients, "max_tokens": args.max_tokens,
                      "tokens": r["tokens"], "wall_s": round(r["wall"], 6),
                      "tok_per_s": round(r["tokens"] / r["wall"], 2),
                      "ttft_p50_s": round(r["ttft_p50"], 6), "ttft_p95_s": round(r["ttft_p95"], 6),
                      "errors": len(r["errors"])}))


def model_and_device_args(p):
    """The flags every benchmark shares: the random-init model's shape (besides --depth) and where it runs."""
    p.add_argument("--n-kv-head", type=positive_int, default=None, help="KV heads (default: as many as query heads)")
    p.add_argument("--head-dim", type=positive_int, default=128, help="attention head width")
    p.add_argument("--vocab-size", type=positive_int, default=32768, help="vocabulary size of the random model")
    p.add_argument("--device-type", type=str, default=None, help="cuda|cpu|mps (default: autodetect)")
    p.add_argument("--threads", type=positive_int, default=None, help="CPU threads (default: torch's choice; 1 is steadier on a busy machine)")


def main():
    parser = ArgumentParser(description="nanorl benchmarks")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("decode", help="sampling engine: TTFT, ms/step, tok/s, peak memory, MBU")
    p.add_argument("--depth", type=positive_int, default=20, help="model depth (width = depth x 64)")
    p.add_argument("--batch", type=positive_int, default=64, help="engine batch slots")
    p.add_argument("--requests", type=positive_int, default=None, help="requests in flight, one sample each (default: --batch, all slots busy)")
    p.add_argument("--prompt-len", type=positive_int, default=128, help="prompt tokens per request")
    p.add_argument("--new-tokens", type=positive_int, default=256, help="tokens generated per sample")
    p.add_argument("--no-cuda-graph", action="store_true", help="decode eagerly on CUDA")
    model_and_device_args(p)
    p.set_defaults(func=bench_decode)
    p = sub.add_parser("train", help="base_train's step on random tokens: tok/s, MFU, peak memory")
    p.add_argument("--depth", type=positive_int, default=20, help="model depth (width = depth x 64)")
    p.add_argument("--batch", type=positive_int, default=32, help="rows per step (one micro-batch)")
    p.add_argument("--seq-len", type=positive_int, default=2048, help="tokens per row")
    p.add_argument("--warmup", type=nonneg_int, default=5, help="untimed steps first (torch.compile, allocator)")
    p.add_argument("--steps", type=positive_int, default=10, help="timed steps")
    p.add_argument("--grad-clip", type=nonneg_float, default=1.0, help="as base_train; 0 = off")
    p.add_argument("--no-compile", action="store_true", help="run eagerly on CUDA")
    p.add_argument("--fsdp", action="store_true", help="as base_train --fsdp (FSDP2 over one rank: the wrapping's cost), plus the sampler weight-gather time")
    model_and_device_args(p)
    p.set_defaults(func=bench_train)
    p = sub.add_parser("rl", help="one GRPO step (rollout + train) of chat_rl's GSM8K shape: time split, tok/s, peak memory")
    p.add_argument("--depth", type=positive_int, default=20, help="model depth (width = depth x 64)")
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
    p = sub.add_parser("hf", help="a Hugging Face model's shape on random weights: --hf-model load, nanorl vs transformers decode, a GRPO step")
    p.add_argument("--arch", choices=["qwen2", "llama"], default="qwen2", help="transformers architecture (qwen2: Qwen2.5's)")
    p.add_argument("--size", choices=sorted(HF_SIZES), default="0.5b", help="0.5b / 7b: Qwen2.5's shapes; tiny: a CPU-sized one")
    p.add_argument("--lora-rank", type=nonneg_int, default=0, help="RL with rank-R LoRA adapters on a frozen base (0: full weights)")
    p.add_argument("--batches", type=positive_int, nargs="+", default=[1, 64, 256], help="decode batch sizes")
    p.add_argument("--prompt-len", type=positive_int, default=128, help="prompt tokens per request")
    p.add_argument("--new-tokens", type=positive_int, default=128, help="greedy tokens per row, all generated (no stop tokens)")
    p.add_argument("--rl-prompts", type=positive_int, default=8, help="GRPO step: prompts")
    p.add_argument("--rl-samples", type=positive_int, default=8, help="GRPO step: samples per prompt")
    p.add_argument("--rl-prompt-len", type=positive_int, default=150, help="prompt tokens of the GRPO step")
    p.add_argument("--rl-new-tokens", type=positive_int, default=256, help="response tokens of the GRPO step (forced)")
    p.add_argument("--max-tokens-per-gpu", type=positive_int, default=8192, help="tokens per packed training micro-batch (chat_rl's flag)")
    p.add_argument("--device-type", type=str, default=None, help="cuda|cpu|mps (default: autodetect)")
    p.add_argument("--threads", type=positive_int, default=None, help="CPU threads")
    p.set_defaults(func=bench_hf)
    p = sub.add_parser("serve", help="load-test a running chat_web server: aggregate tok/s, time to first token")
    p.add_argument("url", type=str, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--clients", type=positive_int, default=64, help="concurrent streaming clients, one request each")
    p.add_argument("--max-tokens", type=positive_int, default=128, help="max_tokens of each request")
    p.set_defaults(func=bench_serve)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
