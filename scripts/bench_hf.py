"""
`python -m scripts.bench hf`: a Hugging Face model's shape through nanorl on random weights (nothing is downloaded).
The --hf-model load, greedy decode through nanorl's Engine vs transformers' generate, and one GRPO step.
"""

import json
import os
import tempfile

import torch

from nanorl.benchmark import device_name, grpo_stepper, peak_memory_gb, reset_peak_memory, timed
from nanorl.common import autodetect_device_type

# Qwen2.5-0.5B's shape (its config.json); --size tiny is a CPU-sized model of the same architecture
HF_SIZES = {
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936),
    "7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
               intermediate_size=18944, vocab_size=152064),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=96, vocab_size=512),
}  # fmt: skip


def save_random_hf(directory, arch, size, context, device, dtype):
    """A random-weight HF model of Qwen2.5's (or Llama's) shape written with save_pretrained, plus a small
    byte-level BPE (the `tokenizers` package) whose few hundred tokens sit in the model's full vocabulary, as
    Qwen's tokenizer leaves spare embedding rows. Nothing is downloaded."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    torch.manual_seed(0)
    shape = dict(HF_SIZES[size], max_position_embeddings=max(context, 32768 if size != "tiny" else context))
    if arch == "qwen2":
        cfg = transformers.Qwen2Config(**shape, tie_word_embeddings=size != "7b", rope_theta=1e6, rms_norm_eps=1e-6)
        cls = transformers.Qwen2ForCausalLM
    else:
        cfg = transformers.LlamaConfig(**shape, tie_word_embeddings=False, rms_norm_eps=1e-5)
        cls = transformers.LlamaForCausalLM
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
    bpe = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(text, bpe)
    tok.save(os.path.join(directory, "tokenizer.json"))
    template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": template,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
    }
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return tok.get_vocab_size()


def load_both(args, device, dtype, context):
    """Save a random model, then load it as chat_rl --hf-model does (timed, peak memory) and through transformers.
    -> (model, tokenizer, hf, info) with info the save/load numbers."""
    import transformers

    from nanorl.model_loading import load_hf

    device_type = device.type
    with tempfile.TemporaryDirectory() as directory:
        save_s, tok_vocab = timed(device_type, save_random_hf, directory, args.arch, args.size, context, device, dtype)
        disk = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
        if device_type == "cuda":
            torch.cuda.empty_cache()
        reset_peak_memory(device_type)
        # chat_rl --hf-model: fp32 master weights
        load_s, (model, tokenizer, _) = timed(device_type, load_hf, directory, device, "train")
        if (
            args.lora_rank
        ):  # chat_rl --lora-rank: the base frozen (bf16 on CUDA), adapters trained, the engines share it
            from nanorl.lora import LoraConfig, apply_lora

            apply_lora(model, LoraConfig(args.lora_rank, 2.0 * args.lora_rank))
        load_mem = peak_memory_gb(device_type)
        hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to(device).eval()
    hf.generation_config.eos_token_id = None  # as the engine's stop_tokens=[]: every row runs N tokens
    hf.generation_config.pad_token_id = 0
    return model, tokenizer, hf, dict(tok_vocab=tok_vocab, save_s=save_s, disk=disk, load_s=load_s, load_mem=load_mem)


def decode_row(model, tokenizer, hf, prompts, N, share_weights, device):
    """Greedy decode of the same prompts through nanorl's engine and transformers' generate: tok/s of each and how
    many tokens agree."""
    from nanorl.engine import Engine, Request

    B, P = prompts.shape
    # the engine chat_rl samples with (bf16 on CUDA)
    engine = Engine(model, tokenizer, batch_size=B, max_len=P + N, share_weights=share_weights)

    def run_engine(n_new):
        reqs = [
            Request(p, max_tokens=n_new, temperature=0.0, stop_tokens=[], use_tools=False) for p in prompts.tolist()
        ]
        return [c[0].tokens for c in engine.submit_and_wait(reqs)]

    def run_hf(n_new):
        with torch.no_grad():
            x = prompts.to(device)
            out = hf.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=n_new,
                min_new_tokens=n_new,
                do_sample=False,
            )
        return out[:, P:].tolist()

    row, tokens = {"batch": B}, {}
    for who, fn in (("nanorl", run_engine), ("hf", run_hf)):
        fn(2)  # warm up: kernels, allocator
        seconds, tokens[who] = timed(device.type, fn, N)
        row[who + "_tok_per_s"] = round(B * N / seconds, 1)
    a, b = tokens["nanorl"], tokens["hf"]
    # greedy paths fork at the first near-tie and never rejoin: count the tokens before each row's first difference
    same = sum(next((i for i, (x, y) in enumerate(zip(r, s)) if x != y), N) for r, s in zip(a, b)) / (B * N)
    row.update(
        speedup=round(row["nanorl_tok_per_s"] / row["hf_tok_per_s"], 3),
        same_token_frac=round(same, 4),
        rows_equal=sum(r == s for r, s in zip(a, b)),
        distinct_tokens=len({t for r in a for t in r}),
    )
    return row


def decode_table(args, model, tokenizer, hf, tok_vocab, g, device):
    """decode_row at each --batches size, printed as a table -> the rows."""
    P, N = args.prompt_len, args.new_tokens
    print(f"greedy decode, prompt {P}, {N} new tokens, end to end (prefill included)")
    print(
        f"{'batch':>6} | {'nanorl tok/s':>12} | {'hf tok/s':>10} | {'speed-up':>8} | {'same tokens':>11} | "
        f"{'rows equal':>10}"
    )
    rows = []
    for B in args.batches:
        prompts = torch.randint(0, tok_vocab, (B, P), generator=g)
        rows.append(row := decode_row(model, tokenizer, hf, prompts, N, bool(args.lora_rank), device))
        print(
            f"{B:>6} | {row['nanorl_tok_per_s']:>12,.0f} | {row['hf_tok_per_s']:>10,.0f} | {row['speedup']:>7.2f}x | "
            f"{row['same_token_frac']:>11.1%} | {row['rows_equal']:>4}/{B:<5}"
        )
    return rows


def grpo_step(args, model, tokenizer, tok_vocab, g, device):
    """One GRPO step of chat_rl's trainer on the loaded model (after an untimed warm-up step), printed -> its
    numbers under the JSON's rl_* keys, and the peak memory."""
    from nanorl.engine import Engine
    from nanorl.optim import build_optimizer

    n_prompts, n, RP, RN = args.rl_prompts, args.rl_samples, args.rl_prompt_len, args.rl_new_tokens
    prompts = torch.randint(0, tok_vocab, (n_prompts, RP), generator=g).tolist()
    if args.lora_rank:  # adapters only (the engine then samples through the trainer's model: nothing to sync)
        from nanorl.lora import DEFAULT_LR, build_lora_optimizer

        optimizer = build_lora_optimizer(model, DEFAULT_LR)
    else:
        optimizer = build_optimizer(model, lr_scale=0.05)  # chat_rl's default --lr-scale
    engine = Engine(model, tokenizer, batch_size=n_prompts * n, max_len=RP + RN, share_weights=bool(args.lora_rank))
    rl_step = grpo_stepper(model, optimizer, engine, prompts, n, RN, args.max_tokens_per_gpu, device)
    rl_step(0)
    t_roll, t_train, gen_tok, train_tok, reward, grad_norm = rl_step(1)
    rl_mem = peak_memory_gb(device.type)
    print(
        f"GRPO step ({n_prompts} prompts x {n} samples, prompt {RP}, {RN} new tokens forced): rollout {t_roll:.2f}s "
        f"({gen_tok / t_roll:,.0f} tok/s) + train {t_train:.2f}s ({train_tok / t_train:,.0f} tok/s) = "
        f"{t_roll + t_train:.2f}s; peak memory {rl_mem:.2f} GB"
    )
    rl = dict(prompts=n_prompts, samples=n, rollout_s=round(t_roll, 6), train_s=round(t_train, 6))
    rl.update(total_s=round(t_roll + t_train, 6), generated_tokens=gen_tok, trained_tokens=train_tok)
    rl.update(reward_mean=round(reward, 4), grad_norm=round(grad_norm, 6))
    return {"rl_" + k: v for k, v in rl.items()}, rl_mem


def bench_hf(args):
    """A Hugging Face model through nanorl, on random weights of a real model's shape: the --hf-model load (seconds,
    peak memory), greedy decode through nanorl's Engine vs transformers' generate on the same prompts at each
    --batches size (tok/s of each, and whether they pick the same tokens), and one GRPO step of chat_rl's trainer."""
    import transformers

    transformers.utils.logging.disable_progress_bar()  # the log's last line stays the JSON
    device_type = args.device_type or autodetect_device_type()
    device = torch.device(device_type)
    P, N = args.prompt_len, args.new_tokens
    if args.rl_samples < 2:
        raise SystemExit(f"--rl-samples must be >= 2 (GRPO normalises by the group's std), got {args.rl_samples}")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if device_type == "cuda" else torch.float32  # what the Hub's checkpoints hold / CPU math
    name = device_name(device_type)
    model, tokenizer, hf, info = load_both(args, device, dtype, max(P + N, args.rl_prompt_len + args.rl_new_tokens))
    tok_vocab, cfg = info["tok_vocab"], model.config
    params = sum(p.numel() for k, p in model.named_parameters() if ".lora_" not in k)  # the base's
    print(
        f"hf | {name} | {args.arch} {args.size} random weights ({params / 1e6:.1f}M params, {cfg.n_layer} layers, "
        f"width {cfg.n_embd}, {cfg.n_head} heads / {cfg.n_kv_head} kv, vocab {cfg.vocab_size:,}) | "
        f"saved {info['disk'] / 1e9:.2f} GB in {info['save_s']:.1f}s | --hf-model load {info['load_s']:.2f}s, "
        f"peak memory {info['load_mem']:.2f} GB"
    )
    g = torch.Generator().manual_seed(1)
    decode = decode_table(args, model, tokenizer, hf, tok_vocab, g, device)
    hf = None  # its memory back before training
    if device_type == "cuda":
        torch.cuda.empty_cache()
    reset_peak_memory(device_type)
    rl, rl_mem = grpo_step(args, model, tokenizer, tok_vocab, g, device)
    load_mem = info["load_mem"]
    result = dict(bench="hf", device=name, arch=args.arch, size=args.size, params=params, lora_rank=args.lora_rank)
    result.update(vocab_size=cfg.vocab_size, tokenizer_vocab=tok_vocab, save_s=round(info["save_s"], 3))
    result.update(load_s=round(info["load_s"], 3), load_peak_mem_gb=round(load_mem, 3), prompt_len=P, new_tokens=N)
    result.update(decode=decode, **rl)
    result.update(peak_mem_gb=round(max(load_mem, rl_mem) if device_type == "cuda" else rl_mem, 3))
    print(json.dumps(result))
