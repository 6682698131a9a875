"""Packed token batches, rotary embeddings and causal attention over packed sequences.

A packed batch is one row of T tokens holding several sequences back to back: position ids
restart at 0 for each sequence and attention never crosses a boundary (cu_seqlens). Padded
batches are converted to this form (`unpad`), so the model has one code path.

The decoder calls `ctx.attend(layer_idx, q, k, v)` with q [T, hq, d], k/v [T, hkv, d]; the context
decides how (packed training attention here; the rollout engine supplies a KV-cache context).
On CUDA, packed attention is torch's varlen flash kernel: no T×T mask ever exists. On CPU it runs
a causal SDPA per sequence. A layer with an AttentionSpec (models.features: sliding window, logit
soft-cap, query scale) passes it as `spec=`: flash varlen takes a window and a scale; a soft-cap
(which no kernel here applies), and every spec layer on the CPU, goes through
models.spec_attention (torch, sequences in padded groups, its own recomputing backward).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridengine.models.features import AttentionSpec
from hybridengine.models.spec_attention import spec_attention



@dataclass
class PackedInput:
    """input_ids/position_ids [T]; cu_seqlens [n+1] int32 boundaries; `num_pad` trailing dummy
    tokens (their own sequence) appended so that T divides the sequence-parallel degree;
    cu_seqlens_host: the same boundaries on the host, where the input was built there and
    moved (train.engine.MicroBatch.to), so that what needs them as numbers reads them without
    waiting for the device."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    num_pad: int = 0
    cu_seqlens_host: torch.Tensor | None = None

    @property
    def host_bounds(self) -> torch.Tensor | None:
        """cu_seqlens on the host (itself, or the host copy), or None."""
        return self.cu_seqlens if self.cu_seqlens.device.type == "cpu" else \
            self.cu_seqlens_host

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @staticmethod
    def build(input_ids: torch.Tensor, cu_seqlens: torch.Tensor,
              position_ids: torch.Tensor | None = None, multiple_of: int = 1) -> "PackedInput":
        cu = cu_seqlens.to(device=input_ids.device, dtype=torch.int32)
        lens = (cu[1:] - cu[:-1]).long()
        if position_ids is None:
            starts = torch.repeat_interleave(cu[:-1].long(), lens)
            position_ids = torch.arange(input_ids.shape[0], device=input_ids.device) - starts
        num_pad = (-input_ids.shape[0]) % multiple_of
        if num_pad:
            input_ids = F.pad(input_ids, (0, num_pad))
            position_ids = torch.cat([position_ids, torch.arange(num_pad, device=cu.device)])
            cu = torch.cat([cu, cu[-1:] + num_pad])
            lens = torch.cat([lens, lens.new_tensor([num_pad])])
        return PackedInput(input_ids, position_ids, cu, int(lens.max()), num_pad)

    @staticmethod
    def from_lengths(input_ids: torch.Tensor, seqlens: list[int], multiple_of: int = 1):
        cu = torch.zeros(len(seqlens) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(seqlens).cumsum(0)
        return PackedInput.build(input_ids, cu, multiple_of=multiple_of)

    def strip(self, x: torch.Tensor) -> torch.Tensor:
        """Drop the trailing pad tokens from a per-token output [T, ...]."""
        return x[: x.shape[0] - self.num_pad] if self.num_pad else x


def unpad(input_ids: torch.Tensor, attention_mask: torch.Tensor, multiple_of: int = 1):
    """Padded [B, S] (left or right padding) -> (PackedInput, flat indices of the real tokens).

    Position ids count real tokens only (cumsum of the mask - 1), as verl's remove-padding path.
    """
    mask = attention_mask.bool()
    idx = mask.flatten().nonzero().squeeze(-1)
    lens = mask.sum(-1).to(torch.int32)
    cu = F.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))
    pos = (mask.long().cumsum(-1) - 1).flatten()[idx]
    return PackedInput.build(input_ids.flatten()[idx], cu, pos, multiple_of), idx


def repad(x: torch.Tensor, idx: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Scatter per-token outputs [T, ...] back into [B, S, ...] (zeros at pad positions)."""
    out = x.new_zeros((batch * seqlen, *x.shape[1:]))
    out[idx] = x
    return out.view(batch, seqlen, *x.shape[1:])


@torch.library.custom_op("hybridengine::rope_tables", mutates_args=())
def rope_tables(position_ids: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor,
                                                                              torch.Tensor]:
    """position_ids [T], inv_freq [d/2] -> fp32 (cos, signed_sin) [T, d]. A custom op so that
    torch.compile materialises the tables once per forward: inlined, its trigonometry ran again
    inside every layer's RoPE kernel, for every head (16.8 ms of a 0.25 s compiled prefill on
    an H200, ~5x the kernel's memory time; bench/RESULTS.md, 2026-11-30 session 4)."""
    freqs = position_ids.float().unsqueeze(-1) * inv_freq               # [T, d/2]
    emb = torch.cat([freqs, freqs], dim=-1)                               # [T, d]
    sin = freqs.sin()
    return emb.cos(), torch.cat([-sin, sin], dim=-1)


@rope_tables.register_fake
def _(position_ids, inv_freq):
    shape = (position_ids.shape[0], 2 * inv_freq.shape[0])
    return position_ids.new_empty(shape, dtype=torch.float32), \
        position_ids.new_empty(shape, dtype=torch.float32)


class RotaryEmbedding(torch.nn.Module):
    """fp32 cos/sin tables for the rotate-half RoPE of Llama/Qwen (inv_freq = θ^(-2i/d), or its
    scaled form: scaled_inv_freq). The sin table carries rotate-half's sign (first half negated),
    so that apply_rope needs no negation kernel: the tables are built once per forward
    (rope_tables), the rotation runs per layer."""

    def __init__(self, head_dim: int, theta: float, device=None,
                 scaling: tuple[tuple[str, object], ...] = (),
                 max_position_embeddings: int | None = None):
        super().__init__()
        if scaling:
            inv = scaled_inv_freq(head_dim, theta, dict(scaling), max_position_embeddings)
            inv = inv.to(device)
        else:
            inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64,
                                                device=device) / head_dim))
        self.register_buffer("inv_freq", inv.float(), persistent=False)

    def forward(self, position_ids: torch.Tensor):
        return rope_tables(position_ids, self.inv_freq)


SCALED_ROPE_TYPES = ("linear", "llama3")


def scaled_inv_freq(head_dim: int, theta: float, scaling: dict,
                    max_position_embeddings: int | None = None) -> torch.Tensor:
    """inv_freq [d/2] (fp32, CPU) of a scaled RoPE, scaling = HF rope_parameters without
    rope_theta. Computed by transformers' own function for the type (ROPE_INIT_FUNCTIONS), on a
    config holding only what it reads, so the frequencies are HF's bit for bit; only the types
    that rescale the frequencies alone (SCALED_ROPE_TYPES: no length-dependent or attention
    factor) are taken."""
    rope_type = scaling.get("rope_type")
    if rope_type not in SCALED_ROPE_TYPES:
        raise ValueError(f"rope_type={rope_type!r} is not supported (supported: default, "
                         f"{', '.join(SCALED_ROPE_TYPES)})")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    extra = {} if max_position_embeddings is None else \
        {"max_position_embeddings": max_position_embeddings}
    conf = LlamaConfig(hidden_size=head_dim, num_attention_heads=1, head_dim=head_dim,
                       rope_parameters=dict(scaling, rope_theta=theta), **extra)
    inv, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](conf, torch.device("cpu"))
    if attention_factor != 1.0:     # (cos/sin would be scaled too: not modelled here)
        raise ValueError(f"rope_type={rope_type!r} has attention factor {attention_factor}")
    return inv


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, h, d] (any strides); fp32 cos, signed_sin [T, d] from RotaryEmbedding, rounded to
    x's dtype first as HF does. Equals HF's x·cos + rotate_half(x)·sin bit for bit:
    rotate_half(x) = [−x₂, x₁], and −x₂·s = x₂·(−s)."""
    half = x.shape[-1] // 2
    swapped = torch.cat([x[..., half:], x[..., :half]], dim=-1)
    cos, signed_sin = cos.to(x.dtype), signed_sin.to(x.dtype)
    return x * cos.unsqueeze(1) + swapped * signed_sin.unsqueeze(1)


class PackedCausalAttention:
    """Causal self-attention inside each packed sequence (the training / scoring context)."""

    def __init__(self, packed: PackedInput):
        self.cu = packed.cu_seqlens
        # the bounds as the ops that read them as numbers take them: on the host where the
        # input has them there (spec_attention reads them in its forward and backward: a
        # device sync a layer each, twice a micro-batch, when handed the device's)
        host = packed.host_bounds
        self.cu_numbers = self.cu if host is None else host
        self.max_seqlen = packed.max_seqlen
        self._bounds = None
        # the rows that are tokens (the sequence-parallel pad trails them), for what must not
        # count padding (MoE router losses); None: every row is one
        t = packed.input_ids.shape[0]
        self.real_rows = None if not packed.num_pad else \
            torch.arange(t, device=packed.input_ids.device) < t - packed.num_pad

    def attend(self, layer_idx: int, q, k, v, spec: AttentionSpec | None = None) -> torch.Tensor:
        flash = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
        if spec is not None:
            if flash and spec.softcap is None:
                return self._varlen(q, k, v, spec)
            return spec_attention(q, k, v, self.cu_numbers, spec)
        if flash:
            return self._varlen(q, k, v)
        return self._per_sequence(q, k, v)

    def _varlen(self, q, k, v, spec: AttentionSpec | None = None):
        """Flash attention over the packed sequences, fewer K/V heads taken natively (GQA).
        aten's op, not torch.nn.attention.varlen_attn: it carries its own autograd formula
        (the flash backward), where varlen_attn is a Python custom op costing ~0.2 ms of host
        time a call (1,289 calls a PPO seed step: ~0.29 s of a host-bound update's time on an
        H200's host, bench/RESULTS.md session 23) and, without enable_gqa (torch 2.11),
        repeated K/V up to the query heads in training (kernels, and saved activations)."""
        kw = {}
        if spec is not None:    # the window counts the query's own token: flash's left is W - 1
            kw = {"scale": spec.scale, "window_size_right": 0,
                  "window_size_left": -1 if spec.window is None else spec.window - 1}
        return torch.ops.aten._flash_attention_forward(
            q, k, v, self.cu, self.cu, self.max_seqlen, self.max_seqlen, 0.0, True, False,
            **kw)[0]

    def _per_sequence(self, q, k, v):
        if torch.compiler.is_compiling():
            # one opaque op under torch.compile: reading the bounds (tolist) would break the
            # graph, and the CPU compile tests would then see other graphs than CUDA's varlen
            return per_sequence_attention(q, k, v, self.cu)
        if self._bounds is None:
            self._bounds = self.cu_numbers.tolist()
        return _per_sequence_attention(q, k, v, self._bounds)


def _per_sequence_attention(q, k, v, bounds: list[int]) -> torch.Tensor:
    """Causal SDPA of each packed sequence [bounds[i], bounds[i + 1]) of q [T, h_q, d],
    k/v [T, h_kv, d] -> [T, h_q, d] (the CPU path of PackedCausalAttention)."""
    out = torch.empty_like(q)
    gqa = k.shape[1] != q.shape[1]
    for s, e in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[s:e].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=gqa)
        out[s:e] = o.squeeze(0).transpose(0, 1)
    return out


@torch.library.custom_op("hybridengine::per_sequence_attention", mutates_args=())
def per_sequence_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cu: torch.Tensor) -> torch.Tensor:
    """_per_sequence_attention as an op (its backward recomputes: CPU tests only)."""
    return _per_sequence_attention(q, k, v, cu.tolist())


@per_sequence_attention.register_fake
def _(q, k, v, cu):
    return torch.empty_like(q)


@torch.library.custom_op("hybridengine::per_sequence_attention_backward", mutates_args=())
def per_sequence_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                                    v: torch.Tensor, cu: torch.Tensor) -> list[torch.Tensor]:
    bounds = cu.tolist()
    _, vjp = torch.func.vjp(lambda *qkv: _per_sequence_attention(*qkv, bounds), q, k, v)
    return list(vjp(grad))


@per_sequence_attention_backward.register_fake
def _(grad, q, k, v, cu):
    return [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)]


def _per_sequence_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _per_sequence_grad(ctx, grad):
    q, k, v, cu = ctx.saved_tensors
    return (*per_sequence_attention_backward(grad, q, k, v, cu), None)


per_sequence_attention.register_autograd(_per_sequence_grad, setup_context=_per_sequence_setup)
