"""verl's bypass mode (algorithm.rollout_correction.bypass_mode): pi_old is the rollout's own
sampling log-probs, no old-log-prob forward runs, and verl's bypass-mode loss (ppo_clip or
reinforce, core_algos.compute_policy_loss_bypass_mode) takes the IS weights and the rollout_corr/
metrics per micro-batch from the current policy. The loss against a transcription of verl's on
float64 inputs; the trainer against the decoupled path with pi_old set to the rollout's."""
import pytest
import torch

from test_losses_verl import CONFIGS, MODES, D, _close, _inputs, _rollout_logprob, \
    v_agg_loss, v_is_weights, v_masked_mean, v_offpolicy, v_vanilla
from test_on_policy import _step, _trainer

from hybridengine.config import load_config, validate_config
from hybridengine.config.checks import BYPASS_LOSS_TYPES
from hybridengine.rl import bypass
from hybridengine.rl.memory import old_log_prob_runs
from hybridengine.rl.console import RunFacts
from hybridengine.rl.losses import GlobalBatchInfo
from hybridengine.rl.rollout_correction import RolloutCorrectionConfig, apply_rollout_correction

RC = "algorithm.rollout_correction."


def v_bypass(rollout, logp, adv, mask, mode, cfg, info, loss_type, level, threshold):
    """compute_policy_loss_bypass_mode (verl), transcribed: IS weights and metrics from the
    current log-probs (no_grad), then ppo_clip (vanilla, no weights) or reinforce."""
    current = logp.detach()
    metrics = {}
    weights = None
    if level is not None:
        weights, is_metrics = v_is_weights(current - rollout, mask, level, threshold, False)
        metrics.update(is_metrics)
    metrics.update(v_offpolicy(current, rollout, mask))
    metrics = {f"rollout_corr/{k}": v for k, v in metrics.items()}
    if loss_type == "ppo_clip":
        loss, pg = v_vanilla(rollout, logp, adv, mask, mode, cfg, info, None)
    else:
        pg_losses = -adv * logp * (weights if weights is not None else 1.0)
        loss = v_agg_loss(pg_losses, mask, mode, **info)
        pg = {"ppo_kl": v_masked_mean(-(logp - rollout), mask)}
    return loss, {**pg, **metrics}


def test_loss_types_match_config_choices():
    assert bypass.LOSS_TYPES == BYPASS_LOSS_TYPES


@pytest.mark.parametrize("agg_mode", MODES)
@pytest.mark.parametrize("level", [None, "token", "sequence"])
@pytest.mark.parametrize("loss_type", BYPASS_LOSS_TYPES)
def test_bypass_loss_matches_verl(loss_type, level, agg_mode):
    rollout, new, adv, mask = _inputs(seed=21)
    rollout = _rollout_logprob(rollout, seed=22)        # drifted rows, one past the +-20 bound
    rows = mask.sum(-1) > 0                             # (an empty row is padding here)
    fn = bypass.bypass_policy_loss(RolloutCorrectionConfig(level, 2.0), loss_type)
    ours_lp = new[rows].clone().requires_grad_(True)
    ref_lp = new[rows].clone().requires_grad_(True)
    loss, metrics = fn(rollout[rows], ours_lp, adv[rows], mask[rows], agg_mode,
                       CONFIGS["vanilla"], GlobalBatchInfo())
    ref, ref_metrics = v_bypass(rollout[rows], ref_lp, adv[rows], mask[rows], agg_mode,
                                CONFIGS["vanilla"], {}, loss_type, level, 2.0)
    _close(loss, ref, "loss")
    assert set(metrics) == set(ref_metrics)
    for key in metrics:
        _close(metrics[key], ref_metrics[key], key)
    loss.backward()
    ref.backward()
    _close(ours_lp.grad, ref_lp.grad, "grad")
    assert ours_lp.grad.abs().sum() > 0
    if level is not None:       # the inputs reach the truncation
        assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] > 0


def test_bypass_metrics_stay_on_the_device_without_a_sync():
    """Per micro-batch, every metric is a 0-d tensor (no .item(): a host sync per micro-batch),
    finite even for a micro-batch whose responses are all empty."""
    rollout, new, adv, mask = _inputs(seed=23)
    fn = bypass.bypass_policy_loss(RolloutCorrectionConfig("sequence", 2.0), "reinforce")
    for m in (mask, torch.zeros_like(mask)):
        loss, metrics = fn(rollout, new, adv, m, "token-mean", CONFIGS["vanilla"], GlobalBatchInfo())
        assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in metrics.values())
        assert all(torch.isfinite(v) for v in metrics.values()), metrics


def test_bypass_refuses_batch_normalized_weights():
    with pytest.raises(ValueError, match="rollout_is_batch_normalize=true is not supported"):
        bypass.bypass_policy_loss(RolloutCorrectionConfig("token", 2.0, True), "ppo_clip")


# ----------------------------------------------------------------------------- trainer

BYPASS = RC + "bypass_mode=true"
TWO_MINI = "actor_rollout_ref.actor.ppo_mini_batch_size=2"      # 2 mini-batches: off-policy


def _as_rollout(trainer):
    """The decoupled path with pi_old := the rollout's log-probs (what bypass mode means)."""
    trainer._old_logprob_from_update = lambda _num: False
    original = trainer._score

    def score(batch, timings, sync, own_rows=()):
        scored = original(batch, timings, sync, own_rows)
        batch.tensors["old_logprob"] = batch.tensors["rollout_logprob"].clone()
        return scored
    trainer._score = score
    return trainer


def test_bypass_ppo_clip_is_vanilla_against_the_rollout_logprobs(tmp_path):
    fast = _trainer(tmp_path / "bypass", TWO_MINI, BYPASS)
    m_fast, b_fast, w_fast = _step(fast)
    assert fast.scored == [] and "timing_s/old_log_prob" not in m_fast
    assert not old_log_prob_runs(fast.cfg)          # two mini-batches, no forward: the plan's too
    assert torch.equal(b_fast.tensors["old_logprob"], b_fast.tensors["rollout_logprob"])
    assert "training/rollout_probs_diff_max" not in m_fast        # verl skips it in bypass
    assert "rollout_is_weights" not in b_fast.tensors
    for key in ("rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/chi2_seq"):
        assert key in m_fast and f"actor/{key}" not in m_fast
    assert m_fast["actor/ppo_kl"] != 0.0            # the ratio is against pi_rollout

    ref = _as_rollout(_trainer(tmp_path / "ref", TWO_MINI))
    m_ref, _, w_ref = _step(ref)
    for k in w_fast:
        torch.testing.assert_close(w_fast[k], w_ref[k], rtol=0, atol=1e-7)
    for key in ("actor/pg_loss", "actor/ppo_kl", "actor/pg_clipfrac"):
        assert m_fast[key] == pytest.approx(m_ref[key], abs=1e-7), key


def test_bypass_on_policy_takes_pi_old_from_the_update_as_verl(tmp_path):
    """One mini-batch, one epoch: verl's actor replaces pi_old (here pi_rollout) by the
    update's own log-probs, detached: the ratio and the IS weights are exactly 1."""
    trainer = _trainer(tmp_path, BYPASS, RC + "loss_type=reinforce", RC + "rollout_is=token")
    assert "bypass mode (pi_old: the rollout's log-probs; reinforce loss)" in \
        RunFacts.of(trainer, 0).algorithm                # the start report says so
    metrics, batch, _ = _step(trainer)
    assert trainer.scored == []
    assert metrics["actor/ppo_kl"] == 0.0 and metrics["rollout_corr/kl"] == 0.0
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx(1.0)


def test_bypass_needs_the_rollout_logprobs(tmp_path):
    trainer = _trainer(tmp_path, TWO_MINI, BYPASS)
    collect = trainer.collector.collect

    def without_logprobs(*args):
        batch, metrics = collect(*args)
        batch.tensors["rollout_logprob"].fill_(float("nan"))
        return batch, metrics
    trainer.collector.collect = without_logprobs
    with pytest.raises(ValueError, match="bypass_mode=true needs the rollout's sampling log-probs"):
        trainer.train_step(1, [0, 1, 2, 3], lambda: None)


RECIPE = ["--config", "configs/gsm8k_qwen2_5_0_5b.yaml"]


@pytest.mark.parametrize("overrides, message", [
    ([RC + "loss_type=reinforce"], "loss_type='reinforce' needs bypass_mode=true"),
    ([RC + "loss_type=sft", BYPASS], "loss_type='sft': choose one of ppo_clip, reinforce"),
    ([BYPASS, RC + "rollout_is=token", RC + "rollout_is_batch_normalize=true"],
     "rollout_is_batch_normalize=true is not supported with bypass_mode=true"),
    ([BYPASS, "actor_rollout_ref.actor.policy_loss.loss_mode=gspo"],
     "bypass mode has its own policy loss"),
])
def test_bad_bypass_settings_are_one_line(overrides, message):
    cfg = load_config(RECIPE + overrides)
    with pytest.raises(ValueError) as info:
        validate_config(cfg, world_size=1)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_bypass_settings_are_accepted():
    cfg = load_config(RECIPE + [BYPASS, RC + "loss_type=reinforce", RC + "rollout_is=sequence"])
    validate_config(cfg, world_size=1)
    assert RolloutCorrectionConfig.from_config(cfg.algorithm.rollout_correction) == \
        RolloutCorrectionConfig("sequence", 2.0, False, True, "reinforce")


def test_actor_logs_its_policy_against_the_rollouts_per_micro_batch(tmp_path):
    """Decoupled mode, as verl's actor (compute_rollout_corr_metrics_from_logprobs): the
    rollout_corr/ drift metrics are pi_theta's against pi_rollout, a mean over the update's
    micro-batches, in place of the batch's pi_old against pi_rollout. One micro-batch of an
    on-policy update: pi_theta is pi_old, the same numbers; two mini-batches: the second's
    policy has moved."""
    whole = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=12"
    metrics, batch, _ = _step(_trainer(tmp_path / "one", whole))
    of_batch = apply_rollout_correction(batch, RolloutCorrectionConfig())
    assert "rollout_corr/k3_kl" in of_batch
    for key, value in of_batch.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    metrics, batch, _ = _step(_trainer(tmp_path / "two", TWO_MINI))
    of_batch = apply_rollout_correction(batch, RolloutCorrectionConfig())
    assert abs(metrics["rollout_corr/kl"] - of_batch["rollout_corr/kl"]) > 1e-6
