"""A GPT rigged to use a tool, for multi-turn RL tests: after <|assistant_start|> it writes
<|python_start|>code<|python_end|>, and after a tool's <|output_end|> it writes `after_output`.

It is a bigram model: the blocks' output projections are zero, so each position sees only its own token,
whose one-hot embedding picks a row of the lm_head's logit table. `noise` perturbs every weight, so
attention and positions matter too (cached decode and full forwards then really have to agree)."""

import itertools

import torch

from nanorl.gpt import GPTConfig, build_model


def tool_user_model(
    tokenizer, code, after_output, vocab_size, strength=15.0, noise=0.0, n_embd=64, seq_len=256, seed=0
):
    sp = tokenizer.encode_special
    chain = [sp("<|assistant_start|>"), sp("<|python_start|>"), *tokenizer.encode(code), sp("<|python_end|>")]
    next_of = dict(itertools.pairwise(chain))
    next_of[sp("<|output_end|>")] = after_output
    if len(next_of) != len(chain):
        raise ValueError(f"the tokens of {code!r} must all differ, for a bigram model to write it")
    torch.manual_seed(seed)
    cfg = GPTConfig(sequence_len=seq_len, vocab_size=vocab_size, n_layer=1, n_head=1, n_kv_head=1, n_embd=n_embd)
    model = build_model(cfg, "cpu")
    with torch.no_grad():
        model.transformer.wte.weight.zero_()
        model.lm_head.weight.zero_()
        for i, (a, b) in enumerate(next_of.items()):
            model.transformer.wte.weight[a, i] = 1.0  # norm() makes it sqrt(n_embd) on dimension i
            model.lm_head.weight[b, i] = strength / n_embd**0.5
        for p in model.parameters():
            p.add_(noise * torch.randn_like(p))
    return model.eval()
