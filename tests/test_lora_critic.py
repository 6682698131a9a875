"""A LoRA critic (issue 24): critic.model.lora_rank > 0 trains adapters and the value head on a
frozen base, the memory plan counts the adapters' and the head's optimizer state, and the
checkpoint's critic/ is the merged critic, which AutoModelForTokenClassification loads."""
import torch

from hybridengine.models.lora import lora_state_dict
from hybridengine.parallel.lora import merged_weight
from test_lora import _lora_trainer


def test_lora_critic_trains_adapters_and_head_on_a_frozen_base(tmp_path):
    trainer = _lora_trainer(tmp_path / "run", "algorithm.adv_estimator=gae",
                            "actor_rollout_ref.rollout.n=1", "data.train_batch_size=8",
                            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                            "actor_rollout_ref.model.lora_rank=0", "critic.model.lora_rank=4",
                            "critic.model.lora_alpha=8", "critic.optim.lr=1e-2",
                            "critic.ppo_mini_batch_size=4", "critic.ppo_micro_batch_size_per_gpu=4",
                            "critic.megatron.tensor_model_parallel_size=1",
                            # 2 steps: the value head starts at zero, so the adapters below
                            # it get gradients once the first update has moved it
                            "trainer.total_training_steps=2", "trainer.save_freq=2",
                            "data.max_response_length=16")
    engine = trainer.critic.engine
    model = engine.model
    frozen = {n: p.detach().clone() for n, p in model.named_parameters()
              if ".lora." not in n and not n.startswith("value_head.")}
    head = model.value_head.weight.detach().clone()
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "value_head.weight" in trained and all(
        ".lora." in n or n.startswith("value_head.") for n in trained)
    trainer.fit()
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    assert not torch.equal(model.value_head.weight, head)             # the head trained
    assert any(p.abs().sum() > 0 for n, p in lora_state_dict(model).items() if ".lora_B." in n)
    # the exported critic is the merged one
    from transformers import AutoModelForTokenClassification
    out = tmp_path / "run" / "global_step_2" / "critic"
    hf = AutoModelForTokenClassification.from_pretrained(out, dtype=torch.float32)
    qkv = model.layers[0].self_attn.qkv_proj
    q = hf.model.layers[0].self_attn.q_proj.weight
    assert torch.allclose(q, merged_weight(qkv)[:q.shape[0]], atol=1e-6)
    assert torch.allclose(hf.score.weight, model.value_head.weight, atol=1e-6)
