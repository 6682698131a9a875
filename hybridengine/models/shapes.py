"""Model shapes that benchmarks and tests build with random weights (no files needed)."""
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
