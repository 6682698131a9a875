"""verl's algorithm zoo through the trainer: 3 GRPO-style steps of the tiny job (stories260K,
one process, CPU) with each advantage estimator, each policy-loss mode, the rollout
importance-sampling correction and verl's bypass mode; every step logs verl's metric names with finite values."""
import math
from pathlib import Path

import pytest

from hybridengine.config import load_config
from hybridengine.rl.rewards import register_reward_fn
from hybridengine.rl.tracking import read_metrics

ROOT = Path(__file__).resolve().parent.parent

# verl's names (dp_actor / ray_trainer) that every actor update reports
ACTOR_METRICS = ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/lr", "actor/kl_loss",
                 "critic/score/mean", "critic/rewards/mean", "critic/advantages/mean",
                 "critic/returns/mean", "response_length/mean", "timing_s/gen",
                 "timing_s/update_actor", "timing_s/step")

# and those of the policy-loss mode, as verl's loss functions report them
CLIP_METRICS = ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower")
MODE_METRICS = {"clip_cov": ("actor/pg_clipfrac", "actor/ppo_kl"), "kl_cov": ("actor/ppo_kl",),
                "gpg": (), "bypass_reinforce": ("actor/ppo_kl",)}

RUNS = {
    # advantage estimators
    "remax": ["algorithm.adv_estimator=remax"],
    "reinforce_plus_plus_baseline": ["algorithm.adv_estimator=reinforce_plus_plus_baseline"],
    "opo": ["algorithm.adv_estimator=opo"],
    "grpo_passk": ["algorithm.adv_estimator=grpo_passk"],
    "gpg_estimator": ["algorithm.adv_estimator=gpg"],
    # policy-loss modes
    "gspo": ["actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
             "actor_rollout_ref.actor.clip_ratio_low=0.0003",
             "actor_rollout_ref.actor.clip_ratio_high=0.0004"],
    "clip_cov": ["actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov"],
    "kl_cov": ["actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov"],
    "gpg": ["actor_rollout_ref.actor.policy_loss.loss_mode=gpg", "algorithm.adv_estimator=gpg"],
    # Dr. GRPO aggregation; rollout-vs-training importance sampling at both levels
    "dr_grpo": ["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm",
                "algorithm.norm_adv_by_std_in_grpo=false"],
    "tis_token": ["algorithm.rollout_correction.rollout_is=token",
                  "actor_rollout_ref.rollout.temperature=0.8"],
    "tis_sequence": ["algorithm.rollout_correction.rollout_is=sequence"],
    # verl's bypass mode: pi_old = pi_rollout, no old-log-prob forward (rl.bypass)
    "bypass_ppo_clip": ["algorithm.rollout_correction.bypass_mode=true"],
    "bypass_reinforce": ["algorithm.rollout_correction.bypass_mode=true",
                         "algorithm.rollout_correction.loss_type=reinforce",
                         "algorithm.rollout_correction.rollout_is=sequence",
                         "actor_rollout_ref.rollout.temperature=0.8"],
}


@register_reward_fn("test_vowel_share")
def vowel_share(outputs, *, prompts, ground_truths, data_sources, extra_infos):
    """A dense reward (16-token stories rarely use the default job's keywords, which would
    leave every group uniform and every advantage zero), through the registry API."""
    return [sum(c in "aeiou" for c in o) / max(len(o), 1) for o in outputs]


def _fit(tmp_path, overrides):
    from hybridengine.rl.trainer import Trainer
    cfg = load_config(["--config", str(ROOT / "configs" / "tiny.yaml"),
                       f"data.train_files={ROOT / 'data/stories_keywords/train.jsonl'}",
                       "data.val_files=null", f"actor_rollout_ref.model.path={ROOT / 'models/stories260k'}",
                       "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
                       "data.train_batch_size=4", "actor_rollout_ref.rollout.n=4",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                       "data.max_response_length=16", "trainer.total_training_steps=3",
                       "custom_reward_function.name=test_vowel_share",
                       "trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.logger=[]",
                       f"trainer.default_local_dir={tmp_path}", *overrides])
    Trainer(cfg).fit()
    return read_metrics(tmp_path / "metrics.jsonl")


@pytest.mark.parametrize("name", sorted(RUNS))
def test_three_steps(tmp_path, name):
    records = [r for r in _fit(tmp_path, RUNS[name]) if r["step"] > 0]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        missing = [k for k in ACTOR_METRICS + MODE_METRICS.get(name, CLIP_METRICS) if k not in r]
        assert not missing, f"{name}: step {r['step']} lacks {missing}"
        bad = {k: v for k, v in r.items() if v is None or (isinstance(v, float) and not math.isfinite(v))}
        assert not bad, f"{name}: non-finite metrics {bad}"
    for r in records:
        assert r["actor/grad_norm"] > 0
        if name.startswith(("tis", "bypass")):
            assert any(k.startswith("rollout_corr/") for k in r), sorted(r)
        assert ("timing_s/old_log_prob" in r) != name.startswith("bypass")
