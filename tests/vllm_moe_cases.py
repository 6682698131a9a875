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
    """test_moe_model's MoE models at vLLM's sizes: hidden 64, head_dim 32 (vLLM's CPU attention
    takes no smaller; its CPU MoE kernel a hidden size divisible by 32), 2 layers, 4 experts of
    32 units, top 2."""
    from test_moe_model import moe_hf_model
    model = moe_hf_model(family, seed, hidden=64, layers=2, head_dim=32, ffn=32, dense_ffn=48,
                         vocab=VOCAB, max_positions=256)
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
        now = dict(actor.model.named_parameters())      # stacked: every expert of each
        assert before and all(not torch.equal(now[n][e], t[e]) for n, t in before.items()
                              for e in range(t.shape[0]))
    test_vllm._train_step = step_moving_experts      # _parity_rank's (this spawned process)
    for model_dir in dirs:      # one process: vLLM is imported once, an engine per family
        _parity_rank(rank, world, model_dir, model_dir)

