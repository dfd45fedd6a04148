"""Hugging Face import/export: tiny random Llama / Qwen2 / Qwen3 / NanoChat models built with transformers."""
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

from nanorl.hf import export_hf, load_hf_model  # noqa: E402

VOCAB = 128


def tiny_hf(kind, directory, seed=0):
    """A tiny random HF model saved to `directory`; norms and biases randomised too (their init is trivial)."""
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common, rms_norm_eps=1e-5, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=32)  # wider heads than hidden/heads, as Qwen3
        model = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(directory)
    return model.eval()


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_import_logits_match_transformers(kind, tmp_path):
    ref = tiny_hf(kind, tmp_path)
    model, _ = load_hf_model(str(tmp_path))
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(ids)
        theirs = ref(ids).logits.float()
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() < 1e-4
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.parameters())
