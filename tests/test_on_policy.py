"""pi_old from the update's own forward. The first mini-batch of an update starts from the policy
that pi_old is, so its forward, detached, is pi_old (the ratio is exactly 1), and the separate
old-log-prob forward skips its rows; on-policy (one mini-batch, one epoch) that is the whole batch
and the forward does not run, as verl's dp_actor does (old_log_prob = log_prob.detach()). Proven
against the longer way round: every row's pi_old from the separate forward (the same update up to
fp32 rounding, and the same pi_old)."""
import pytest
import torch

from hybridengine.rl.memory import old_log_prob_runs
from test_temperature import tiny_trainer


def _trainer(tmp_path, *overrides):
    torch.manual_seed(0)
    # two training micro-batches against the scoring pass's one
    trainer = tiny_trainer(tmp_path, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=6",
                           *overrides)
    advantages = trainer._advantages

    def random_advantages(batch):
        # the tiny reward often ties a whole group (GRPO advantages 0: no gradient to compare);
        # seeded ones make the policy loss, and so pi_old, matter
        metrics = advantages(batch)
        g = torch.Generator().manual_seed(7)
        adv = torch.randn(batch.response_mask.shape, generator=g)
        batch.tensors["advantages"] = adv * batch.response_mask
        return metrics
    trainer._advantages = random_advantages
    return trainer


def _step(trainer):
    """One step: its metrics, the batch it trained on, the actor's weights after it (and before
    it, as trainer.before) and the row counts the old-log-prob forward scored (trainer.scored)."""
    seen, trainer.scored = {}, []
    update, score = trainer.actor.update, trainer.actor.score

    def spy(batch, *args):
        seen["batch"] = batch
        seen["before"] = _weights(trainer)
        return update(batch, *args)

    def scoring(batch, key):
        trainer.scored.append(len(batch))
        return score(batch, key)
    trainer.actor.update, trainer.actor.score = spy, scoring
    metrics = trainer.train_step(1, [0, 1, 2, 3], lambda: None)
    trainer.before = seen["before"]
    return metrics, seen["batch"], _weights(trainer)


def _weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.actor.engine.model.state_dict().items()}


def _same_update(full, w_fast, w_full):
    assert any((w_fast[k] - full.before[k]).abs().max() > 0 for k in w_fast)
    for k in w_fast:
        moved = (w_fast[k] - full.before[k]).abs().max()
        assert (w_fast[k] - w_full[k]).abs().max() <= 1e-3 * moved + 1e-7, k


def _same_old_logprobs(b_fast, b_full):
    assert [r for r in b_fast.response_ids] == [r for r in b_full.response_ids]
    mask = b_fast.response_mask.bool()
    gap = (b_fast.tensors["old_logprob"] - b_full.tensors["old_logprob"])[mask].abs().max()
    assert mask.sum() > 20 and gap.item() <= 1e-5


def test_on_policy_update_reuses_its_forward_exactly(tmp_path):
    fast = _trainer(tmp_path / "fast")
    assert fast.actor.first_mini_batch(12, 3, seed=1) == list(range(12))
    m_fast, b_fast, w_fast = _step(fast)
    assert fast.scored == [] and not old_log_prob_runs(fast.cfg)     # nor does the memory plan
    assert "timing_s/old_log_prob" not in m_fast and "perf/mfu/old_log_prob" not in m_fast
    assert m_fast["actor/ppo_kl"] == 0.0 and m_fast["actor/pg_clipfrac"] == 0.0   # ratio 1

    # every row's pi_old from the separate forward: the same update, pi_old and metrics
    full = _trainer(tmp_path / "full")
    full._old_logprob_from_update = lambda _num: False
    m_full, b_full, w_full = _step(full)
    assert full.scored == [12] and "timing_s/old_log_prob" in m_full
    _same_update(full, w_fast, w_full)
    _same_old_logprobs(b_fast, b_full)
    for k in ("training/rollout_probs_diff_max", "rollout_corr/k3_kl"):
        assert m_fast[k] == pytest.approx(m_full[k], abs=1e-5), k


@pytest.mark.parametrize("overrides, own", [
    (["actor_rollout_ref.actor.ppo_mini_batch_size=2"], 6),        # two mini-batches: the first
    (["actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_epochs=2",
      "actor_rollout_ref.actor.shuffle=true"], 6),                 # ... shuffled, seen again
    (["actor_rollout_ref.actor.ppo_epochs=2"], 12)])               # one an epoch: all, again
def test_first_mini_batch_takes_pi_old_from_its_forward(tmp_path, overrides, own):
    """Off-policy after the first optimizer step: the old-log-prob forward scores the rows of
    the later mini-batches only, and the update (its later epochs included) equals the one
    whose pi_old all came from that forward."""
    fast = _trainer(tmp_path / "fast", *overrides)
    first = fast.actor.first_mini_batch(12, 3, seed=1)
    assert len(first) == own and len(set(first)) == own
    m_fast, b_fast, w_fast = _step(fast)
    assert fast.scored == ([12 - own] if own < 12 else [])
    assert old_log_prob_runs(fast.cfg) == (own < 12)        # the memory plan's phases agree
    assert ("perf/mfu/old_log_prob" in m_fast) == (own < 12)

    full = _trainer(tmp_path / "full", *overrides)
    full._old_logprob_from_update = lambda _num: False
    m_full, b_full, w_full = _step(full)
    assert full.scored == [12]
    _same_update(full, w_fast, w_full)
    _same_old_logprobs(b_fast, b_full)
    assert m_fast["actor/pg_loss"] == pytest.approx(m_full["actor/pg_loss"], abs=1e-6)
    if own < 12:   # the old-log-prob forward's FLOPs: its rows only
        ratio = m_fast["perf/mfu/old_log_prob"] * m_fast["timing_s/old_log_prob"] / \
            (m_full["perf/mfu/old_log_prob"] * m_full["timing_s/old_log_prob"])
        assert 0.2 < ratio < 0.8


@pytest.mark.parametrize("override", ["algorithm.use_kl_in_reward=true",
                                      "algorithm.rollout_correction.rollout_is=token"])
def test_old_logprobs_have_their_forward_when_read_before_the_update(tmp_path, override):
    """KL in the reward and the rollout importance weights read pi_old before the update."""
    trainer = _trainer(tmp_path, override)
    assert not trainer._old_logprob_from_update(1) and old_log_prob_runs(trainer.cfg)
