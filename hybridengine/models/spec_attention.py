"""Attention under an AttentionSpec (window, logit soft-cap, query scale) in torch, for where no
kernel applies it: Gemma 2's soft-capped layers on CUDA (flash kernels do not cap scores), every
spec layer on the CPU.

    spec_attention(q, k, v, cu_seqlens, spec) -> [T, h_q, d]   (packed sequences, causal)

A custom op with its own backward, so that

  - a compiled decoder layer traces through it: no graph break, no guard on the host's sequence
    bounds (a graph per packing) or on the layer index passed beside it (a graph per layer);
  - autograd keeps only q, k, v: the backward recomputes the probabilities (as flash-attention
    does) instead of keeping every sequence's [h, n, n] scores, tanh and softmax (Gemma 2's
    update held ~1.3 KB per token and layer of them at 768-token sequences);
  - sequences attend in padded groups of up to GROUP_SCORE_ELEMENTS scores (by length: a longer
    one alone), one batched computation a group instead of one launch sequence per sequence
    (Gemma 2's prefill of 256 prompts x 26 layers).

Forward: models.features.masked_attention on each group (Hugging Face's eager order: scores in
q's dtype, cap, mask, fp32 softmax, probabilities in q's dtype). Backward, in fp32 (fp64 for fp64
inputs), from the recomputed probabilities p of the capped scores c = cap·tanh(s/cap):
dv = pᵀ·dO, dp = dO·vᵀ, dc = p ⊙ (dp − Σ p ⊙ dp), ds = dc ⊙ (1 − (c/cap)²), dq = scale·ds·k,
dk = scale·dsᵀ·q, the G query heads of a K/V head summed into its dk, dv. Padded query rows see
their sequence's keys and are dropped (their upstream gradient zeroed); padded keys are masked.
"""
from __future__ import annotations

import torch

from hybridengine.models.features import AttentionSpec, masked_attention, window_mask

# Scores one group may hold ([G, h_q, n, n] elements): the forward's transient is ~(4 + 3b) bytes
# a score (the fp32 softmax and layer-dtype copies), 335 MB in bf16; the backward's ~5 fp32
# [G, h_q, n, n] tensors, 671 MB. The memory plan counts it (train.activation_memory).
GROUP_SCORE_ELEMENTS = 1 << 25


def _groups(bounds: list[int], heads: int, max_elements: int):
    """[(starts, lengths, n)]: the non-empty sequences by length, right-padded to the group's
    longest n, in groups of at most max_elements scores (one sequence alone when it is
    larger)."""
    lens = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    groups: list[list[int]] = []
    for i in sorted((i for i in range(len(lens)) if lens[i]), key=lens.__getitem__):
        # ascending lengths: a group's longest is the one joining it
        if groups and (len(groups[-1]) + 1) * heads * lens[i] ** 2 <= max_elements:
            groups[-1].append(i)
        else:
            groups.append([i])
    return [([bounds[i] for i in g], [lens[i] for i in g], lens[g[-1]]) for g in groups]


def _gather(starts: list[int], lengths: list[int], n: int, device):
    """(token index [G, n], valid [G, n], arange(n)): padded entries index their sequence's
    first token."""
    ar = torch.arange(n, device=device)
    first = torch.tensor(starts, device=device)[:, None]
    valid = ar[None, :] < torch.tensor(lengths, device=device)[:, None]
    return torch.where(valid, first + ar[None, :], first), valid, ar


def _mask(ar, valid, window):
    """[G, 1, n, n]: causal (and windowed) inside the sequence, padded keys hidden; a padded
    query row sees every real key (a window past the sequence's end would leave it none: a
    softmax of no key is NaN, which the backward's sums would spread)."""
    seen = window_mask(ar[:, None], ar[None, :], window)[None, None] | ~valid[:, None, :, None]
    return seen & valid[:, None, None, :]


def grouped_attention(q, k, v, bounds: list[int], spec: AttentionSpec,
                      max_elements: int = GROUP_SCORE_ELEMENTS) -> torch.Tensor:
    """The packed sequences' attention (no autograd needed), group by group."""
    out = torch.empty_like(q)
    for starts, lengths, n in _groups(bounds, q.shape[1], max_elements):
        idx, valid, ar = _gather(starts, lengths, n, q.device)
        qg, kg, vg = (t[idx].transpose(1, 2) for t in (q, k, v))                # [G, h, n, d]
        o = masked_attention(qg, kg, vg, _mask(ar, valid, spec.window), spec)
        out[idx[valid]] = o.transpose(1, 2)[valid]
    return out


def grouped_attention_backward(grad, q, k, v, bounds: list[int], spec: AttentionSpec,
                               max_elements: int = GROUP_SCORE_ELEMENTS):
    """(dq, dk, dv) of grouped_attention for the output gradient `grad` (module docstring)."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    f = torch.promote_types(q.dtype, torch.float32)
    scale = spec.scale if spec.scale is not None else d ** -0.5
    for starts, lengths, n in _groups(bounds, hq, max_elements):
        idx, valid, ar = _gather(starts, lengths, n, q.device)
        G = len(starts)
        # [G, h_kv, group heads, n, d]; the padded rows' upstream gradient zeroed
        qg = q[idx].to(f).transpose(1, 2).reshape(G, hkv, hq // hkv, n, d)
        kg, vg = (t[idx].to(f).transpose(1, 2).unsqueeze(2) for t in (k, v))
        do = (grad[idx].to(f) * valid[..., None, None]).transpose(1, 2) \
            .reshape(G, hkv, hq // hkv, n, d)
        s = qg @ kg.transpose(-1, -2) * scale                           # [G, h_kv, g, n, n]
        if spec.softcap is not None:
            t = torch.tanh(s / spec.softcap)
            s = t * spec.softcap
        p = torch.softmax(s.masked_fill(~_mask(ar, valid, spec.window).unsqueeze(1),
                                        float("-inf")), dim=-1)
        dp = do @ vg.transpose(-1, -2)
        ds = p * (dp - (p * dp).sum(-1, keepdim=True))
        if spec.softcap is not None:
            ds = ds * (1 - t * t)
        dq_g = (ds @ kg * scale).reshape(G, hq, n, d).transpose(1, 2)  # [G, n, h_q, d]
        dk_g = (ds.transpose(-1, -2) @ qg * scale).sum(2).transpose(1, 2)
        dv_g = (p.transpose(-1, -2) @ do).sum(2).transpose(1, 2)
        at = idx[valid]
        dq[at], dk[at], dv[at] = (x[valid].to(q.dtype) for x in (dq_g, dk_g, dv_g))
    return dq, dk, dv


def _spec(window: int, softcap: float, scale: float) -> AttentionSpec:
    return AttentionSpec(window or None, softcap or None, scale or None)


@torch.library.custom_op("hybridengine::spec_attention", mutates_args=())
def _spec_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                    window: int, softcap: float, scale: float) -> torch.Tensor:
    return grouped_attention(q, k, v, cu_seqlens.tolist(), _spec(window, softcap, scale))


@_spec_attention.register_fake
def _(q, k, v, cu_seqlens, window, softcap, scale):
    return torch.empty_like(q)


@torch.library.custom_op("hybridengine::spec_attention_backward", mutates_args=())
def _spec_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                             v: torch.Tensor, cu_seqlens: torch.Tensor, window: int,
                             softcap: float, scale: float) -> list[torch.Tensor]:
    return list(grouped_attention_backward(grad, q, k, v, cu_seqlens.tolist(),
                                           _spec(window, softcap, scale)))


@_spec_attention_backward.register_fake
def _(grad, q, k, v, cu_seqlens, window, softcap, scale):
    return [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)]


def _setup(ctx, inputs, output):
    q, k, v, cu, window, softcap, scale = inputs
    ctx.save_for_backward(q, k, v, cu)
    ctx.spec = (window, softcap, scale)


def _backward(ctx, grad):
    q, k, v, cu = ctx.saved_tensors
    dq, dk, dv = _spec_attention_backward(grad.contiguous(), q, k, v, cu, *ctx.spec)
    return dq, dk, dv, None, None, None, None


_spec_attention.register_autograd(_backward, setup_context=_setup)


def spec_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                   spec: AttentionSpec) -> torch.Tensor:
    """Causal attention under `spec` inside each packed sequence of cu_seqlens (its window
    counting from the sequence's own first token): q [T, h_q, d], k/v [T, h_kv, d] ->
    [T, h_q, d]. The forward and the backward read cu_seqlens as numbers: hand it over on
    the host where it is there (PackedInput.host_bounds), or each reads the device's."""
    return _spec_attention(q, k, v, cu_seqlens, spec.window or 0, spec.softcap or 0.0,
                           spec.scale or 0.0)
