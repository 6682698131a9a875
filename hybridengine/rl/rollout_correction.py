"""Rollout-vs-training importance sampling (verl's algorithm.rollout_correction, decoupled mode).

The rollout engine samples from pi_rollout (its own kernels, precision and batching) and reports
each sampled token's log-prob under it (batch.tensors["rollout_logprob"], rl.rollout); PPO's
ratio is taken against pi_old, the trainer's recomputation (old_logprob). The importance weight
pi_old / pi_rollout corrects the policy gradient for that mismatch, truncated from above (TIS):

    token     w_it = min(exp(clamp(d_it, -20, 20)), threshold)          d = log pi_old - log pi_rollout
    sequence  w_i  = min(exp(clamp(sum_t d_it, -20, 20)), threshold)    on every token of sequence i

zero outside the mask, detached, and with ``rollout_is_batch_normalize`` divided by their batch
mean (over tokens, or over sequences). They are computed once per step on the whole batch (every
rank holds it, so no collective is needed), stored as batch.tensors["rollout_is_weights"] and
multiply the per-token policy loss of every loss mode (rl.losses). Metrics carry verl's names
under "rollout_corr/": the weights' statistics (before truncation, as verl) when rollout_is is
set, and the off-policy diagnostics (KL, perplexities, chi^2) whenever the rollout log-probs are
known (verl logs them whenever the rollout reports log-probs). Where the actor updates, its
own diagnostics replace those: pi_theta against pi_rollout, per micro-batch (rl.roles, verl's
compute_rollout_corr_metrics_from_logprobs), as verl's trainer merges the actor's metrics last.

One deliberate difference: per-sequence statistics skip fully masked rows. verl's responses hold
at least their EOS token; ours can be empty, and an empty row is padding, not a sequence (as in
rl.losses). Bypass mode (pi_old = pi_rollout, no old-log-prob forward) is rl.bypass; rejection
sampling (rollout_rs) is not implemented (config checks reject it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hybridengine.config.checks import ROLLOUT_IS_LEVELS as IS_LEVELS
from hybridengine.rl.masked_stats import masked_mean, masked_sum, metrics_as_floats

Tensor = torch.Tensor

SAFETY_BOUND = 20.0   # |log w| cap before exp: exp(20) ~ 4.9e8


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """algorithm.rollout_correction (verl's names and defaults); rollout_is None: no weights."""

    rollout_is: str | None = None
    rollout_is_threshold: float = 2.0
    rollout_is_batch_normalize: bool = False
    bypass_mode: bool = False          # pi_old = pi_rollout, verl's bypass-mode loss (rl.bypass)
    loss_type: str = "ppo_clip"        # that loss: ppo_clip | reinforce

    @classmethod
    def from_config(cls, node) -> "RolloutCorrectionConfig":
        return cls(node.rollout_is, float(node.rollout_is_threshold),
                   bool(node.rollout_is_batch_normalize), bool(node.bypass_mode), str(node.loss_type))

    def reads_pi_old_first(self, use_kl_in_reward: bool) -> bool:
        """Whether something reads pi_old before the actor's update (the rollout importance
        weights, or algorithm.use_kl_in_reward's penalty), so that the update's own forward cannot
        give it (rl.trainer, and rl.memory's plan of the phases)."""
        return use_kl_in_reward or self.rollout_is is not None


def compute_rollout_is_weights(log_ratio: Tensor, response_mask: Tensor, rollout_is: str,
                               threshold: float, batch_normalize: bool = False) -> tuple[Tensor, dict]:
    """Truncated IS weights [B, R] from log_ratio = log pi_old - log pi_rollout [B, R], and their
    metrics (unprefixed 0-d tensors on log_ratio's device: no host sync, so that the bypass
    mode's loss can take them per micro-batch; statistics of the weights before truncation)."""
    if rollout_is not in IS_LEVELS:
        raise ValueError(f"algorithm.rollout_correction.rollout_is={rollout_is!r}: choose one of "
                         f"{', '.join(IS_LEVELS)} or null")
    if threshold <= 0:
        raise ValueError(f"algorithm.rollout_correction.rollout_is_threshold={threshold} must be > 0")
    mask = response_mask.to(log_ratio.dtype)
    if rollout_is == "token":
        log_w = log_ratio
    else:
        log_w = masked_sum(log_ratio, mask, axis=-1).unsqueeze(-1).expand_as(log_ratio)  # [B, R]
    raw = torch.where(mask.bool(), torch.exp(log_w.clamp(-SAFETY_BOUND, SAFETY_BOUND)), 0.0)
    metrics = _weight_metrics(raw, log_w[:, 0] if rollout_is == "sequence" else None, mask, threshold)
    weights = raw.clamp(max=threshold).detach()
    if batch_normalize:
        if rollout_is == "token":
            mean = masked_mean(weights, mask)
        else:
            mean = _row_mean(masked_mean(weights, mask, axis=-1), mask.bool().any(-1))
        factor = torch.where(mean > 1e-8, mean, torch.ones_like(mean))
        weights = weights / factor
        metrics["rollout_is_batch_norm_factor"] = factor
    return weights, metrics


def _row_mean(values: Tensor, rows: Tensor) -> Tensor:
    """Mean of values [B] over the rows set in `rows` [B] (0 where none is)."""
    return masked_mean(values, rows)


def _row_std(values: Tensor, rows: Tensor) -> Tensor:
    """Bessel-corrected std of values [B] over the rows set (0 with fewer than two)."""
    n = rows.to(values.dtype).sum()
    centred = values - _row_mean(values, rows)
    var = masked_sum(centred.square(), rows) / (n - 1).clamp(min=1)
    return torch.where(n > 1, var.sqrt(), torch.zeros_like(var))


def _masked_max(values: Tensor, mask: Tensor) -> Tensor:
    """Max over the masked elements (0 where the mask is empty)."""
    m = mask.bool()
    top = values.masked_fill(~m, float("-inf")).amax()
    return torch.where(m.any(), top, torch.zeros_like(top))


def _masked_min(values: Tensor, mask: Tensor) -> Tensor:
    return -_masked_max(-values, mask)


def _weight_metrics(raw: Tensor, seq_log_w: Tensor | None, mask: Tensor, threshold: float) -> dict:
    """verl's rollout_is_* statistics of the untruncated weights ``raw`` [B, R]; ``seq_log_w``
    [B]: the sequence log-weights (sequence level), whose extremes are read in log space."""
    valid, rows = mask.bool(), mask.bool().any(-1)
    lower = 1.0 / threshold
    dtype = raw.dtype
    out = {"rollout_is_mean": masked_mean(raw, mask)}
    if seq_log_w is None:
        out["rollout_is_ratio_fraction_high"] = masked_mean((raw > threshold).to(dtype), mask)
        out["rollout_is_ratio_fraction_low"] = masked_mean((raw < lower).to(dtype), mask)
        out["rollout_is_max"] = _masked_max(raw, valid)
        out["rollout_is_min"] = _masked_min(raw, valid)
    else:
        out["rollout_is_max"] = torch.exp(_masked_max(seq_log_w, rows).clamp(max=SAFETY_BOUND))
        out["rollout_is_min"] = torch.exp(_masked_min(seq_log_w, rows))
        out["rollout_is_ratio_fraction_high"] = _row_mean((seq_log_w > math.log(threshold)).to(dtype), rows)
        out["rollout_is_ratio_fraction_low"] = _row_mean((seq_log_w < math.log(lower)).to(dtype), rows)
    # spread and effective sample size of the weights clamped into [1/threshold, threshold]
    bounded = raw.clamp(lower, threshold)
    mean = masked_mean(bounded, mask)
    var = masked_mean(bounded.square(), mask) - mean.square()
    out["rollout_is_std"] = torch.where(valid.sum() > 1, var.clamp(min=0).sqrt(), torch.zeros_like(var))
    ess = 1.0 / masked_mean((bounded / mean).square(), mask)
    out["rollout_is_eff_sample_size"] = torch.where(valid.any(), ess, torch.zeros_like(ess))
    seq_mean = masked_mean(raw, mask, axis=-1)                         # [B]; rows: the sequences
    out.update(rollout_is_seq_mean=_row_mean(seq_mean, rows),
               rollout_is_seq_std=_row_std(seq_mean, rows),
               rollout_is_seq_max=_masked_max(seq_mean, rows),
               rollout_is_seq_min=_masked_min(seq_mean, rows),
               rollout_is_seq_max_deviation=_masked_max((seq_mean - 1.0).abs(), rows),
               rollout_is_seq_fraction_high=_row_mean((seq_mean > threshold).to(dtype), rows),
               rollout_is_seq_fraction_low=_row_mean((seq_mean < lower).to(dtype), rows))
    return out


def compute_offpolicy_metrics(old_log_prob: Tensor, rollout_log_prob: Tensor,
                              response_mask: Tensor) -> dict:
    """verl's off-policy diagnostics of pi_old against pi_rollout (unprefixed 0-d tensors on the
    inputs' device): KL(rollout||old) as k1 and k3, per-sequence perplexities and their log
    difference, chi^2 of the token and sequence ratios."""
    mask = response_mask.to(old_log_prob.dtype)
    rows = mask.bool().any(-1)
    log_ratio = old_log_prob - rollout_log_prob
    mean_old = masked_mean(old_log_prob, mask, axis=-1)                # [B]
    mean_rollout = masked_mean(rollout_log_prob, mask, axis=-1)
    log_ppl_diff = mean_rollout - mean_old
    rho = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    seq_log_ratio = masked_sum(log_ratio, mask, axis=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {
        "training_ppl": _row_mean(torch.exp(-mean_old), rows),
        "training_log_ppl": _row_mean(-mean_old, rows),
        "kl": masked_mean(-log_ratio, mask),
        "k3_kl": masked_mean(torch.exp(log_ratio) - log_ratio - 1, mask),
        "rollout_ppl": _row_mean(torch.exp(-mean_rollout), rows),
        "rollout_log_ppl": _row_mean(-mean_rollout, rows),
        "log_ppl_diff": _row_mean(log_ppl_diff, rows),
        "log_ppl_abs_diff": _row_mean(log_ppl_diff.abs(), rows),
        "log_ppl_diff_max": _masked_max(log_ppl_diff, rows),
        "log_ppl_diff_min": _masked_min(log_ppl_diff, rows),
        "ppl_ratio": _row_mean(torch.exp(log_ppl_diff), rows),
        "chi2_token": masked_mean(rho.square(), mask) - 1.0,
        "chi2_seq": _row_mean(torch.exp(2.0 * seq_log_ratio), rows) - 1.0,
    }


def rollout_logprobs_known(batch) -> bool:
    """The rollout reported its sampling log-prob on every response token of `batch`."""
    rollout_lp = batch.tensors.get("rollout_logprob")
    return rollout_lp is not None and not rollout_lp[batch.response_mask.bool()].isnan().any()


def apply_rollout_correction(batch, config: RolloutCorrectionConfig) -> dict[str, float]:
    """Sets batch.tensors["rollout_is_weights"] when config.rollout_is is set; returns the
    rollout_corr/ metrics. Needs old_logprob (scored) and rollout_logprob (the rollout's)."""
    t, mask = batch.tensors, batch.response_mask
    rollout_lp = t.get("rollout_logprob")
    valid = mask.bool()
    known = rollout_logprobs_known(batch)
    if config.rollout_is is not None and not known:
        raise ValueError(f"algorithm.rollout_correction.rollout_is={config.rollout_is} needs the "
                         f"rollout's sampling log-probs, which this rollout backend did not report")
    if not known or not valid.any():
        if config.rollout_is is not None:
            t["rollout_is_weights"] = torch.zeros_like(mask)
        return {}
    old_lp = t["old_logprob"].to(rollout_lp.dtype)
    metrics = compute_offpolicy_metrics(old_lp, rollout_lp, mask)
    if config.rollout_is is not None:
        weights, is_metrics = compute_rollout_is_weights(
            old_lp - rollout_lp, mask, config.rollout_is, config.rollout_is_threshold,
            config.rollout_is_batch_normalize)
        t["rollout_is_weights"] = weights
        metrics.update(is_metrics)
    return {f"rollout_corr/{k}": v for k, v in metrics_as_floats(metrics).items()}
