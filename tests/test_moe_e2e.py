"""A mixture-of-experts model through the trainer: the 2-step GRPO run of test_model_families_e2e
(`torchrun --nproc_per_node=2 launch/ppo.py`, actor tp 2 with sequence parallelism, rollout tp 1)
on test_moe_model's tiny Qwen3-MoE (sparse and dense layers) with stories260K's tokenizer; the
switch bytes as HybridFlow's formula says, within the replicated router and norms (1%); the
router losses on, their metrics logged.
Mixtral differs only in its HF names and router rounding (test_moe_model covers both)."""
import os
import shutil
import subprocess
import sys

import pytest

import test_model_families as base
import test_moe_model as moe
from dist_utils import free_port
from hybridengine.models.hf import read_model_config
from hybridengine.rl.tracking import read_metrics
from model_utils import STORIES
from test_model_families_e2e import ENV, ROOT, SHORT, VOWEL_SHARE


@pytest.mark.multiproc
def test_qwen3_moe_grpo_two_steps_tp2_to_rollout_tp1(tmp_path, monkeypatch):
    monkeypatch.setattr(base, "VOCAB", 512)         # stories260K's vocabulary
    monkeypatch.setattr(moe, "VOCAB", 512)
    model_dir = str(tmp_path / "qwen3_moe")
    moe.moe_hf_model("qwen3_moe").save_pretrained(model_dir)
    for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
              "generation_config.json"):
        shutil.copy(os.path.join(STORIES, f), model_dir)
    out, reward = tmp_path / "run", tmp_path / "reward.py"
    reward.write_text(VOWEL_SHARE)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port",
           str(free_port()), str(ROOT / "launch" / "ppo.py"), "--config",
           str(ROOT / "configs" / "tiny.yaml"), f"actor_rollout_ref.model.path={model_dir}",
           f"trainer.default_local_dir={out}", f"custom_reward_function.path={reward}",
           "custom_reward_function.name=vowel_share", *SHORT,
           "actor_rollout_ref.actor.router_aux_loss_coef=0.01",
           "actor_rollout_ref.actor.router_z_loss_coef=0.001"]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    cfg = read_model_config(model_dir)
    assert cfg.num_experts == 4 and cfg.vocab_size == 512
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "actor/pg_loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    formula = (2 - 1) / (1 * 2) * cfg.num_params() * 4                  # fp32 rollout
    for r in rows:
        moved = r["reshard/bytes_per_rank"]
        assert abs(moved - formula) <= 0.01 * formula, (r["step"], moved, formula)
        assert r["response_length/mean"] > 0 and r["actor/grad_norm"] > 0, r
        # the router losses, averaged over the MoE layers: E·Σ f·P is top_k (2) when balanced,
        # E·top_k (8) at worst
        assert 1.0 <= r["actor/moe/load_balancing_loss"] < 8 and r["actor/moe/z_loss"] > 0, r
