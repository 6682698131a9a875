"""One rank's parameter shapes and optimizer buckets, from the model config and the layout alone
(train.memory_plan's arithmetic of weights, gradients and master): a Decoder shard's parameters
in named_parameters() order, DistributedOptimizer's padded buckets, LoRA adapter sizes."""
from __future__ import annotations

from hybridengine.models.decoder import ModelConfig, stage_layers
from hybridengine.parallel.tensor import padded_vocab_size
from hybridengine.train.grad_buckets import GRAD_ALIGN


def stage_params(cfg: ModelConfig, tp: int, pp: int = 1, pp_rank: int = 0,
                 value_head: bool = False, vocab_rows: int | None = None, ep: int = 1):
    """[(name, shape)] of one rank's Decoder shard in named_parameters() order, layer names with
    the global layer index. vocab_rows: rows of a vocabulary shard (default the tp-padded split;
    a generation shard keeps the training padding, hybrid/plan.py). ep: one EP rank's experts
    (E/ep of them, stacked, models.moe; the same shapes on every EP rank)."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size // tp
    qkv, q = (cfg.num_heads + 2 * cfg.num_kv_heads) * d // tp, cfg.num_heads * d // tp
    rows = vocab_rows or padded_vocab_size(cfg.vocab_size, tp) // tp
    first, last = pp_rank == 0, pp_rank == pp - 1
    out = [("embed_tokens.weight", (rows, h))] if first else []
    for layer in range(*stage_layers(cfg.num_layers, pp, pp_rank)):
        n = f"layers.{layer}."
        out += [(n + "input_layernorm.weight", (h,)), (n + "self_attn.qkv_proj.weight", (qkv, h))]
        out += [(n + "self_attn.qkv_proj.bias", (qkv,))] if cfg.attention_bias else []
        out += [(n + "self_attn.o_proj.weight", (h, q))]
        out += [(n + "self_attn.q_norm.weight", (d,)), (n + "self_attn.k_norm.weight", (d,))] \
            if cfg.qk_norm else []
        out += [(n + "post_attention_layernorm.weight", (h,))]
        out += [(n + "pre_feedforward_layernorm.weight", (h,))] if cfg.gemma else []
        if cfg.is_moe_layer(layer):         # models.moe: the router whole, experts split
            e = cfg.moe_intermediate_size // tp
            out += [(n + "mlp.gate.weight", (cfg.num_experts, h))]
            local = cfg.num_experts // ep       # stacked: E/ep experts in two parameters
            out += [(n + "mlp.experts.gate_up_proj", (local, 2 * e, h)),
                    (n + "mlp.experts.down_proj", (local, h, e))]
        else:
            out += [(n + "mlp.gate_up_proj.weight", (2 * i, h)),
                    (n + "mlp.down_proj.weight", (h, i))]
        out += [(n + "post_feedforward_layernorm.weight", (h,))] if cfg.gemma else []
    if last:
        out.append(("norm.weight", (h,)))
        if value_head:
            out += [("value_head.weight", (1, h)), ("value_head.bias", (1,))]
        elif not (cfg.tie_word_embeddings and first):
            out.append(("lm_head.weight", (rows, h)))
    return out


def grad_buckets(numels: list[int], bucket_mb: float | None, num_shards: int) -> list[int]:
    """Padded element counts of DistributedOptimizer's buckets (optimizer._build_buckets, for
    parameters of one dtype and device)."""
    max_numel = int(bucket_mb * 2**20 / 4) if bucket_mb and bucket_mb > 0 else None
    sizes, size = [], 0
    for n in reversed(numels):
        start = -(-size // GRAD_ALIGN) * GRAD_ALIGN
        if not sizes or (max_numel is not None and size > 0 and start + n > max_numel):
            sizes, start = sizes + [0], 0
        size = sizes[-1] = start + n
    unit = num_shards * GRAD_ALIGN
    return [-(-s // unit) * unit for s in sizes]


def lora_numels(cfg: ModelConfig, tp: int, pp: int, pp_rank: int, rank: int,
                targets: tuple[str, ...]) -> list[int]:
    """Elements of each adapter matrix on one rank (parallel.lora: a column layer's A [r, H]
    whole and B [rows/tp, r]; a row layer's A [r, in/tp] and B [H, r] whole)."""
    h, d = cfg.hidden_size, cfg.head_dim
    rows = {"q_proj": cfg.num_heads * d, "k_proj": cfg.num_kv_heads * d,
            "v_proj": cfg.num_kv_heads * d, "gate_proj": cfg.intermediate_size,
            "up_proj": cfg.intermediate_size}
    cols = {"o_proj": cfg.num_heads * d, "down_proj": cfg.intermediate_size}
    per_layer = []
    for t in targets:
        per_layer += [rank * h, rows[t] // tp * rank] if t in rows else [rank * cols[t] // tp,
                                                                          h * rank]
    return per_layer * len(range(*stage_layers(cfg.num_layers, pp, pp_rank)))
