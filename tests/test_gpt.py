import pytest
import torch
from numerics import assert_close_ulps

from nanorl import gpt
from nanorl.decode import KVCache, LockstepDecode, inference_copy, new_kv_cache
from nanorl.gpt import GPT, GPTConfig, build_model, config_from_depth, positions_from_doc_ids


def tiny(n_kv_head=2, seq=64, vocab=97):
    torch.manual_seed(0)
    cfg = GPTConfig(sequence_len=seq, vocab_size=vocab, n_layer=2, n_head=4, n_kv_head=n_kv_head, n_embd=64)
    model = build_model(cfg, "cpu")
    # init_weights zeroes the output projections; perturb them so every layer really matters in the tests
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model.eval()


@pytest.mark.fp32("calls the model outside autocast, as an fp32 reference (CUDA's layout runs it under autocast only)")
@pytest.mark.parametrize("n_kv_head", [4, 2, 1])
def test_cached_decode_equals_full_forward(n_kv_head):
    model = tiny(n_kv_head)
    idx = torch.randint(0, 97, (3, 20))
    with torch.no_grad():
        full = model(idx)
        cache = new_kv_cache(model, 3, 32, "cpu")
        outs = [model(idx[:, :8], kv_cache=cache)]  # prefill 8, then one token at a time
        for t in range(8, 20):
            outs.append(model(idx[:, t : t + 1], kv_cache=cache))
    cached = torch.cat(outs, dim=1)
    assert cache.pos.tolist() == [20, 20, 20]
    torch.testing.assert_close(cached, full, atol=1e-5, rtol=1e-5)


@pytest.mark.fp32("calls the model outside autocast, as an fp32 reference (CUDA's layout runs it under autocast only)")
def test_cached_decode_rows_at_different_positions():
    # rows of one batch can sit at different positions (mixed prompt lengths, continuous batching)
    model = tiny()
    a, b = torch.randint(0, 97, (1, 12)), torch.randint(0, 97, (1, 7))
    with torch.no_grad():
        cache = new_kv_cache(model, 2, 32, "cpu")
        # row 0 gets a's prefix (11 tokens), row 1 b's prefix (6 tokens) padded to 11: pads beyond pos are masked
        prefill = torch.cat([a[:, :11], torch.cat([b[:, :6], torch.zeros(1, 5, dtype=torch.long)], 1)])
        model(prefill, kv_cache=cache)
        cache.pos[1] = 6
        step = model(torch.cat([a[:, 11:12], b[:, 6:7]]), kv_cache=cache)
        ref_a, ref_b = model(a)[:, -1], model(b)[:, -1]
    torch.testing.assert_close(step[0, 0], ref_a[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step[1, 0], ref_b[0], atol=1e-5, rtol=1e-5)


@pytest.mark.fp32("calls the model outside autocast, as an fp32 reference (CUDA's layout runs it under autocast only)")
def test_copy_rows_prefix_sharing():
    model = tiny()
    idx = torch.randint(0, 97, (1, 10))
    nxt = torch.randint(0, 97, (4, 1))
    with torch.no_grad():
        cache = new_kv_cache(model, 4, 16, "cpu")
        cache.rows = slice(0, 1)  # prefill the prompt once, into row 0 (as the engine prefills a few rows)...
        model(idx, kv_cache=cache)
        cache.rows = slice(None)
        cache.copy_rows(torch.tensor([0, 0, 0]), torch.tensor([1, 2, 3]))  # ...fan out to the other 3 rows
        out = model(nxt, kv_cache=cache)[:, 0]
        ref = model(torch.cat([idx.expand(4, 10), nxt], dim=1))[:, -1]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


class Offloaded(torch.nn.Module):
    """FSDP's --cpu-offload as a CPU test can see it: the model computes on one device (the CPU here) while its
    weights, as model.lm_head.weight.device reports them, are on another ('meta' here; under offload the host
    memory, with the compute on the GPU)."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config, self.head_dim = model, model.config, model.head_dim
        self.lm_head = torch.nn.Linear(1, 1, device="meta")

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)


def greedy_reference(model, ids, n):
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(ids) :]


@pytest.mark.fp32("calls the model outside autocast, as an fp32 reference (CUDA's layout runs it under autocast only)")
def test_greedy_decode_builds_its_cache_on_the_compute_device_not_the_weights():
    # base_train's samples (with --fsdp --cpu-offload the weights are in host memory, the forwards run on the GPU)
    from nanorl.decode import greedy_decode

    model = tiny()
    assert new_kv_cache(model, 1, 8, "meta").k.device.type == "meta"
    assert greedy_decode(Offloaded(model), [5, 6, 7, 8], 10, torch.device("cpu")) == greedy_reference(
        model, [5, 6, 7, 8], 10
    )
    # the context ends it: 60 prompt tokens leave room for 4 more, and the forward at the last position gives a 5th
    ids = torch.randint(0, 97, (60,)).tolist()
    assert greedy_decode(Offloaded(model), ids, 10, "cpu") == greedy_reference(model, ids, 5)


@pytest.mark.fp32("calls the model outside autocast, as an fp32 reference (CUDA's layout runs it under autocast only)")
def test_greedy_decode_runs_on_the_engines_pinned_kernels():
    # the one masked attention call outside the engine (base_train's samples): pinned as the engine pins its own,
    # never left to SDPA's dispatcher. Seen through SDPA's global switches while each forward runs
    from torch.nn.attention import SDPBackend

    from nanorl.decode import attention_backends, greedy_decode

    model, seen = tiny(), []
    forward = model.hidden_states
    switches = {
        SDPBackend.FLASH_ATTENTION: torch.backends.cuda.flash_sdp_enabled,
        SDPBackend.EFFICIENT_ATTENTION: torch.backends.cuda.mem_efficient_sdp_enabled,
        SDPBackend.MATH: torch.backends.cuda.math_sdp_enabled,
        SDPBackend.CUDNN_ATTENTION: torch.backends.cuda.cudnn_sdp_enabled,
    }

    def hidden_states(idx, **kw):
        seen.append((idx.size(1), [b for b, on in switches.items() if on()]))
        return forward(idx, **kw)

    model.hidden_states = hidden_states
    greedy_decode(model, [1, 2, 3], 3, torch.device("cpu"))
    cpu = torch.device("cpu")
    assert seen == [(3, attention_backends(cpu)), (1, attention_backends(cpu)), (1, attention_backends(cpu))]
    assert seen[0][1] == [SDPBackend.FLASH_ATTENTION]
    cuda = torch.device("cuda")  # what it pins on a GPU: the engine's kernel, which takes the boolean mask
    assert attention_backends(cuda) == [SDPBackend.EFFICIENT_ATTENTION]


@pytest.mark.fp32("calls the model outside autocast, as an fp32 reference (CUDA's layout runs it under autocast only)")
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("backend", ["sdpa_mask", "flex"])
@pytest.mark.parametrize("n_kv_head,lens", [(2, [5, 9, 3, 7]), (4, [100, 60, 1, 89])])
def test_packed_documents_equal_separate(monkeypatch, backend, n_kv_head, lens):
    # "flex" runs the CUDA path's block mask (flex_attention, eager on CPU); "sdpa_mask" is the CPU path. The second
    # case packs 250 tokens, so the mask crosses flex's 128-token tiles and has a 1-token document.
    monkeypatch.setattr(gpt, "use_flex", lambda device: backend == "flex")
    model = tiny(n_kv_head, seq=256)
    docs = [torch.randint(0, 97, (n,)) for n in lens]
    packed = torch.cat(docs)[None]
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])[None]
    assert positions_from_doc_ids(doc_ids)[0].tolist() == [i for n in lens for i in range(n)]
    with torch.no_grad():
        logits = model(packed, doc_ids=doc_ids)[0]
        sep = torch.cat([model(d[None])[0] for d in docs])
        # loss: the packed row's loss equals the per-document losses (targets never cross documents)
        tgt = torch.cat([torch.cat([d[1:], torch.tensor([-1])]) for d in docs])[None]
        packed_loss = model(packed, targets=tgt, doc_ids=doc_ids, loss_reduction="sum")
        sep_loss = sum(model(d[None, :-1], targets=d[None, 1:], loss_reduction="sum") for d in docs)
    torch.testing.assert_close(logits, sep, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed_loss, sep_loss, atol=1e-4, rtol=1e-5)


def test_attention_backend_names_the_kernels():
    # each stage prints this line; on CUDA the packed path must never be the dense mask (math-kernel fallback)
    assert "flex_attention" in gpt.attention_backend("cuda") and "dense" not in gpt.attention_backend("cuda")
    assert "FlashAttention" in gpt.attention_backend(torch.device("cuda", 0))
    assert "dense document mask" in gpt.attention_backend("cpu")
    assert gpt.use_flex("cuda:1") and not gpt.use_flex("cpu")


@pytest.mark.fp32("calls the model outside autocast, as an fp32 reference (CUDA's layout runs it under autocast only)")
def test_token_logprobs_match_log_softmax_and_entropy():
    model = tiny()
    idx = torch.randint(0, 97, (2, 16))
    tgt = torch.randint(0, 97, (2, 16))
    tgt[0, :4] = -1
    with torch.no_grad():
        ref = torch.log_softmax(model(idx) / 0.7, dim=-1)
        lp, ent = model.token_logprobs(idx, tgt, temperature=0.7, return_entropy=True, chunk_size=5)
    want = ref.gather(-1, tgt.clamp(min=0)[..., None])[..., 0] * (tgt >= 0)
    torch.testing.assert_close(lp, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, -(ref.exp() * ref).sum(-1), atol=1e-5, rtol=1e-5)
    # and the loss from forward() equals minus the mean log-prob at temperature 1
    with torch.no_grad():
        lp1 = model.token_logprobs(idx, tgt.clamp(min=0))
        loss = model(idx, targets=tgt.clamp(min=0))
    torch.testing.assert_close(loss, -lp1.mean(), atol=1e-5, rtol=1e-5)


@pytest.mark.fp32("calls the model outside autocast, as an fp32 reference (CUDA's layout runs it under autocast only)")
def test_token_logprobs_gradient_matches_plain():
    model = tiny().train()
    idx, tgt = torch.randint(0, 97, (2, 12)), torch.randint(0, 97, (2, 12))
    model.zero_grad()
    model.token_logprobs(idx, tgt, chunk_size=7).sum().backward()
    g1 = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    torch.log_softmax(model(idx), -1).gather(-1, tgt[..., None]).sum().backward()
    for a, b in zip(g1, [p.grad for p in model.parameters()]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.fp32("calls the model outside autocast, as an fp32 reference (CUDA's layout runs it under autocast only)")
def test_gradients_flow_and_loss_decreases():
    torch.manual_seed(0)
    cfg = GPTConfig(sequence_len=32, vocab_size=50, n_layer=2, n_head=2, n_kv_head=1, n_embd=64)
    model = build_model(cfg, "cpu")
    # a learnable pattern: each row counts up mod 50 from a random start
    start = torch.randint(0, 50, (8, 1))
    data = (start + torch.arange(33)) % 50
    x, y = data[:, :-1], data[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = model(x, targets=y)
        opt.zero_grad()
        loss.backward()
        losses.append(loss.item())
        opt.step()
    # right after init every parameter gets a gradient (except through zero-init'd projections' inputs)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert abs(losses[0] - torch.log(torch.tensor(50.0)).item()) < 0.1  # near-uniform start
    assert losses[-1] < 0.5 * losses[0]


def test_meta_init_then_init_weights():
    cfg = config_from_depth(2, vocab_size=100, sequence_len=64, aspect_ratio=64, head_dim=32)
    with torch.device("meta"):
        model = GPT(cfg)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    model.init_weights()
    assert not any(p.is_meta for p in model.parameters())
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert model.transformer.h[0].attn.c_proj.weight.abs().sum() == 0
    assert 0.9 < model.transformer.wte.weight.std() < 1.1
    # rotary tables are real numbers after init (to_empty leaves them uninitialised)
    assert torch.allclose(model.cos[0], torch.ones_like(model.cos[0]))


def test_config_errors_and_flops():
    with pytest.raises(ValueError, match="head_dim"):
        config_from_depth(3, vocab_size=100, aspect_ratio=10, head_dim=128)
    with pytest.raises(ValueError, match="n-kv-head"):
        config_from_depth(4, vocab_size=100, n_kv_head=3)
    cfg = config_from_depth(4, vocab_size=100, sequence_len=128, head_dim=64, n_kv_head=2)
    assert (cfg.n_embd, cfg.n_head, cfg.n_kv_head) == (256, 4, 2)
    model = build_model(cfg, "cpu")
    nparams = model.num_params() - 100 * 256
    assert model.estimate_flops() == 6 * nparams + 12 * 4 * 4 * 64 * 128


@pytest.mark.fp32("calls the model outside autocast, as an fp32 reference (CUDA's layout runs it under autocast only)")
def test_too_long_inputs_error():
    model = tiny(seq=16)
    with pytest.raises(ValueError, match="context"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="exceeds"):
        new_kv_cache(model, 1, 17, "cpu")
    cache = new_kv_cache(model, 1, 8, "cpu")
    with torch.no_grad():
        model(torch.zeros(1, 8, dtype=torch.long), kv_cache=cache)
        with pytest.raises(ValueError, match="full"):
            model(torch.zeros(1, 1, dtype=torch.long), kv_cache=cache)


def test_apply_rotary_is_the_pairwise_rotation_bit_for_bit():
    # each pair (x1[i], x2[i]) of the head dim's two halves turns by its angle: [x1 c - x2 s, x2 c + x1 s], exactly
    g = torch.Generator().manual_seed(0)
    x, angle = torch.randn(2, 3, 5, 8, generator=g), torch.rand(5, 4, generator=g) * 6
    c, s = angle.cos(), angle.sin()
    cos, sin = torch.cat([c, c], -1)[None, None], torch.cat([-s, s], -1)[None, None]  # GPT.init_rotary's tables
    x1, x2 = x[..., :4], x[..., 4:]
    assert torch.equal(gpt.apply_rotary(x, cos, sin), torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1))


LOCKSTEP_ARCHS = {
    "nanorl": {},
    "gqa": {"n_kv_head": 1},
    "no qk-norm": {"qk_norm": False},
    "qwen2 (q/k/v bias: unfused)": {"attn_bias": True, "qk_norm": False, "norm_weight": True, "mlp": "swiglu"},
    "qwen3 (learned qk-norm, wide heads)": {"qk_norm": True, "norm_weight": True, "norm_eps": 1e-6, "head_dim": 32},
    "llama (swiglu, tied, no softcap)": {
        "mlp": "swiglu",
        "mlp_hidden": 96,
        "norm_weight": True,
        "qk_norm": False,
        "tie_embeddings": True,
        "softcap": 0.0,
    },
}


@pytest.mark.fp32("calls the model outside autocast, as an fp32 reference (CUDA's layout runs it under autocast only)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", list(LOCKSTEP_ARCHS))
def test_lockstep_decode_equals_the_cached_forward_bit_for_bit(arch, dtype):
    # the engine's lean step (rows at one position) against the cached forward it replaces, on the engine's copy of
    # the weights (fused q/k/v where it can be, column-major on the CPU; bf16 as on CUDA), for every architecture
    # switch: the same logits, the same cache, the same positions, to the bit; rows past B keep their cache
    from dataclasses import replace

    base = GPTConfig(sequence_len=64, vocab_size=97, n_layer=2, n_head=4, n_kv_head=2, n_embd=64)
    torch.manual_seed(0)
    model = build_model(replace(base, **LOCKSTEP_ARCHS[arch]), "cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    copy, _ = inference_copy(model, dtype)
    fused = copy.transformer.h[0].attn.qkv is not None
    assert fused == (arch not in ("qwen2 (q/k/v bias: unfused)", "qwen3 (learned qk-norm, wide heads)"))
    cfg = copy.config  # caches of the copy's dtype (bf16 as on CUDA; new_kv_cache picks fp32 on a CPU)
    caches = [KVCache(cfg.n_layer, 4, cfg.n_kv_head, 24, copy.head_dim, "cpu", dtype) for _ in range(3)]
    prompt = torch.randint(0, 97, (1, 9))
    with torch.inference_mode():
        for c in caches:
            c.rows = slice(0, 1)
            copy(prompt, kv_cache=c)
            c.rows = slice(None)
            c.copy_rows(torch.zeros(3, dtype=torch.long), torch.arange(1, 4))  # prefix sharing, as the engine does
        lockstep, shared = LockstepDecode(copy, caches[0]), LockstepDecode(copy, caches[2])
        for pos in range(9, 14):
            idx = torch.randint(0, 97, (3,))  # rows 0..2 step; row 3 stays at 9
            got = lockstep(idx, pos)
            caches[1].rows = slice(0, 3)
            want = copy(idx[:, None], kv_cache=caches[1])[:, 0]
            caches[1].rows = slice(None)
            assert got.shape == (3, 97) and got.dtype == torch.float32
            assert torch.equal(got, want)
            # the prompt read once (fp32 only; a bf16 cache takes SDPA, bit for bit): its attention sums the prompt's
            # scores in a GEMM and the row's own in another, SDPA in one kernel, so the last bits differ by the CPU's
            # kernels (2 steps at a logit of 64 on AVX2, 0 on AVX-512): a few rounding steps at the logits' size
            once = shared(idx, pos, shared=9)
            if dtype == torch.float32:
                assert_close_ulps(once, want, 16)
                assert not torch.equal(once, want)  # it really took the other path
            else:
                assert torch.equal(once, want)
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
    assert caches[0].pos.tolist() == caches[1].pos.tolist() == [14, 14, 14, 9]
    with pytest.raises(ValueError, match="KV cache is full: position 24 >= max_len 24"):
        lockstep(idx, 24)


@pytest.mark.parametrize("n_kv_head", [4, 2])
@pytest.mark.parametrize("P", [1, 6, 11])
@pytest.mark.parametrize("n", [None, 2, 3])
def test_shared_prefix_attention_reads_the_prompt_once_and_equals_sdpa(n_kv_head, P, n):
    # rows in groups of n (None: all rows) whose first P keys are one prompt's: the attention over whole rows (SDPA,
    # each row reading its own copy), to float rounding, while only each group's first row's copy of its prompt is
    # read: the other rows' copies poisoned with NaN change nothing; and a group's prompt is its own (a wrong prefix
    # in a group's first row changes that group's rows and no other's)
    from nanorl.decode import attend_shared_prefix

    g = torch.Generator().manual_seed(P)
    B, H, D, L = 6, 4, 16, 12
    m = n or B
    kc, vc = torch.randn(B, n_kv_head, 20, D, generator=g), torch.randn(B, n_kv_head, 20, D, generator=g)
    first = torch.arange(B) // m * m  # each row's group's first row
    kc[:, :, :P], vc[:, :, :P] = kc[first, :, :P], vc[first, :, :P]
    q = torch.randn(B, H, D, generator=g)
    G = H // n_kv_head
    want = torch.nn.functional.scaled_dot_product_attention(q.view(B, n_kv_head, G, D), kc[:, :, :L], vc[:, :, :L])
    others = torch.arange(B) % m != 0
    kc[others, :, :P], vc[others, :, :P] = float("nan"), float("nan")
    got = attend_shared_prefix(q, kc, vc, P, L, n)
    torch.testing.assert_close(got, want.reshape(B, H * D), atol=1e-6, rtol=1e-5)
    kc[0, :, 0] += 1  # the first group's prompt
    moved = (attend_shared_prefix(q, kc, vc, P, L, n) - got).abs().amax(-1) > 1e-3
    assert moved.tolist() == [True] * m + [False] * (B - m)
