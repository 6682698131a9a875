"""Tiny random HF models saved to disk, and comparison helpers."""
from __future__ import annotations

import os

import torch

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
STORIES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models",
                       "stories260k")


def tiny_hf_model(kind: str, tied: bool, seed: int = 0, vocab: int = 97, layers: int = 2):
    """A random LlamaForCausalLM / Qwen2ForCausalLM with GQA (8 heads, 4 KV heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                  max_position_embeddings=128, tie_word_embeddings=tied, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    with torch.no_grad():   # random biases and norm weights, so a wrong mapping shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0.0 if name.endswith("bias") else 1.0, 0.1)
    return model.eval()


def save_tiny(path, kind: str, tied: bool, seed: int = 0, **kw) -> str:
    tiny_hf_model(kind, tied, seed, **kw).save_pretrained(str(path))
    return str(path)


def save_cases(root, make, cases) -> dict[str, str]:
    """{case: directory} of make(case) saved under root/case (a module fixture's HF models)."""
    out = {}
    for name in cases:
        make(name).save_pretrained(str(root / name))
        out[name] = str(root / name)
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()
