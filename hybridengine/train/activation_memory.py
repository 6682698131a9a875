"""Elements per token that one decoder layer saves for backward: train.memory_plan's `a`.

Counted as CUDA saves them (bf16; the packed flash-attention of models.attention keeps q, k, v,
its output and an fp32 [h, T] logsumexp), storages counted once, weights not counted. Symbols
per TP rank: H hidden, s = t with sequence parallelism else 1, q / kv / I: query / key-value /
intermediate width, d: head_dim.

Eager autograd:
  a = 2H/s + 2H + (q + 2kv) + 2(q + kv) + q + 4I + 2d: norm inputs, the gathered inputs of qkv
      and gate_up (autograd keeps them; Megatron re-gathers), qkv, rotated q/k and their swap,
      attention output, gate/up, silu(gate), their product, cos/sin in the layer's dtype; + (q +
      kv) with Qwen3's q/k norms (their inputs), + 2H/s with Gemma's two extra norms (their
      inputs). Gemma's norms (models.features.GemmaRMSNorm, a composite in fp32 on every
      device) keep the fp32 input and the fp32 x·rstd instead of their input: + 3·(4H/s + q +
      kv) (the q/k norms: Gemma 3). The CPU kernels save a little more (fp32 copies in torch's
      rms_norm).
Compiled (train.compile_layers.compile_decoder_layers, inductor's min-cut partitioner: it keeps what a
backward matmul reads anyway and recomputes the pointwise ops between):
  a_compiled = 2H/s + 2H + (q + 2kv) + (q + kv) + q + 3I + 2d: the layer input, o_proj's output
      (the MLP norm's input less the residual), the normed, gathered inputs of qkv and gate_up,
      qkv, rotated q/k (their swap recomputed), attention output, gate/up and their product
      (silu(gate) recomputed), cos/sin; + 0 with q/k norms (their outputs recomputed from qkv),
      + H/s with Gemma's sandwich norms (the MLP output, the post-MLP norm's input).
Both: K/V as the layer has them (CUDA's flash attention takes fewer K/V heads natively; until
session 23 training repeated them up to the query heads on torch 2.11, keeping q − 2kv more a
token). Not counted: fp32 statistics (a norm's rstd, the logsumexp:
4/b per norm and head, < 0.3% of `a` at Qwen2.5-0.5B).
Soft-capped attention (Gemma 2; no flash kernel caps scores): models.spec_attention's op keeps
q, k and v, as flash does (its backward recomputes the scores; nothing of size n² per sequence
is kept, tests/test_activation_memory.py), and holds one group of at most GROUP_SCORE_ELEMENTS
scores at a time: a transient of (4 + 3b) bytes a score forward, ~20 backward
(capped_group_bytes).

Measured (tests/test_activation_memory.py, CPU inductor, bf16) within 0.5% at Qwen2 / Qwen3 / Gemma 3 /
Llama shapes. The partitioner's choices depend on the joint graph and on torch._functorch.config,
not on the device (its only device branch is RNG state, unused here), so CUDA is expected to save
the same; GPU runs check it through perf/max_memory_allocated_gb/update_actor.
"""
from __future__ import annotations

from hybridengine.models.decoder import ModelConfig
from hybridengine.models.spec_attention import GROUP_SCORE_ELEMENTS


def layer_activation_elements(cfg: ModelConfig, tp: int, sp: bool,
                              compiled: bool = False) -> float:
    """a (eager) or a_compiled (compiled): elements per token one decoder layer saves for
    backward (module docstring)."""
    h, d, s = cfg.hidden_size, cfg.head_dim, tp if sp else 1
    q, kv, i = cfg.num_heads * d / tp, cfg.num_kv_heads * d / tp, cfg.intermediate_size / tp
    if compiled:
        a = 2 * h / s + 2 * h + (q + 2 * kv) + (q + kv) + q + 3 * i + 2 * d + \
            (h / s if cfg.gemma else 0)
    else:
        qk_norm = q + kv if cfg.qk_norm else 0
        sandwich = 2 * h / s if cfg.gemma else 0        # the inputs of Gemma's two extra norms
        a = 2 * h / s + 2 * h + (q + 2 * kv) + 2 * (q + kv) + q + 4 * i + 2 * d + qk_norm + \
            sandwich
        if cfg.gemma:       # each GemmaRMSNorm keeps fp32 x and x·rstd: 4 units, not 1
            a += 3 * (4 * h / s + qk_norm)
    return a


def capped_group_bytes(cfg: ModelConfig, dtype_bytes: int, backward: bool = False) -> int:
    """The transient of one group of soft-capped attention, forward or backward (module
    docstring); 0 without a soft-cap."""
    if cfg.attn_softcap is None:
        return 0
    return GROUP_SCORE_ELEMENTS * (20 if backward else 4 + 3 * dtype_bytes)
