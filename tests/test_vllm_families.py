"""The vLLM rollout backend (CPU build) on the newer model families (issue 26, acceptance 2): a
Qwen3 (q/k norms, head_dim apart from hidden / heads, tied) and a Llama 3 with llama3 RoPE
scaling (untied): greedy outputs equal the built-in engine's before and after a training step and
Hugging Face's after it, sampled-token log-probs equal the training forward's (test_vllm's
parity check, rollout TP 1). head_dim 32: vLLM's CPU attention takes no smaller."""
import torch

from dist_utils import run_dist
from test_vllm import _hf_greedy, _parity_rank, _prompts, save_tiny_hd32, vllm_ok  # noqa: F401

# frequencies below 1 / (original / low_freq_factor) are scaled: these prompts and responses
# (up to 21 positions) run past original_max_position_embeddings
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}


def save_family_hd32(path, family: str, vocab: int = 97, seed: int = 0) -> str:
    """A random Qwen3 (hidden 64, 4 x 32 query dims) or Llama 3 (hidden 128) with head_dim 32,
    4 heads, 2 K/V heads and random norm weights (q_norm / k_norm too)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  max_position_embeddings=256, rms_norm_eps=1e-6)
    if family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(
            hidden_size=64, tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(hidden_size=128, tie_word_embeddings=False,
                                             rope_parameters=LLAMA3_ROPE, **common))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
    model.save_pretrained(str(path))
    return str(path)


def _families_rank(rank, world, dirs, moe_dirs):
    for model_dir in dirs:      # one process: vLLM is imported once, an engine per family
        _parity_rank(rank, world, model_dir, model_dir)
    from vllm_moe_cases import _moe_rank
    _moe_rank(rank, world, moe_dirs)        # last: it swaps test_vllm's training step


def test_vllm_matches_builtin_and_hf_after_a_training_step(vllm_ok, tmp_path):
    """Qwen2 (test_vllm's model, at rollout TP 1 here), Qwen3, Llama 3 with llama3 scaling, and
    the MoE families (tests/vllm_moe_cases.py), in one process: one vLLM import."""
    from vllm_moe_cases import save_moe_hd32
    from transformers import AutoConfig, AutoModelForCausalLM
    dirs = [save_family_hd32(tmp_path / f, f) for f in ("qwen3", "llama3_rope")]
    # the scaling matters to these greedy tokens: without it, Hugging Face's differ
    unscaled = tmp_path / "unscaled"
    config = AutoConfig.from_pretrained(dirs[1])
    config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    AutoModelForCausalLM.from_pretrained(dirs[1], config=config).save_pretrained(str(unscaled))
    prompts = _prompts(97)
    assert _hf_greedy(dirs[1], prompts) != _hf_greedy(str(unscaled), prompts)
    moe_dirs = [save_moe_hd32(tmp_path / f, f) for f in ("qwen3_moe", "mixtral")]
    run_dist(_families_rank, 1, [save_tiny_hd32(tmp_path / "qwen2", "qwen2", tied=True), *dirs],
             moe_dirs, start_method="spawn")      # vLLM cleans its /dev/shm up at exit
