"""A mixture-of-experts model through the trainer: the 2-step GRPO run of test_model_families_e2e
(`torchrun --nproc_per_node=2 launch/ppo.py`, actor tp 2 with sequence parallelism, rollout tp 1)
on test_moe_model's tiny Qwen3-MoE (sparse and dense layers) with stories260K's tokenizer; the
switch bytes as HybridFlow's formula says, within the replicated router and norms (1%); the
router losses on, their metrics logged. Mixtral differs only in its HF names and router rounding
(test_moe_model covers both)."""
import pytest

import test_model_families as base
import test_moe_model as moe
from hybridengine.models.hf import read_model_config
from test_model_families_e2e import grpo_two_steps, with_stories_tokenizer


@pytest.mark.multiproc
def test_qwen3_moe_grpo_two_steps_tp2_to_rollout_tp1(tmp_path, monkeypatch):
    monkeypatch.setattr(base, "VOCAB", 512)         # stories260K's vocabulary
    monkeypatch.setattr(moe, "VOCAB", 512)
    model_dir = with_stories_tokenizer(moe.moe_hf_model("qwen3_moe"), tmp_path / "qwen3_moe")
    rows = grpo_two_steps(tmp_path, model_dir, "actor_rollout_ref.actor.router_aux_loss_coef=0.01",
                          "actor_rollout_ref.actor.router_z_loss_coef=0.001")
    cfg = read_model_config(model_dir)
    assert cfg.num_experts == 4 and cfg.vocab_size == 512
    assert [r["step"] for r in rows] == [1, 2]
    formula = (2 - 1) / (1 * 2) * cfg.num_params() * 4                  # fp32 rollout
    for r in rows:
        moved = r["reshard/bytes_per_rank"]
        assert abs(moved - formula) <= 0.01 * formula, (r["step"], moved, formula)
        assert r["response_length/mean"] > 0 and r["actor/grad_norm"] > 0, r
        # the router losses, averaged over the MoE layers: E·Σ f·P is top_k (2) when balanced,
        # E·top_k (8) at worst
        assert 1.0 <= r["actor/moe/load_balancing_loss"] < 8 and r["actor/moe/z_loss"] > 0, r


@pytest.mark.multiproc
def test_qwen3_moe_grpo_two_steps_expert_parallel_2(tmp_path, monkeypatch):
    """Actor (and reference) at tp 1, dp 2, expert_model_parallel_size 2: each rank holds 2 of
    the 4 experts, tokens by all-to-all; the switch to rollout tp 1 moves only the other rank's
    experts (hybrid.experts: the dense weights are the generation weights, zero-copy)."""
    monkeypatch.setattr(base, "VOCAB", 512)
    monkeypatch.setattr(moe, "VOCAB", 512)
    model_dir = with_stories_tokenizer(moe.moe_hf_model("qwen3_moe"), tmp_path / "qwen3_moe")
    rows = grpo_two_steps(tmp_path, model_dir,
                          "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
                          "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
                          "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                          "actor_rollout_ref.actor.router_aux_loss_coef=0.01")
    cfg = read_model_config(model_dir)
    sparse = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:       # fp32: the other EP rank's 2 experts of every sparse layer
        assert r["reshard/bytes_per_rank"] == sparse * 2 * expert * 4, r
        assert r["response_length/mean"] > 0 and r["actor/grad_norm"] > 0, r
        assert 1.0 <= r["actor/moe/load_balancing_loss"] < 8, r
