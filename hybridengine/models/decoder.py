"""The Llama / Qwen2 / Qwen3 / Mistral / Gemma 2 / Gemma 3 decoder family, tensor-, sequence- and
pipeline-parallel aware.

RMSNorm, rotate-half RoPE (theta and an optional linear / llama3 frequency scaling from the
config), grouped-query attention, SwiGLU MLP, optional qkv bias (Qwen2), optional per-head RMSNorm
of q and k before RoPE (Qwen3, Gemma 3), tied or untied embeddings, optional scalar value head (the
critic). Sliding-window layers (Mistral: all; Gemma: by layer_types). Gemma: embeddings scaled by
√hidden, (1 + w) RMSNorms also after attention and MLP, GeGLU (tanh gelu), a query scale of
query_pre_attn_scalar^-½, attention- and final-logit soft-capping (Gemma 2), a second RoPE base
for sliding layers (Gemma 3). Those features live in models.features.

Sharding (applied through the parallel layers; the math reads as the single-device model):
- qkv_proj: one ColumnParallelLinear whose rank-r shard is [q_r; k_r; v_r] (q heads h_q/tp, kv heads
  h_kv/tp per rank), so one GEMM and one sequence-parallel all-gather per layer.
- o_proj, down_proj: RowParallelLinear. gate_up_proj: ColumnParallelLinear, rank shard [gate_r; up_r].
- q_norm / k_norm (Qwen3): [head_dim] weights shared by every head, so replicated on every TP
  rank; a rank's gradient covers its own heads only and is summed over TP (with or without SP).
- embed_tokens / lm head: vocab-parallel rows of the tp-padded vocabulary.
- sequence parallel: the residual stream and the norms live on a [T/tp, H] block per rank.
- pipeline: a stage owns layers [layer_start, layer_end); the first stage the embedding, the last
  the final norm and the head. With pp > 1 and tied embeddings the last stage keeps its own copy of
  the embedding as `lm_head.weight` (kept in sync by the training engine, as Megatron does).

Activations are token-major packed batches ([T, H]; see models.attention).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hybridengine.kernels import fused_linear_logprob_entropy
from hybridengine.models.attention import PackedCausalAttention, PackedInput, RotaryEmbedding, \
    apply_rope
from hybridengine.models.features import AttentionSpec, GemmaRMSNorm, activation, softcap
from hybridengine.models.moe import MoEMLP
from hybridengine.parallel.tensor import ColumnParallelLinear, RowParallelLinear, \
    VocabParallelEmbedding, copy_to_tp, gather_from_sp, gather_from_sp_copy, group_size, \
    all_gather_dim0


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 4096
    model_type: str = "llama"
    qk_norm: bool = False
    # HF rope_parameters besides rope_theta, as sorted (key, value) pairs (rope_type included);
    # () for the unscaled RoPE
    rope_scaling: tuple[tuple[str, object], ...] = ()
    # keys per query on sliding layers (its own token included); None: no sliding layer
    sliding_window: int | None = None
    # "sliding_attention" / "full_attention" per layer; (): every layer slides when
    # sliding_window is set (Mistral)
    layer_types: tuple[str, ...] = ()
    attn_softcap: float | None = None
    final_softcap: float | None = None
    query_pre_attn_scalar: float | None = None
    hidden_act: str = "silu"
    rope_local_theta: float | None = None     # Gemma 3's sliding layers (default RoPE)
    # mixture of experts (Qwen3-MoE, Mixtral; models.moe): 0 experts is a dense model. A layer
    # is sparse unless listed in mlp_only_layers, every decoder_sparse_step-th (HF's names)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    @property
    def gemma(self) -> bool:
        """(1 + w) norms around attention and MLP, embeddings scaled by √hidden."""
        return self.model_type in ("gemma2", "gemma3_text")

    def is_sliding(self, layer: int) -> bool:
        if self.sliding_window is None:
            return False
        return not self.layer_types or self.layer_types[layer] == "sliding_attention"

    def attention_spec(self, layer: int) -> AttentionSpec | None:
        """None for plain causal softmax(q·kᵀ/√d): the contexts' fast kernels apply."""
        scale = None if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar ** -0.5
        if scale == self.head_dim ** -0.5:
            scale = None
        spec = AttentionSpec(self.sliding_window if self.is_sliding(layer) else None,
                             self.attn_softcap, scale)
        return None if spec == AttentionSpec() else spec

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.mlp_only_layers and \
            (layer + 1) % self.decoder_sparse_step == 0

    def check_tp(self, tp: int) -> None:
        if self.num_heads % tp:
            raise ValueError(f"num_attention_heads={self.num_heads} is not divisible by "
                             f"tensor parallel size {tp}")
        if self.num_kv_heads % tp:
            raise ValueError(f"num_key_value_heads={self.num_kv_heads} is not divisible by "
                             f"tensor parallel size {tp}")

    def check_cp(self, tp: int, cp: int, cp_attention: str) -> None:
        """Ulysses gives each CP rank whole query heads of its TP shard (K/V heads are repeated
        where they do not split); all-gather and ring attention split no heads. The CP
        attentions are plain causal softmax: no window, soft-cap or query scale."""
        if cp > 1 and any(self.attention_spec(i) for i in range(self.num_layers)):
            key = "ulysses_sequence_parallel_size" if cp_attention == "ulysses" else \
                "megatron.context_parallel_size"
            raise ValueError(f"{key}={cp}: context parallelism does not support the sliding-"
                             f"window / soft-capped / rescaled attention of {self.model_type}")
        if cp > 1 and cp_attention == "ulysses" and (self.num_heads // tp) % cp:
            raise ValueError(f"ulysses_sequence_parallel_size={cp} must divide the query heads "
                             f"per tensor-parallel rank, num_attention_heads/tp = "
                             f"{self.num_heads}/{tp}")

    def check_ep(self, ep: int) -> None:
        """Expert parallelism shares out whole experts (models.moe): E/ep per rank."""
        if ep > 1 and (self.num_experts == 0 or self.num_experts % ep):
            raise ValueError(f"megatron.expert_model_parallel_size={ep} must divide the "
                             f"model's num_experts={self.num_experts}" if self.num_experts else
                             f"megatron.expert_model_parallel_size={ep} needs a mixture-of-"
                             f"experts model ({self.model_type} has no experts)")

    def num_params(self) -> int:
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        q = self.num_heads * self.head_dim
        attn = h * (q + 2 * kv) + q * h + (q + 2 * kv if self.attention_bias else 0)
        layer = attn + (4 if self.gemma else 2) * h + (2 * self.head_dim if self.qk_norm else 0)
        dense = 3 * h * self.intermediate_size
        sparse = self.num_experts * (3 * h * self.moe_intermediate_size + h)    # + the router
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return sum(layer + (sparse if self.is_moe_layer(i) else dense)
                   for i in range(self.num_layers)) + emb + h


def stage_layers(num_layers: int, pp: int, pp_rank: int) -> tuple[int, int]:
    """Layers [start, end) of a pipeline stage: an even split, the remainder to the first stages."""
    if num_layers < pp:
        raise ValueError(f"num_hidden_layers={num_layers} < pipeline parallel size {pp}")
    base, extra = divmod(num_layers, pp)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's fused kernel: fp32 statistics as in HF Llama/Qwen2, one launch instead of ~8.
        return nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, group, sp: bool, dtype, device):
        super().__init__()
        tp = group_size(group)
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = cfg.num_heads // tp, cfg.num_kv_heads // tp
        self.head_dim = cfg.head_dim
        q, kv = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, 0, group, cfg.attention_bias, sp,
                                             out_per_partition=q + 2 * kv, dtype=dtype,
                                             device=device)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, group,
                                        False, sp, dtype=dtype, device=device)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = norm_class(cfg)(cfg.head_dim, cfg.rms_norm_eps, dtype, device)
            self.k_norm = norm_class(cfg)(cfg.head_dim, cfg.rms_norm_eps, dtype, device)
        self.spec = cfg.attention_spec(layer_idx)

    def forward(self, x, cos, sin, ctx):
        qkv = self.qkv_proj(x)                                            # [T, q + 2kv]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qk, v = qkv.split([(hq + hkv) * d, hkv * d], dim=-1)
        qk, v = qk.view(-1, hq + hkv, d), v.view(-1, hkv, d)
        if self.qk_norm:
            # before RoPE (Qwen3), so the fused decode kernel below still only rotates
            qk = torch.cat([self.q_norm(qk[:, :hq]), self.k_norm(qk[:, hq:])], dim=1)
        # a windowed / capped / rescaled layer names its spec (models.features)
        kw = {} if self.spec is None else {"spec": self.spec}
        if getattr(ctx, "applies_rope", False):
            # the context rotates q and k inside its own kernel (the rollout's decode step:
            # RoPE, the K/V-cache write and attention in one launch)
            o = ctx.attend_rope(self.layer_idx, qk[:, :hq], qk[:, hq:], v, cos, sin, **kw)
        else:
            # q and k rotated together: one set of RoPE kernels per layer instead of two
            qk = apply_rope(qk, cos, sin)                                 # [T, hq + hkv, d]
            o = ctx.attend(self.layer_idx, qk[:, :hq], qk[:, hq:], v, **kw)  # [T, h_q, d]
        return self.o_proj(o.reshape(o.shape[0], hq * d))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, group, sp: bool, dtype, device):
        super().__init__()
        self.ffn_per_rank = cfg.intermediate_size // group_size(group)
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, 2 * cfg.intermediate_size,
                                                 group, False, sp, dtype=dtype, device=device)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, group, False,
                                           sp, dtype=dtype, device=device)
        self.act = activation(cfg.hidden_act)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.ffn_per_rank, dim=-1)
        return self.down_proj(self.act(gate) * up)


def norm_class(cfg: ModelConfig):
    return GemmaRMSNorm if cfg.gemma else RMSNorm


class DecoderLayer(nn.Module):
    """Llama: pre-norms (post_attention_layernorm is the MLP's input norm). Gemma: the same
    names as HF's, post_attention_layernorm norming the attention output, and a pre- / post-norm
    pair around the MLP."""

    def __init__(self, cfg, layer_idx, group, sp, dtype, device, ep_group=None):
        super().__init__()
        norm, h, eps = norm_class(cfg), cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = norm(h, eps, dtype, device)
        self.self_attn = Attention(cfg, layer_idx, group, sp, dtype, device)
        self.post_attention_layernorm = norm(h, eps, dtype, device)
        self.sandwich = cfg.gemma
        if self.sandwich:
            self.pre_feedforward_layernorm = norm(h, eps, dtype, device)
        self.mlp = MoEMLP(cfg, group, sp, dtype, device, ep_group) \
            if cfg.is_moe_layer(layer_idx) else MLP(cfg, group, sp, dtype, device)
        if self.sandwich:
            self.post_feedforward_layernorm = norm(h, eps, dtype, device)
        # Gemma 3: sliding layers rotate with their own RoPE base (Decoder.forward's tables)
        self.local_rope = cfg.rope_local_theta is not None and cfg.is_sliding(layer_idx)

    def forward(self, h, cos, sin, ctx):
        if self.sandwich:
            a = self.self_attn(self.input_layernorm(h), cos, sin, ctx)
            h = h + self.post_attention_layernorm(a)
            return h + self.post_feedforward_layernorm(
                self._feed_forward(self.pre_feedforward_layernorm(h), ctx))
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, ctx)
        return h + self._feed_forward(self.post_attention_layernorm(h), ctx)

    def _feed_forward(self, x, ctx):
        if isinstance(self.mlp, MoEMLP):    # its router losses skip the context's padding rows
            return self.mlp(x, getattr(ctx, "real_rows", None))
        return self.mlp(x)


class LayerGroup(nn.Module):
    """Consecutive decoder layers run as one unit: the unit torch.compile wraps when the training
    engine compiles several layers at once (train.compile_layers: one compiled call, and one
    autograd node, for the group instead of one per layer). Not a submodule of the Decoder (its
    parameters and state dict stay the layers' own); its ModuleList only references them."""

    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, h, tables, ctx):
        for layer in self.layers:
            cos, sin = tables[layer.local_rope]
            h = layer(h, cos, sin, ctx)
        return h


class Decoder(nn.Module):
    """One pipeline stage of the decoder (the whole model when pp = 1) on one TP rank; with an
    expert-parallel group, this EP rank's experts of every MoE layer (models.moe)."""

    layer_groups: list[LayerGroup] | None = None    # set by train.compile_layers, or none

    def __init__(self, cfg: ModelConfig, tp_group=None, sequence_parallel: bool = False,
                 pp_rank: int = 0, pp_size: int = 1, value_head: bool = False,
                 dtype=None, device=None, ep_group=None):
        super().__init__()
        tp = group_size(tp_group)
        cfg.check_tp(tp)
        if cfg.intermediate_size % tp:
            raise ValueError(f"intermediate_size={cfg.intermediate_size} is not divisible by "
                             f"tensor parallel size {tp}")
        self.cfg, self.tp_group, self.ep_group = cfg, tp_group, ep_group
        self.sp = sequence_parallel and tp > 1
        self.pp_rank, self.pp_size = pp_rank, pp_size
        # Activation recomputation (model.enable_gradient_checkpointing): in training, a layer
        # keeps only its input for backward and runs again there (Megatron's "full" recompute,
        # TP/SP collectives included: every rank of the group recomputes in the same order).
        self.recompute_layers = False
        self.is_first, self.is_last = pp_rank == 0, pp_rank == pp_size - 1
        self.layer_start, self.layer_end = stage_layers(cfg.num_layers, pp_size, pp_rank)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, device, cfg.rope_scaling,
                                      cfg.max_position_embeddings)
        if cfg.rope_local_theta is not None:
            self.rotary_local = RotaryEmbedding(cfg.head_dim, cfg.rope_local_theta, device)
        if self.is_first:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp_group,
                                                       self.sp, dtype, device)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, tp_group, self.sp, dtype, device, ep_group)
            for i in range(self.layer_start, self.layer_end))
        self.value_head = None
        if self.is_last:
            self.norm = norm_class(cfg)(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
            if value_head:
                # Saved as HF's *ForTokenClassification `score` layer (num_labels=1).
                self.value_head = nn.Linear(cfg.hidden_size, 1, dtype=dtype, device=device)
            elif not (cfg.tie_word_embeddings and self.is_first):
                self.lm_head = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp_group,
                                                      False, dtype, device)

        # Replicated parameters applied to a sequence shard see only part of the tokens, and
        # q_norm / k_norm only this rank's heads: their gradients are summed over the TP group
        # (sync_sequence_parallel_grads, the optimizer's tp_group).
        for name, p in self.named_parameters():
            head_shared = tp > 1 and name.endswith(("q_norm.weight", "k_norm.weight"))
            if head_shared or (self.sp and ("norm" in name or name.startswith("value_head"))):
                p.sequence_parallel = True

    @property
    def head_weight(self) -> torch.Tensor:
        """This rank's [V_padded/tp, H] output-projection shard."""
        if hasattr(self, "lm_head"):
            return self.lm_head.weight
        return self.embed_tokens.weight

    def forward(self, packed: PackedInput, hidden: torch.Tensor | None = None,
                attn_ctx=None) -> torch.Tensor:
        """First stage: embeds packed.input_ids; later stages take `hidden` ([T/tp, H] under SP).
        Returns the residual stream after this stage's layers, normed on the last stage."""
        h = self.embed_tokens(packed.input_ids) if self.is_first else hidden
        if self.is_first and self.cfg.gemma:
            # HF rounds √hidden to the embedding dtype first (Gemma2TextScaledWordEmbedding)
            h = h * torch.tensor(self.cfg.hidden_size ** 0.5).to(h.dtype)
        tables = {False: self.rotary(packed.position_ids)}
        if hasattr(self, "rotary_local"):
            tables[True] = self.rotary_local(packed.position_ids)
        ctx = attn_ctx or PackedCausalAttention(packed)
        recompute = self.recompute_layers and self.training and torch.is_grad_enabled()
        if self.layer_groups and not recompute:     # compiled units (train.compile_layers)
            for group in self.layer_groups:
                h = group(h, tables, ctx)
        else:
            for layer in self.layers:
                cos, sin = tables[layer.local_rope]
                if recompute:
                    h = checkpoint(layer, h, cos, sin, ctx, use_reentrant=False)
                else:
                    h = layer(h, cos, sin, ctx)
        return self.norm(h) if self.is_last else h

    # --- heads (last stage) -------------------------------------------------------------------
    def logits_local(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T(/tp), H] -> this rank's vocabulary slice of the logits, [T, V_padded/tp]."""
        x = gather_from_sp(hidden, self.tp_group) if self.sp else copy_to_tp(hidden, self.tp_group)
        # the soft-cap is elementwise: it commutes with the vocabulary sharding
        return softcap(nn.functional.linear(x, self.head_weight), self.cfg.final_softcap)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits [T, V] (gathers the vocabulary: tests and sampling only)."""
        local = self.logits_local(hidden)
        full = all_gather_dim0(local.t().contiguous(), self.tp_group).t()
        return full[:, : self.cfg.vocab_size]

    def logprob_entropy(self, hidden, targets, temperature: float = 1.0, rows=None):
        """Per-token log p(targets) and entropy [T], without gathering the vocabulary; the head
        GEMM is fused in chunks of the vocabulary, so the [T, V] logits never exist in full.
        rows: the only positions computed (others 0). A final soft-cap (Gemma 2) is applied to
        each chunk of logits in turn."""
        return fused_linear_logprob_entropy(hidden, self.head_weight, targets, self.tp_group,
                                            self.cfg.vocab_size, temperature, self.sp,
                                            rows=rows, softcap=self.cfg.final_softcap)

    def values(self, hidden: torch.Tensor) -> torch.Tensor:
        """Scalar value per token [T] (critic)."""
        v = self.value_head(hidden).squeeze(-1)
        return gather_from_sp_copy(v, self.tp_group) if self.sp else v
