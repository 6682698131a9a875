"""Per-family attention and norm features beyond Llama's: sliding windows (Mistral, Gemma 2/3),
attention-logit soft-capping and a query scale apart from head_dim (Gemma 2/3), Gemma's (1 + w)
RMSNorm, final-logit soft-capping.

A layer whose attention differs from plain causal softmax(q·kᵀ/√d) carries an AttentionSpec; the
decoder hands it to the context as `ctx.attend(layer, q, k, v, spec=spec)`, and only then, so a
context that models none of this keeps the four-argument call. A context given a spec must apply
it; the torch path for that is `masked_attention` below, under a mask from `window_mask`.

Conventions (Hugging Face's masking_utils.sliding_window_overlay): a query at position i sees key
position j when i - window < j <= i, so `window` counts the query's own token; flash-attention's
left window is window - 1.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class AttentionSpec:
    """window: keys per query, its own included (None: the whole prefix); softcap: scores become
    tanh(s / softcap)·softcap before the mask and softmax; scale: of q·kᵀ (None: head_dim^-½)."""

    window: int | None = None
    softcap: float | None = None
    scale: float | None = None


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal (and windowed) visibility: q_pos [..., n, 1], k_pos [..., 1, m] -> bool [..., n, m]."""
    mask = k_pos <= q_pos
    if window is not None:
        mask = mask & (k_pos > q_pos - window)
    return mask


def masked_attention(q, k, v, mask, spec: AttentionSpec) -> torch.Tensor:
    """q [B, h_q, n, d], k/v [B, h_kv, m, d], mask bool [B, 1, n, m] (True: attend) ->
    [B, h_q, n, d]; query head h reads K/V head h // (h_q / h_kv), as HF's repeat_kv.

    Without a soft-cap this is SDPA; with one, HF's eager order: scores in q's dtype, cap, mask,
    softmax in fp32, probabilities back in q's dtype. The capped form holds the [n, m] scores of
    every head (no fused kernel caps scores here): O(n·m) memory per head."""
    B, hq, n, d = q.shape
    hkv = k.shape[1]
    k, v = k.to(q.dtype), v.to(q.dtype)
    scale = spec.scale if spec.scale is not None else d ** -0.5
    if spec.softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=hkv != hq)
    qg = q.view(B, hkv, hq // hkv, n, d)                                  # [B, h_kv, G, n, d]
    scores = qg @ k.unsqueeze(2).transpose(-1, -2) * scale                # [B, h_kv, G, n, m]
    scores = torch.tanh(scores / spec.softcap) * spec.softcap
    scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return (probs @ v.unsqueeze(2)).view(B, hq, n, d)


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """tanh(x / cap)·cap in x's dtype (HF's final_logit_softcapping order); cap None: x."""
    return x if cap is None else torch.tanh(x / cap) * cap


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: x·rsqrt(mean x² + eps)·(1 + w), all in fp32, then x's dtype (HF casts
    after the weight, where Llama's casts before it; fp64 stays fp64, for the gradient tests).
    The weight is stored as w (0 = identity)."""

    def __init__(self, dim: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(dt)
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.to(dt))).type_as(x)


def activation(name: str):
    """The MLP gate's activation by HF name (hidden_act / hidden_activation)."""
    if name == "silu":
        return F.silu
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return lambda x: F.gelu(x, approximate="tanh")
    raise ValueError(f"hidden activation {name!r} is not supported (silu, gelu_pytorch_tanh)")
