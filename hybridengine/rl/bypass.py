"""verl's bypass mode (algorithm.rollout_correction.bypass_mode=true): pi_old is pi_rollout.

The old-log-prob forward is skipped: the rollout's own sampling log-probs stand for pi_old
(two policies, pi_rollout and pi_theta, instead of three), and the policy loss is verl's
``bypass_mode`` one whatever actor.policy_loss.loss_mode says (config checks ask for vanilla):

    loss_type=ppo_clip   PPO's clipped surrogate with r = pi_theta / pi_rollout (the clip bounds
                         the importance ratio; no IS weight on top: it would count it twice)
    loss_type=reinforce  -A log pi_theta, times the truncated IS weight pi_theta / pi_rollout
                         (detached) where rollout_is is set (token or sequence)

Per micro-batch, as verl computes them in the loss: the IS weights and the rollout_corr/
metrics (the weights' statistics, and pi_theta against pi_rollout: KL, perplexities, chi^2),
from the current policy's log-probs. rollout_is_batch_normalize is refused with bypass mode
(verl normalises each micro-batch over every rank, a collective per micro-batch that ranks with
different micro-batch counts cannot match). On-policy (one mini-batch, one epoch) verl's actor
replaces pi_old by pi_theta itself (detached), so the ratio and the weights are exactly 1:
rl.roles does the same.
"""
from __future__ import annotations

import torch

from hybridengine.config.checks import BYPASS_LOSS_TYPES as LOSS_TYPES
from hybridengine.rl.losses import GlobalBatchInfo, PolicyLossConfig, compute_policy_loss_vanilla
from hybridengine.rl.masked_stats import masked_mean
from hybridengine.rl.rollout_correction import RolloutCorrectionConfig, \
    compute_offpolicy_metrics, compute_rollout_is_weights, rollout_logprobs_known

CORR_PREFIX = "rollout_corr/"     # metrics logged under verl's prefix, not the actor's


def bypass_policy_loss(correction: RolloutCorrectionConfig, loss_type: str):
    """The bypass mode's policy loss, with rl.losses' policy-loss signature; its
    old_log_prob is pi_rollout (the batch's old_logprob, filled from the rollout)."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"algorithm.rollout_correction.loss_type={loss_type!r}: choose one of "
                         f"{', '.join(LOSS_TYPES)}")
    if correction.rollout_is_batch_normalize:
        raise ValueError("algorithm.rollout_correction.rollout_is_batch_normalize=true is not "
                         "supported with bypass_mode=true")

    def loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
             config=PolicyLossConfig(), batch_info=GlobalBatchInfo(), rollout_is_weights=None, generator=None):
        rollout_log_prob = old_log_prob
        with torch.no_grad():
            current = log_prob.detach()
            metrics = compute_offpolicy_metrics(current, rollout_log_prob, response_mask)
            weights = None
            if correction.rollout_is is not None:
                weights, is_metrics = compute_rollout_is_weights(
                    current - rollout_log_prob, response_mask, correction.rollout_is,
                    correction.rollout_is_threshold)
                metrics.update(is_metrics)
        metrics = {CORR_PREFIX + k: v for k, v in metrics.items()}
        if loss_type == "ppo_clip":
            pg_loss, pg_metrics = compute_policy_loss_vanilla(
                rollout_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                batch_info)
        else:
            pg_losses = -advantages * log_prob
            if weights is not None:
                pg_losses = pg_losses * weights
            pg_loss = batch_info.agg(pg_losses, response_mask, loss_agg_mode)
            pg_metrics = {"ppo_kl": masked_mean(rollout_log_prob - current, response_mask)}
        return pg_loss, {**pg_metrics, **metrics}
    return loss


def bypass_old_logprob(batch) -> torch.Tensor:
    """pi_old in bypass mode: a copy of the rollout's sampling log-probs [B, R], which the rollout
    must have reported on every response token."""
    if not rollout_logprobs_known(batch):
        raise ValueError("algorithm.rollout_correction.bypass_mode=true needs the rollout's "
                         "sampling log-probs, which this rollout backend did not report")
    return batch.tensors["rollout_logprob"].clone()
