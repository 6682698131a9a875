"""Model shapes that benchmarks and tests build with random weights (no files needed).

The family shapes are their checkpoints' config.json values (published parameter counts in the
comments; tests/test_bench_families.py checks them against transformers). SHAPES names each
with a CPU smoke-test shape of the same family: every feature on, tiny sizes.
"""
from dataclasses import replace

from hybridengine.models.decoder import ModelConfig

# Qwen2.5-0.5B: 494,032,768 parameters.
QWEN2_5_0_5B = ModelConfig(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                           num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
                           rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True,
                           attention_bias=True, max_position_embeddings=32768,
                           model_type="qwen2")
# Qwen2.5-7B.
QWEN2_5_7B = ModelConfig(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                         num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128,
                         rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False,
                         attention_bias=True, max_position_embeddings=32768, model_type="qwen2")
# A CPU smoke-test shape of the same family.
TINY = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True,
                   attention_bias=True, max_position_embeddings=1024, model_type="qwen2")
# Qwen3-0.6B: 596,049,920 parameters. Per-head q/k RMSNorm, head_dim 128 != 1024 / 16.
QWEN3_0_6B = ModelConfig(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                         num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                         rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True,
                         max_position_embeddings=40960, model_type="qwen3", qk_norm=True)
# Qwen3-1.7B: 1,720,574,976 parameters.
QWEN3_1_7B = replace(QWEN3_0_6B, hidden_size=2048, intermediate_size=6144)
# Gemma-2-2B: 2,614,341,888 parameters. Sliding (4096) and full layers alternate, the first
# sliding; attention- and final-logit soft-caps 50 / 30; queries scaled by 256^-1/2.
GEMMA2_2B = ModelConfig(vocab_size=256000, hidden_size=2304, intermediate_size=9216,
                        num_layers=26, num_heads=8, num_kv_heads=4, head_dim=256,
                        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True,
                        max_position_embeddings=8192, model_type="gemma2",
                        sliding_window=4096,
                        layer_types=("sliding_attention", "full_attention") * 13,
                        attn_softcap=50.0, final_softcap=30.0, query_pre_attn_scalar=256,
                        hidden_act="gelu_pytorch_tanh")

# Issue 29's MoE benchmark shape, Qwen3-MoE style: 64 experts 256 wide, top 8 (1.06B
# parameters, 0.21B active besides the embedding); beside it the dense model of the same active
# width (8 x 256 = 2048).
QWEN3_MOE_1B = replace(QWEN3_0_6B, num_layers=16, intermediate_size=2048, model_type="qwen3_moe",
                       num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256,
                       norm_topk_prob=True)
QWEN3_DENSE_ACTIVE = replace(QWEN3_0_6B, num_layers=16, intermediate_size=2048)


def tiny_of(cfg: ModelConfig) -> ModelConfig:
    """cfg's family at TINY's sizes: 2 layers (one sliding, one full where the family
    alternates), a window of 8 keys, Gemma's query scale at the tiny head_dim."""
    return replace(cfg, vocab_size=TINY.vocab_size, hidden_size=TINY.hidden_size,
                   intermediate_size=TINY.intermediate_size, num_layers=2,
                   num_heads=TINY.num_heads, num_kv_heads=TINY.num_kv_heads,
                   head_dim=TINY.head_dim, max_position_embeddings=TINY.max_position_embeddings,
                   sliding_window=None if cfg.sliding_window is None else 8,
                   layer_types=cfg.layer_types[:2],
                   query_pre_attn_scalar=None if cfg.query_pre_attn_scalar is None
                   else TINY.head_dim,
                   num_experts=min(cfg.num_experts, 4), num_experts_per_tok=min(
                       cfg.num_experts_per_tok, 2), moe_intermediate_size=min(
                       cfg.moe_intermediate_size, 32))


# --model name -> (the shape, its CPU smoke-test shape)
SHAPES = {"qwen2.5-0.5b": (QWEN2_5_0_5B, TINY), "qwen2.5-7b": (QWEN2_5_7B, TINY),
          "qwen3-0.6b": (QWEN3_0_6B, tiny_of(QWEN3_0_6B)),
          "qwen3-1.7b": (QWEN3_1_7B, tiny_of(QWEN3_1_7B)),
          "gemma2-2b": (GEMMA2_2B, tiny_of(GEMMA2_2B)),
          "qwen3-moe-1b": (QWEN3_MOE_1B, tiny_of(QWEN3_MOE_1B)),
          "qwen3-dense-active": (QWEN3_DENSE_ACTIVE, tiny_of(QWEN3_DENSE_ACTIVE))}
