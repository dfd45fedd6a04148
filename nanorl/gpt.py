"""
The nanorl GPT: one small, modern decoder-only transformer.

- rotary position embeddings (no learned positions), QK-norm, grouped-query attention (n_kv_head)
- ReLU^2 MLP, parameter-free RMSNorm, untied token embedding and unembedding, logit softcap
- built on the meta device and initialised explicitly by init_weights()
- a few switches (GPTConfig) load open models into this same class: SwiGLU MLP, RMSNorm with weights,
  QKV bias, QK-norm with weights (Qwen3) or none (Llama, Qwen2), tied embeddings, rope theta and Llama-3
  rope scaling, no softcap. The defaults are nanorl's own architecture (see nanorl/hf.py)
- three attention paths: plain causal; packed rows with document masking (several documents in a row
  attend only within themselves, positions restart per document); and a KV cache for the engine, which the
  forward asks to attend (KVCache in nanorl/decode.py, beside the engine's own copy of the model)
  Which kernel runs where (attention_backend() says it in each stage's log):
    plain causal  CUDA: SDPA pinned to its FlashAttention backend (bf16/fp16: GQA without repeating K/V;
                  fp32 is left to SDPA's choice); CPU: SDPA
    packed docs   CUDA: compiled flex_attention with a block mask (never a T x T mask in memory);
                  CPU: SDPA with a dense (B, 1, T, T) boolean mask (exact, and T is small there)
"""

import copy
import math
from dataclasses import asdict, dataclass
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from torch.utils.checkpoint import checkpoint

from nanorl.precision import checkpoint_context_fn, cuda_dtypes


@dataclass
class GPTConfig:
    sequence_len: int = 2048
    vocab_size: int = 32768
    n_layer: int = 12
    n_head: int = 6
    n_kv_head: int = 6
    n_embd: int = 768
    softcap: float = 15.0  # 0: no softcap
    # architecture switches for imported open models; the defaults are nanorl's own choices
    head_dim: int = 0  # 0: n_embd // n_head (Qwen3 uses wider heads than n_embd / n_head)
    mlp: str = "relu2"  # "relu2" (c_fc -> relu^2 -> c_proj) or "swiglu" (silu(c_gate) * c_fc -> c_proj)
    mlp_hidden: int = 0  # 0: 4 * n_embd
    norm_weight: bool = False  # RMSNorm with a learned scale (and the embedding is not normed)
    norm_eps: float = 0.0  # 0: torch's default (the dtype's machine epsilon)
    attn_bias: bool = False  # biases on the q/k/v projections (Qwen2)
    qk_norm: bool = True  # normalise q and k per head (with norm_weight: learned, before rotary, as Qwen3)
    tie_embeddings: bool = False  # lm_head shares the token embedding
    rope_theta: float = 10000.0
    rope_scaling: dict = None  # Llama-3.1's {"rope_type": "llama3", "factor", "low_freq_factor", ...}

    def to_dict(self):
        return asdict(self)


def config_from_depth(depth, vocab_size, sequence_len=2048, aspect_ratio=64, head_dim=128, n_kv_head=None):
    """--depth is the single size dial: width = depth * aspect_ratio, heads of head_dim each."""
    if depth < 1:
        raise ValueError(f"--depth must be >= 1, got {depth}")
    n_embd = depth * aspect_ratio
    if n_embd % head_dim != 0:
        raise ValueError(
            f"--depth {depth} x aspect ratio {aspect_ratio} = model dim {n_embd}, "
            f"which is not a multiple of head_dim {head_dim}; pick a depth/aspect ratio/head dim that divides"
        )
    n_head = n_embd // head_dim
    n_kv_head = n_head if n_kv_head is None else n_kv_head
    if n_kv_head < 1 or n_head % n_kv_head != 0:
        raise ValueError(f"--n-kv-head {n_kv_head} must divide the number of heads {n_head} (depth {depth})")
    return GPTConfig(
        sequence_len=sequence_len,
        vocab_size=vocab_size,
        n_layer=depth,
        n_head=n_head,
        n_kv_head=n_kv_head,
        n_embd=n_embd,
    )


def norm(x):
    # parameter-free RMSNorm: nothing to learn, nothing to decay
    return F.rms_norm(x, (x.size(-1),))


class RMSNorm(nn.Module):
    """norm() with an optional learned scale; without one it has no parameters and adds no state-dict keys."""

    def __init__(self, dim, config):
        super().__init__()
        self.eps = config.norm_eps or None
        self.weight = nn.Parameter(torch.ones(dim)) if config.norm_weight else None

    def forward(self, x):
        w = None if self.weight is None else self.weight.to(x.dtype)  # fp32 weights under bf16 autocast
        return F.rms_norm(x, (x.size(-1),), w, self.eps)


def rope_inv_freq(head_dim, theta, scaling=None):
    """Rotary frequencies; Llama-3.1's scaling slows the low frequencies down for a longer context."""
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, half, dtype=torch.float32) / half))
    if not scaling:
        return inv_freq
    factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - lo) / (hi - lo)  # 0 at the long-wavelength end, 1 at the short one
    mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)  # long waves: scaled
    return torch.where((wavelen >= old_len / hi) & (wavelen <= old_len / lo), mid, out)


def apply_rotary(x, cos, sin):
    # x: (B, T, H, D); cos/sin: (B or 1, T, 1, D), the tables [cos, cos] and [-sin, sin] (GPT.init_rotary).
    # Rotates the pairs made of the two halves of the head dim: [x1 cos - x2 sin, x2 cos + x1 sin] is
    # x * cos + [x2, x1] * sin, bit for bit, in four ops instead of six (decode runs it once or twice per layer);
    # [x2, x1] is x rolled by half its width
    return (x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin).to(x.dtype)


def positions_from_doc_ids(doc_ids):
    """Position of each token inside its own document: a packed row restarts at 0 at each new document."""
    idx = torch.arange(doc_ids.size(1), device=doc_ids.device).expand_as(doc_ids)
    is_start = F.pad(doc_ids[:, 1:] != doc_ids[:, :-1], (1, 0), value=True)
    # each token's document start: the last start at or before it
    return idx - torch.where(is_start, idx, 0).cummax(dim=1).values


def doc_mask(doc_ids):
    """(B, 1, T, T) boolean mask: causal and within the same document (the CPU path)."""
    same = doc_ids[:, :, None] == doc_ids[:, None, :]
    return same.tril()[:, None]


def use_flex(device):
    # SDPA with an explicit mask cannot use FlashAttention, and memory-efficient attention has no GQA, so on
    # CUDA a dense document mask falls back to the math kernel (fp32 B x H x T x T scores: tens of GB at d20)
    return torch.device(device).type == "cuda"


def doc_block_mask(doc_ids):
    """flex_attention's BlockMask for causal attention within each document: it stores which 128 x 128 tiles
    are empty, full or partial, and evaluates the rule below only inside partial tiles. Built once per forward;
    every layer reuses it."""
    B, T = doc_ids.shape

    def causal_same_doc(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    return create_block_mask(causal_same_doc, B, None, T, T, device=doc_ids.device)


# flex_attention must run compiled: called eagerly it materialises the full scores. Inside a compiled model it is
# compiled with the model; called eagerly on CUDA it goes through its own compiled wrapper, made on first use
# (creating it imports torch's compiler, ~2 s that CPU processes never need); on CPU, where only tests call
# it, it runs eagerly.
_flex_compiled = None


def flex_attend(q, k, v, block_mask, enable_gqa):
    global _flex_compiled
    fn = flex_attention
    if q.device.type == "cuda" and not torch.compiler.is_compiling():
        if _flex_compiled is None:
            _flex_compiled = torch.compile(flex_attention)
        fn = _flex_compiled
    return fn(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)


def causal_attend(q, k, v, enable_gqa):
    """Plain causal attention. On CUDA in bf16/fp16 it is pinned to SDPA's FlashAttention backend, so a torch or
    cuDNN upgrade cannot switch the kernel (or fail over to the O(T^2)-memory math kernel) without an error."""
    if q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa)


def attention_backend(device):
    """One line for a stage's log: which attention kernel each training path runs on `device`."""
    if use_flex(device):
        return (
            "attention: causal = SDPA FlashAttention (pinned, bf16); "
            "packed documents = compiled flex_attention with a block mask"
        )
    return "attention: causal = SDPA (torch's choice); packed documents = SDPA with a dense document mask (exact)"


class CausalSelfAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.gqa = config.n_kv_head != config.n_head
        self.head_dim = config.head_dim or config.n_embd // config.n_head
        self.c_q = nn.Linear(config.n_embd, self.n_head * self.head_dim, bias=config.attn_bias)
        self.c_k = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=config.attn_bias)
        self.c_v = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=config.attn_bias)
        self.c_proj = nn.Linear(self.n_head * self.head_dim, config.n_embd, bias=False)
        # QK-norm: nanorl's parameter-free one after rotary, or a learned one before rotary (Qwen3)
        self.qk_norm = config.qk_norm
        self.q_norm = RMSNorm(self.head_dim, config) if config.qk_norm and config.norm_weight else None
        self.k_norm = RMSNorm(self.head_dim, config) if config.qk_norm and config.norm_weight else None
        self.qkv = None  # the [W_q; W_k; W_v] view fuse_qkv() makes, in the engine's copy of the weights only

    def fuse_qkv(self):
        """Decode reads q, k and v with one matmul, whose q and k come out side by side as heads() rotates and norms
        them (no concatenation): fewer small ops a layer, which is what a one-token step at batch 1 pays for. Only where c_q, c_k and c_v have no bias and
        their weights lie one after another in memory (the engine's flat copy on GPU) or side by side as column
        ranges of one (in, out) block (its copy on CPU), so the fused weight is a view of them (no copy; a
        load_weights() refresh reaches it) and each output is the same dot product as before."""
        ws = [self.c_q.weight, self.c_k.weight, self.c_v.weight]
        lins = [self.c_q, self.c_k, self.c_v]
        if self.q_norm is not None or any(type(m) is not nn.Linear or m.bias is not None for m in lins):
            return
        rows, C = sum(w.size(0) for w in ws), ws[0].size(1)
        if any(w.untyped_storage().data_ptr() != ws[0].untyped_storage().data_ptr() for w in ws):
            return
        if all(w.is_contiguous() for w in ws):  # one after another
            step, strides = [w.numel() for w in ws], (C, 1)
        elif all(w.stride() == (1, rows) for w in ws):  # column ranges of one (C, rows) block
            step, strides = [w.size(0) for w in ws], (1, rows)
        else:
            return
        if any(b.storage_offset() != a.storage_offset() + n for a, b, n in zip(ws, ws[1:], step)):
            return
        self.qkv = ws[0].detach().as_strided((rows, C), strides)

    def heads(self, x, cos, sin):
        """q (..., H, D) and k, v (..., Hkv, D) of x (..., C): projected, rotated, normed. Heads next to each other,
        as the projections lay them out: forward() moves them to SDPA's (B, H, T, D); the engine's LockstepDecode
        (nanorl/decode.py) has no time axis."""
        H, Hkv, D = self.n_head, self.n_kv_head, self.head_dim
        if self.qkv is not None:  # fuse_qkv(): one matmul, the same numbers as three
            qk, v = F.linear(x, self.qkv).unflatten(-1, (H + 2 * Hkv, D)).split((H + Hkv, Hkv), dim=-2)
        else:
            q, k = self.c_q(x).unflatten(-1, (H, D)), self.c_k(x).unflatten(-1, (Hkv, D))
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            qk, v = torch.cat([q, k], dim=-2), self.c_v(x).unflatten(-1, (Hkv, D))
        # q and k side by side: rotated and normed together, each op once (elementwise or per head: the same numbers)
        qk = apply_rotary(qk, cos, sin)
        if self.qk_norm and self.q_norm is None:
            qk = norm(qk)  # QK-norm keeps attention logits bounded without a temperature to tune
        return qk.narrow(-2, 0, H), qk.narrow(-2, H, Hkv), v

    def forward(self, x, cos, sin, attn_mask=None, kv_cache=None):
        q, k, v = (t.transpose(1, 2) for t in self.heads(x, cos, sin))
        if kv_cache is not None:
            y = kv_cache.attend(self.layer_idx, q, k, v, attn_mask)
        else:
            # one dtype for the kernels (v's: the Linear's output dtype, bf16 under autocast); a no-op in fp32
            q, k = q.to(v.dtype), k.to(v.dtype)
            if isinstance(attn_mask, BlockMask):
                y = flex_attend(q, k, v, attn_mask, self.gqa)
            elif attn_mask is not None:
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=self.gqa)
            else:
                y = causal_attend(q, k, v, self.gqa)
        return self.c_proj(y.transpose(1, 2).flatten(2))  # (B, T, H * D)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden = config.mlp_hidden or 4 * config.n_embd
        self.swiglu = config.mlp == "swiglu"
        if self.swiglu:
            self.c_gate = nn.Linear(config.n_embd, hidden, bias=False)
        self.c_fc = nn.Linear(config.n_embd, hidden, bias=False)
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=False)

    def forward(self, x):
        if self.swiglu:
            return self.c_proj(F.silu(self.c_gate(x)) * self.c_fc(x))
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.attn = CausalSelfAttention(config, layer_idx)
        self.mlp = MLP(config)
        self.norm_attn, self.norm_mlp = RMSNorm(config.n_embd, config), RMSNorm(config.n_embd, config)

    def forward(self, x, cos, sin, attn_mask=None, kv_cache=None):
        x = x + self.attn(self.norm_attn(x), cos, sin, attn_mask, kv_cache)
        return x + self.mlp(self.norm_mlp(x))


def embedding_dtype(config, device_type):
    """The dtype init_weights gives the token embedding on a device: bf16 on CUDA (and in CUDA's layout on the CPU,
    precision.cuda_dtypes) unless it is tied to the head. The embedding is only a lookup: bf16 halves its memory
    traffic. (FSDP casts it back: see fsdp.shard_model.)"""
    return torch.bfloat16 if cuda_dtypes(device_type) and not config.tie_embeddings else torch.float32


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        if config.n_embd % config.n_head != 0:
            raise ValueError(f"n_embd {config.n_embd} is not divisible by n_head {config.n_head}")
        if config.n_head % config.n_kv_head != 0:
            raise ValueError(f"n_kv_head {config.n_kv_head} must divide n_head {config.n_head}")
        if config.mlp not in ("relu2", "swiglu"):
            raise ValueError(f"unknown mlp {config.mlp!r}: 'relu2' or 'swiglu'")
        self.config = config
        self.head_dim = config.head_dim or config.n_embd // config.n_head
        self.transformer = nn.ModuleDict(
            dict(
                # _weight: left uninitialised (init_weights draws it); nn.Embedding's own draw, on the meta device
                # build_model builds on, imports torch._dynamo: ~1.7 s more to start every process
                wte=nn.Embedding(
                    config.vocab_size, config.n_embd, _weight=torch.empty(config.vocab_size, config.n_embd)
                ),
                h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
                norm_f=RMSNorm(config.n_embd, config),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.tie_weights()
        # rotary tables are buffers (not parameters, not saved): recomputed by init_weights / load
        self.register_buffer("cos", torch.empty(config.sequence_len, self.head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(config.sequence_len, self.head_dim), persistent=False)
        # what token_logprobs' checkpoints enter when backward recomputes them outside the forward's contexts: the
        # precision policy's choice for this process, made once
        self.checkpoint_context_fn = checkpoint_context_fn()

    def tie_weights(self):
        # again after to_empty()/load, which may replace the shared parameter with two separate ones
        if self.config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight

    @torch.no_grad()
    def init_weights(self):
        """Explicit init, so the model can be built on the meta device and materialised with to_empty()."""
        C = self.config.n_embd
        torch.nn.init.normal_(self.transformer.wte.weight, mean=0.0, std=1.0)
        # a tiny unembedding: the initial prediction is near uniform, so the first loss is ~ln(vocab)
        torch.nn.init.normal_(self.lm_head.weight, mean=0.0, std=0.001)
        bound = math.sqrt(3.0 / C)  # uniform with std 1/sqrt(fan_in)
        for block in self.transformer.h:
            for lin in (
                block.attn.c_q,
                block.attn.c_k,
                block.attn.c_v,
                block.mlp.c_fc,
                getattr(block.mlp, "c_gate", None),
            ):
                if lin is not None:
                    torch.nn.init.uniform_(lin.weight, -bound, bound)
                    if lin.bias is not None:
                        torch.nn.init.zeros_(lin.bias)
            # residual branches start as the identity: outputs projections at zero
            torch.nn.init.zeros_(block.attn.c_proj.weight)
            torch.nn.init.zeros_(block.mlp.c_proj.weight)
        for m in self.modules():
            if isinstance(m, RMSNorm) and m.weight is not None:
                torch.nn.init.ones_(m.weight)
        self.tie_weights()
        self.init_rotary()
        self.transformer.wte.to(dtype=embedding_dtype(self.config, self.transformer.wte.weight.device.type))

    @torch.no_grad()
    def init_rotary(self):
        dev = self.lm_head.weight.device
        inv_freq = rope_inv_freq(self.head_dim, self.config.rope_theta, self.config.rope_scaling).to(dev)
        t = torch.arange(self.config.sequence_len, dtype=torch.float32, device=dev)
        freqs = torch.outer(t, inv_freq)
        # full-width tables for apply_rotary; assigned, not copied into: after a meta-device load the old buffers
        # hold no memory
        self.cos = torch.cat([freqs.cos(), freqs.cos()], dim=-1)
        self.sin = torch.cat([-freqs.sin(), freqs.sin()], dim=-1)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def estimate_flops(self):
        """FLOPs per token of a training step: 6 x (matmul params) + attention (nanochat's convention)."""
        nparams = self.num_params() - self.transformer.wte.weight.numel()
        l, h, q, t = self.config.n_layer, self.config.n_head, self.head_dim, self.config.sequence_len
        return 6 * nparams + 12 * l * h * q * t

    def hidden_states(self, idx, doc_ids=None, kv_cache=None):
        """The final normed hidden states (B, T, C) for token ids idx (B, T)."""
        T = idx.size(1)
        if T > self.config.sequence_len:
            raise ValueError(f"sequence of {T} tokens is longer than the model's context of {self.config.sequence_len}")
        if kv_cache is not None:
            pos, attn_mask = kv_cache.begin(T)
        elif doc_ids is not None:
            pos = positions_from_doc_ids(doc_ids)
            attn_mask = doc_block_mask(doc_ids) if use_flex(idx.device) else doc_mask(doc_ids)
        else:
            pos = torch.arange(T, device=idx.device)[None, :]
            attn_mask = None  # plain causal
        # (B, T) positions -> cos/sin of shape (B, T, 1, D), for heads laid out (B, T, H, D)
        cos, sin = self.cos[pos][:, :, None], self.sin[pos][:, :, None]
        x = self.transformer.wte(idx)
        if not self.config.norm_weight:
            x = norm(x)  # nanorl norms the embedding; the imported architectures do not
        for block in self.transformer.h:
            x = block(x, cos, sin, attn_mask, kv_cache)
        return self.transformer.norm_f(x)

    def logits_from_hidden(self, h):
        # softcap: smoothly bound logits to +-softcap, computed in fp32
        logits = self.lm_head(h).float()
        c = self.config.softcap
        return c * torch.tanh(logits / c) if c else logits

    def logits_at(self, idx, pos):
        """Logits (B, V) of row b at position pos[b] alone: only those hidden states reach the head. A scorer that
        reads one position per row (chat_eval's letters) would otherwise make fp32 logits for every position, B x T x V
        of them (at B=64 on MMLU's prompts, tens of GB)."""
        h = self.hidden_states(idx)
        return self.logits_from_hidden(h[torch.arange(idx.size(0), device=idx.device), pos])

    def forward(self, idx, targets=None, doc_ids=None, kv_cache=None, loss_reduction="mean"):
        """Logits (B, T, V) when targets is None, else the cross-entropy loss (targets == -1 are ignored)."""
        h = self.hidden_states(idx, doc_ids=doc_ids, kv_cache=kv_cache)
        logits = self.logits_from_hidden(h)
        if targets is None:
            return logits
        return F.cross_entropy(
            logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1, reduction=loss_reduction
        )

    def token_logprobs(self, idx, targets, doc_ids=None, temperature=1.0, return_entropy=False, chunk_size=1024):
        """
        log p(targets | prefix) per position (B, T), optionally with the entropy of each position's distribution.
        fp32 logits are made one chunk of positions at a time and recomputed in backward (checkpoint), so
        RL never holds B x T x V fp32 logits at once. Targets of -1 give log-prob 0.
        """
        h, tgt = self.hidden_states(idx, doc_ids=doc_ids).flatten(0, 1), targets.flatten()

        def chunk_fn(h_c, t_c):
            logits = self.logits_from_hidden(h_c) / temperature
            logp_all = torch.log_softmax(logits, dim=-1)
            lp = logp_all.gather(1, t_c.clamp(min=0)[:, None])[:, 0] * (t_c >= 0)
            ent = -(logp_all.exp() * logp_all).sum(-1)
            return lp, ent

        if torch.is_grad_enabled() and h.requires_grad:  # a backward will come: it recomputes each chunk's logits
            chunk_fn = partial(checkpoint, chunk_fn, use_reentrant=False, context_fn=self.checkpoint_context_fn)
        chunks = [chunk_fn(h[s : s + chunk_size], tgt[s : s + chunk_size]) for s in range(0, tgt.numel(), chunk_size)]
        # new tensors, not views of the concatenation: FSDP2 hooks backward onto what a forward method returns and
        # warns that an in-place op on a returned view would bypass that hook
        logp, ent = (torch.cat(parts).view_as(targets).clone() for parts in zip(*chunks))
        if return_entropy:
            return logp, ent
        return logp


class Critic(nn.Module):
    """
    PPO's value model V(prefix) -> (B, T): a separate copy of the policy's transformer with a scalar head in
    place of the unembedding. Separate, not a head on the policy's trunk, so the value loss never moves the
    policy (no value-loss coefficient to tune against the policy loss) and every other estimator trains the
    policy exactly as without a critic; the price is a second copy of the weights.
    """

    def __init__(self, policy):
        super().__init__()
        self.gpt = copy.deepcopy(policy)
        del self.gpt.lm_head  # the value head replaces it
        self.value_head = nn.Linear(policy.config.n_embd, 1)
        nn.init.zeros_(self.value_head.weight)  # V = 0 at the start: the first advantages are the plain returns
        nn.init.zeros_(self.value_head.bias)

    def forward(self, idx, doc_ids=None):
        return self.value_head(self.gpt.hidden_states(idx, doc_ids=doc_ids)).squeeze(-1).float()


def build_model(config, device):
    """Construct on the meta device (no memory, no init cost), materialise on `device`, then init explicitly."""
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device=device)
    model.init_weights()
    return model
