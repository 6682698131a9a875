"""Cases of the vLLM rollout backend (CPU build) on the mixture-of-experts families (issue 29):
a tiny Qwen3-MoE (a dense layer among sparse ones, tied) and a tiny Mixtral (untied). vLLM loads the
model directory; after a training step our HF weight stream delivers the experts under the names
vLLM's loaders take (mlp.experts.{e}.gate_proj/up_proj/down_proj, mlp.gate; Mixtral's
block_sparse_moe.experts.{e}.w1/w2/w3, block_sparse_moe.gate). Greedy outputs equal the built-in
engine's before and after the step and Hugging Face's after it, sampled-token log-probs equal
the training forward's (test_vllm's parity check, rollout TP 1). Without the reload fix of
rollout.vllm (_moe_reload_as_first_load) the greedy tokens differ from the first sync on: vLLM 0.32
leaves the reloaded experts unpacked on CPU. Run by tests/test_vllm_families.py's test, in its
process (one vLLM import for every family)."""
import torch

from test_vllm import _parity_rank

VOCAB = 97


def save_moe_hd32(path, family: str, seed: int = 0) -> str:
    """hidden 64, 4 heads x head_dim 32 (vLLM's CPU attention takes no smaller), 2 K/V heads,
    4 experts of 32 hidden units, top 2; weights spread so that every expert is routed to."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, \
        Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                  rms_norm_eps=1e-6, num_experts_per_tok=2,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if family == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
            intermediate_size=48, moe_intermediate_size=32, num_experts=4, norm_topk_prob=False,
            mlp_only_layers=[1], tie_word_embeddings=True, **common))
    else:
        model = MixtralForCausalLM(MixtralConfig(intermediate_size=32, num_local_experts=4,
                                                 tie_word_embeddings=False, **common))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.15)
    model.save_pretrained(str(path))
    return str(path)


def _moe_rank(rank, world, dirs):
    """Per family: test_vllm's parity check, its training step asserted to move every expert
    weight (all are routed to); first, the MoE line of check_model."""
    import dataclasses

    import pytest

    import test_vllm
    from hybridengine.models.hf import read_model_config
    from hybridengine.rollout.vllm import check_model
    cfg = read_model_config(dirs[0])
    check_model(cfg)
    with pytest.raises(ValueError, match="CPU MoE kernel needs hidden_size divisible by 32"):
        check_model(dataclasses.replace(cfg, hidden_size=48))
    step = test_vllm._train_step

    def step_moving_experts(actor, prompts):
        before = {n: p.detach().clone() for n, p in actor.model.named_parameters()
                  if ".experts." in n}
        step(actor, prompts)
        now = dict(actor.model.named_parameters())
        assert before and all(not torch.equal(now[n], t) for n, t in before.items())
    test_vllm._train_step = step_moving_experts      # _parity_rank's (this spawned process)
    for model_dir in dirs:      # one process: vLLM is imported once, an engine per family
        _parity_rank(rank, world, model_dir, model_dir)

