"""PPO losses on padded response tensors: policy clip, value clip, entropy, KL, aggregation.

Inputs are ``[B, R]`` with a 0/1 ``response_mask`` (see advantages.py). Each loss returns a scalar
built by ``agg_loss``; the diagnostics it also returns (clip fractions, ppo_kl) are detached
masked means over the tensors passed in — metrics, never gradients.

Gradient-accumulation contract (micro-batches x DP ranks == one full-batch run):
    A mini-batch is split into micro-batches, spread over DP ranks. Let ``global_normalizer`` be
    the sum of ``loss_normalizer(mask_i, mode)`` over *every* micro-batch i of the mini-batch on
    *every* DP rank (sum over local micro-batches, then all-reduce SUM over the DP group). Then

        sum_i agg_loss(loss_i, mask_i, mode, global_normalizer) == agg_loss(loss, mask, mode)

    where the right side is the whole mini-batch in one process; so are the gradients. The caller
    therefore back-propagates each micro-batch loss as is (no 1/num_micro_batches scaling) and
    SUMS gradients over DP; an optimizer that averages over DP must multiply the loss by dp.
    In ``seq-mean-token-sum-norm`` pass a constant ``loss_scale_factor`` (e.g.
    max_response_length): its default, R = loss_mask.shape[-1], differs between micro-batches
    padded to different lengths.
"""

import torch

from hybridengine.rl.advantages import kl_penalty, masked_mean, masked_sum

Tensor = torch.Tensor

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
Normalizer = int | float | Tensor | None


def loss_normalizer(loss_mask: Tensor, loss_agg_mode: str) -> int:
    """This micro-batch's share of the global normaliser: valid tokens for "token-mean", else
    sequences with at least one valid token (fully masked rows are padding, not sequences)."""
    _check_mode(loss_agg_mode)
    valid = loss_mask.bool()
    if loss_agg_mode == "token-mean":
        return int(valid.sum())
    return int(valid.any(dim=-1).sum())


def agg_loss(
    loss_mat: Tensor,
    loss_mask: Tensor,
    loss_agg_mode: str,
    global_normalizer: Normalizer = None,
    loss_scale_factor: float | None = None,
) -> Tensor:
    """Aggregate a ``[B, R]`` loss into a scalar (modes as verl; normaliser: module docstring).

    token-mean               sum_{i,t} m*l / N_tokens
    seq-mean-token-sum       sum_i (sum_t m*l) / N_seqs
    seq-mean-token-mean      sum_i (sum_t m*l / sum_t m) / N_seqs
    seq-mean-token-sum-norm  sum_i (sum_t m*l) / (N_seqs * loss_scale_factor)    (Dr. GRPO)

    N_* is ``global_normalizer`` when given, else ``loss_normalizer`` of this batch. A zero
    normaliser (nothing valid anywhere) gives a zero loss that keeps the graph.
    """
    _check_mode(loss_agg_mode)
    normalizer = loss_normalizer(loss_mask, loss_agg_mode) if global_normalizer is None else global_normalizer
    denom = torch.as_tensor(normalizer, dtype=loss_mat.dtype, device=loss_mat.device).clamp(min=1)
    if loss_agg_mode == "token-mean":
        return masked_sum(loss_mat, loss_mask) / denom
    seq_sums = masked_sum(loss_mat, loss_mask, axis=-1)  # [B]
    if loss_agg_mode == "seq-mean-token-mean":
        seq_sums = seq_sums / loss_mask.to(loss_mat.dtype).sum(dim=-1).clamp(min=1)
    loss = seq_sums.sum() / denom
    if loss_agg_mode == "seq-mean-token-sum-norm":
        loss = loss / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return loss


def _check_mode(loss_agg_mode: str) -> None:
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode={loss_agg_mode!r} is unknown; choose from {LOSS_AGG_MODES}")


def compute_policy_loss(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    global_normalizer: Normalizer = None,
    loss_scale_factor: float | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """PPO clipped surrogate with clip-higher and dual-clip. Returns
    (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower).

    per token: l = max(-A r, -A clip(r, 1 - low, 1 + high)); for A < 0 also l = min(l, -A c)
    (dual-clip, Ye et al. 2020), which bounds the loss of a token whose ratio has blown up.
    ``low != high`` is DAPO's clip-higher. log r is clamped to [-20, 20] before exp (verl).
    pg_clipfrac: share of tokens where the clip bound is active; pg_clipfrac_lower: share where
    the dual clip is; ppo_kl: masked mean of old_log_prob - log_prob (k1 estimate).
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"actor.clip_ratio_c must be > 1.0 for dual-clip PPO, got {clip_ratio_c}")
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)  # [B, R]
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clip_loss = torch.maximum(unclipped, clipped)
    dual_bound = -advantages * clip_ratio_c
    negative = advantages < 0
    pg_losses = torch.where(negative, torch.minimum(clip_loss, dual_bound), clip_loss)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, global_normalizer, loss_scale_factor)
    with torch.no_grad():
        pg_clipfrac = masked_mean((clipped > unclipped).to(log_ratio.dtype), response_mask)
        pg_clipfrac_lower = masked_mean(((clip_loss > dual_bound) & negative).to(log_ratio.dtype), response_mask)
        ppo_kl = masked_mean(-log_ratio, response_mask)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


def compute_value_loss(
    vpreds: Tensor,
    returns: Tensor,
    values: Tensor,
    response_mask: Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    global_normalizer: Normalizer = None,
    loss_scale_factor: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Clipped value loss 0.5 * agg(max((v - G)^2, (clip(v, V -/+ c) - G)^2)); returns
    (vf_loss, vf_clipfrac) with vf_clipfrac the share of tokens where the clipped term wins."""
    vpred_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    loss_unclipped = (vpreds - returns) ** 2
    loss_clipped = (vpred_clipped - returns) ** 2
    vf_losses = torch.maximum(loss_unclipped, loss_clipped)
    vf_loss = 0.5 * agg_loss(vf_losses, response_mask, loss_agg_mode, global_normalizer, loss_scale_factor)
    with torch.no_grad():
        vf_clipfrac = masked_mean((loss_clipped > loss_unclipped).to(vpreds.dtype), response_mask)
    return vf_loss, vf_clipfrac


def compute_entropy_loss(
    entropy: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    global_normalizer: Normalizer = None,
    loss_scale_factor: float | None = None,
) -> Tensor:
    """Aggregated per-token entropy ``[B, R]`` (the actor subtracts entropy_coeff times this)."""
    return agg_loss(entropy, response_mask, loss_agg_mode, global_normalizer, loss_scale_factor)


def compute_kl_loss(
    log_prob: Tensor,
    ref_log_prob: Tensor,
    response_mask: Tensor,
    kl_loss_type: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
    global_normalizer: Normalizer = None,
    loss_scale_factor: float | None = None,
) -> Tensor:
    """Actor KL loss (actor.use_kl_loss): aggregated ``kl_penalty(log_prob, ref, kl_loss_type)``;
    the actor adds kl_loss_coef times this."""
    kld = kl_penalty(log_prob, ref_log_prob, kl_loss_type)
    return agg_loss(kld, response_mask, loss_agg_mode, global_normalizer, loss_scale_factor)
