"""On-policy updates (one mini-batch, one epoch) take pi_old from the update's own forward, as
verl's dp_actor does (old_log_prob = log_prob.detach(): the ratio is exactly 1), and the trainer
then skips the separate old-log-prob forward. Proven against the two longer ways round: the
forward kept (same loss: bit for bit), and the off-policy loss on the recomputed log-probs (the
same update up to fp32 rounding)."""
import pytest
import torch

from test_temperature import tiny_trainer


def _trainer(tmp_path, *overrides):
    torch.manual_seed(0)
    # two training micro-batches against the scoring pass's one
    return tiny_trainer(tmp_path, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=6",
                        *overrides)


def _step(trainer):
    """One step; its metrics, the batch it trained on and the actor's weights after it (and
    before it, as seen["before"])."""
    seen = {}
    update = trainer.actor.update

    def spy(batch, n, seed):
        seen["batch"] = batch
        seen["before"] = _weights(trainer)
        return update(batch, n, seed)
    trainer.actor.update = spy
    metrics = trainer.train_step(1, [0, 1, 2, 3], lambda: None)
    trainer.before = seen["before"]
    return metrics, seen["batch"], _weights(trainer)


def _weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.actor.engine.model.state_dict().items()}


def test_on_policy_update_reuses_its_forward_exactly(tmp_path):
    fast = _trainer(tmp_path / "fast")
    assert fast.actor.on_policy(12, 3) and not fast.actor.on_policy(13, 3)
    m_fast, b_fast, w_fast = _step(fast)
    assert "timing_s/old_log_prob" not in m_fast and "perf/mfu/old_log_prob" not in m_fast
    assert m_fast["actor/ppo_kl"] == 0.0 and m_fast["actor/pg_clipfrac"] == 0.0   # ratio 1

    # the separate forward kept, the same (on-policy) loss: the same step bit for bit
    kept = _trainer(tmp_path / "kept")
    kept._old_logprob_from_update = lambda n: False
    m_kept, b_kept, w_kept = _step(kept)
    assert "timing_s/old_log_prob" in m_kept
    assert [r for r in b_fast.response_ids] == [r for r in b_kept.response_ids]
    assert all(torch.equal(w_fast[k], w_kept[k]) for k in w_fast)
    # pi_old from the update's forward is the scoring forward's, and so are its metrics
    mask = b_fast.response_mask.bool()
    gap = (b_fast.tensors["old_logprob"] - b_kept.tensors["old_logprob"])[mask].abs().max()
    assert mask.sum() > 20 and gap.item() <= 1e-5
    for k in ("training/rollout_probs_diff_max", "rollout_corr/k3_kl"):
        assert m_fast[k] == pytest.approx(m_kept[k], abs=1e-5), k

    # off-policy: the loss's pi_old is the recomputed forward's (on this CPU the same bits as
    # the update's forward, other micro-batches notwithstanding; elsewhere up to rounding)
    off = _trainer(tmp_path / "off")
    off.actor.on_policy = lambda num_sequences, n: False
    _, _, w_off = _step(off)
    for k in w_fast:
        moved = (w_fast[k] - off.before[k]).abs().max()
        assert (w_fast[k] - w_off[k]).abs().max() <= 1e-3 * moved + 1e-7, k


@pytest.mark.parametrize("override", ["algorithm.use_kl_in_reward=true",
                                      "algorithm.rollout_correction.rollout_is=token",
                                      "actor_rollout_ref.actor.ppo_epochs=2",
                                      "actor_rollout_ref.actor.ppo_mini_batch_size=2"])
def test_old_logprobs_have_their_forward_when_read_before_or_off_policy(tmp_path, override):
    """KL in the reward and the rollout importance weights read pi_old before the update; two
    epochs or two mini-batches are off-policy after the first optimizer step."""
    trainer = _trainer(tmp_path, override)
    assert not trainer._old_logprob_from_update(12)
