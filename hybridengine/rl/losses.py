"""PPO losses on padded response tensors: policy-loss modes, value clip, entropy, KL, aggregation.

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
    ``seq-mean-token-sum-norm`` (Dr. GRPO) has no normaliser: as in verl it divides the token sum
    by the constant ``loss_scale_factor`` alone, which must be the same for every micro-batch
    (actor.loss_scale_factor, else data.max_response_length); its default here,
    R = loss_mask.shape[-1], is only right when every micro-batch has the full width.
    ``GlobalBatchInfo`` carries the normalisers of every mode and that constant to a micro-batch.

Policy-loss modes (actor.policy_loss.loss_mode, verl's registry): ``register_policy_loss`` /
``get_policy_loss_fn``; each mode is ``fn(old_log_prob, log_prob, advantages, response_mask,
loss_agg_mode, config, batch_info, rollout_is_weights, generator) -> (pg_loss, metrics)`` with
verl's metric names less the "actor/" prefix (the actor adds it). ``rollout_is_weights`` [B, R]
(rl.rollout_correction) multiplies the per-token loss before aggregation, in every mode.
clip_cov and kl_cov pick their tokens from a covariance over the tensors passed in — one
micro-batch, exactly as verl's actors call them: the centring means and the number of tokens
picked (ratio x the micro-batch's valid tokens) are micro-batch-local, so which tokens are cut
or penalised depends on the micro-batch split (micro-batch size, dynamic batching, DP), while the
aggregation of what they produce keeps the contract above.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from hybridengine.rl.advantages import kl_penalty, masked_mean, masked_sum

Tensor = torch.Tensor

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
Normalizer = int | float | Tensor | None


def loss_normalizer(loss_mask: Tensor, loss_agg_mode: str) -> int:
    """This micro-batch's share of the global normaliser: valid tokens for "token-mean", else
    sequences with at least one valid token (fully masked rows are padding, not sequences);
    seq-mean-token-sum-norm ignores it (its divisor is the constant loss_scale_factor)."""
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
    seq-mean-token-sum-norm  sum_{i,t} m*l / loss_scale_factor    (Dr. GRPO; default R)

    N_* is ``global_normalizer`` when given, else ``loss_normalizer`` of this batch. A zero
    normaliser (nothing valid anywhere) gives a zero loss that keeps the graph.
    """
    _check_mode(loss_agg_mode)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        scale = loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
        return masked_sum(loss_mat, loss_mask) / scale
    normalizer = loss_normalizer(loss_mask, loss_agg_mode) if global_normalizer is None else global_normalizer
    if isinstance(normalizer, torch.Tensor):
        denom = normalizer.to(device=loss_mat.device, dtype=loss_mat.dtype)
    else:   # a number: filled in on the device (as_tensor copies it there and waits for the
        # device: a sync per micro-batch loss, which kept the host from queueing ahead)
        denom = torch.full((), normalizer, dtype=loss_mat.dtype, device=loss_mat.device)
    denom = denom.clamp(min=1)
    if loss_agg_mode == "token-mean":
        return masked_sum(loss_mat, loss_mask) / denom
    seq_sums = masked_sum(loss_mat, loss_mask, axis=-1)  # [B]
    if loss_agg_mode == "seq-mean-token-mean":
        seq_sums = seq_sums / loss_mask.to(loss_mat.dtype).sum(dim=-1).clamp(min=1)
    return seq_sums.sum() / denom


def _check_mode(loss_agg_mode: str) -> None:
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode={loss_agg_mode!r} is unknown; choose from {LOSS_AGG_MODES}")


@dataclass(frozen=True)
class GlobalBatchInfo:
    """What a micro-batch's loss needs from its mini-batch (verl's ``global_batch_info``): the
    global normaliser of each aggregation mode and the constant of seq-mean-token-sum-norm.
    The default makes every loss the whole-batch loss of the tensors passed in."""

    normalizers: Mapping[str, Normalizer] | None = None
    loss_scale_factor: float | None = None

    @classmethod
    def of(cls, loss_mask: Tensor, loss_scale_factor: float | None = None) -> "GlobalBatchInfo":
        """From the whole mini-batch's mask (every rank holds it: module docstring's sum)."""
        return cls({m: loss_normalizer(loss_mask, m) for m in LOSS_AGG_MODES}, loss_scale_factor)

    def normalizer(self, loss_agg_mode: str) -> Normalizer:
        return None if self.normalizers is None else self.normalizers[loss_agg_mode]

    def agg(self, loss_mat: Tensor, loss_mask: Tensor, loss_agg_mode: str) -> Tensor:
        return agg_loss(loss_mat, loss_mask, loss_agg_mode, self.normalizer(loss_agg_mode),
                        self.loss_scale_factor)


# ----------------------------------------------------------------------------- policy losses


@dataclass(frozen=True)
class PolicyLossConfig:
    """actor.{clip_ratio_low, clip_ratio_high, clip_ratio_c} and actor.policy_loss.* (verl's
    names and defaults; clip_ratio_low / high already resolved against clip_ratio)."""

    loss_mode: str = "vanilla"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1


PolicyLossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]
_POLICY_LOSSES: dict[str, PolicyLossFn] = {}
_LOCAL = GlobalBatchInfo()


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Register a policy loss under ``name`` (actor.policy_loss.loss_mode); signature: module
    docstring."""
    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        _POLICY_LOSSES[name] = fn
        return fn
    return decorator


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    if name not in _POLICY_LOSSES:
        raise ValueError(f"actor_rollout_ref.actor.policy_loss.loss_mode={name!r} is unknown; "
                         f"choose from {', '.join(_POLICY_LOSSES)}")
    return _POLICY_LOSSES[name]


def policy_loss_modes() -> tuple[str, ...]:
    return tuple(_POLICY_LOSSES)


def _weighted(pg_losses: Tensor, rollout_is_weights: Tensor | None) -> Tensor:
    return pg_losses if rollout_is_weights is None else pg_losses * rollout_is_weights


def _frac(flags: Tensor, mask: Tensor, like: Tensor) -> Tensor:
    """Share of the valid tokens where ``flags`` is set, in ``like``'s dtype."""
    return masked_mean(flags.to(like.dtype), mask)


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                config=PolicyLossConfig(), batch_info=_LOCAL, rollout_is_weights=None,
                                generator=None):
    """PPO clipped surrogate with clip-higher and dual-clip, per token:
    l = max(-A r, -A clip(r, 1 - low, 1 + high)); for A < 0 also l = min(l, -A c) (dual-clip, Ye et
    al. 2020), which bounds the loss of a token whose ratio has blown up. ``low != high`` is
    DAPO's clip-higher. log r is clamped to [-20, 20] before exp (verl).
    pg_clipfrac: share of tokens where the clip bound is active; pg_clipfrac_lower: share where
    the dual clip is; ppo_kl: masked mean of old_log_prob - log_prob (k1 estimate)."""
    c = config.clip_ratio_c
    if c <= 1.0:
        raise ValueError(f"actor.clip_ratio_c must be > 1.0 for dual-clip PPO, got {c}")
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)  # [B, R]
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high)
    clip_loss = torch.maximum(unclipped, clipped)
    dual_bound = -advantages * c
    negative = advantages < 0
    pg_losses = torch.where(negative, torch.minimum(clip_loss, dual_bound), clip_loss)
    pg_loss = batch_info.agg(_weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode)
    with torch.no_grad():
        metrics = {"pg_clipfrac": _frac(clipped > unclipped, response_mask, log_prob),
                   "ppo_kl": masked_mean(-log_ratio, response_mask),
                   "pg_clipfrac_lower": _frac((clip_loss > dual_bound) & negative, response_mask, log_prob)}
    return pg_loss, metrics


@register_policy_loss("gspo")
def compute_policy_loss_gspo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                             config=PolicyLossConfig(), batch_info=_LOCAL, rollout_is_weights=None,
                             generator=None):
    """GSPO (Zheng et al. 2025): the sequence ratio s_i = exp(mean_t log r_it), clipped like PPO
    (no dual clip). Per token the ratio is sg[s_i] * pi / sg[pi], so each token's gradient is its
    own log-prob's, scaled by s_i. log s is clamped above at 10 (verl). Always aggregated
    seq-mean-token-mean (verl ignores loss_agg_mode here); pg_clipfrac_lower is 0."""
    log_ratio = log_prob - old_log_prob
    lengths = response_mask.to(log_ratio.dtype).sum(dim=-1).clamp(min=1)
    seq_log_ratio = masked_sum(log_ratio, response_mask, axis=-1) / lengths  # [B]
    log_s = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    s = torch.exp(torch.clamp(log_s, max=10.0))  # [B, R]
    unclipped = -advantages * s
    clipped = -advantages * torch.clamp(s, 1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high)
    pg_losses = torch.maximum(unclipped, clipped)
    pg_loss = batch_info.agg(_weighted(pg_losses, rollout_is_weights), response_mask, "seq-mean-token-mean")
    with torch.no_grad():
        metrics = {"pg_clipfrac": _frac(clipped > unclipped, response_mask, log_prob),
                   "ppo_kl": masked_mean(-log_ratio, response_mask),
                   "pg_clipfrac_lower": torch.zeros((), dtype=pg_loss.dtype, device=pg_loss.device)}
    return pg_loss, metrics


@register_policy_loss("gpg")
def compute_policy_loss_gpg(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                            config=PolicyLossConfig(), batch_info=_LOCAL, rollout_is_weights=None,
                            generator=None):
    """GPG (Chu et al. 2025): plain policy gradient -A log pi, no ratio, no clip; no metrics."""
    pg_losses = -log_prob * advantages
    return batch_info.agg(_weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode), {}


def _centred_cov(advantages: Tensor, log_prob: Tensor, mask: Tensor) -> Tensor:
    """(A - mean A) (log pi - mean log pi) per token, means over the valid tokens passed in."""
    return (advantages - masked_mean(advantages, mask)) * (log_prob - masked_mean(log_prob, mask))


@register_policy_loss("clip_cov")
def compute_policy_loss_clip_cov(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                 config=PolicyLossConfig(), batch_info=_LOCAL, rollout_is_weights=None,
                                 generator=None):
    """Clip-Cov (Cui et al. 2025): PPO clip (no dual clip, no ratio clamp), then the gradient of
    a random subset of tokens is cut: among the valid tokens the PPO clip left alone whose
    covariance (A - mean A)(log pi - mean log pi) lies in (clip_cov_lb, clip_cov_ub), pick
    max(1, int(clip_cov_ratio * valid tokens)) uniformly (``generator``: the same on every TP
    rank of a replica) and zero their loss. pg_clipfrac: share of tokens cut."""
    if config.clip_cov_ratio <= 0:
        raise ValueError(f"actor.policy_loss.clip_cov_ratio must be > 0, got {config.clip_cov_ratio}")
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high)
    valid = response_mask.bool()
    with torch.no_grad():
        cov = _centred_cov(advantages, log_prob, response_mask)
        free = valid & ~(clipped > unclipped)
        candidates = torch.nonzero(free & (cov > config.clip_cov_lb) & (cov < config.clip_cov_ub))  # [n, 2]
        num_cut = max(int(config.clip_cov_ratio * int(valid.sum())), 1)
        if len(candidates):
            pick = torch.randperm(len(candidates), generator=generator)[:num_cut]
            candidates = candidates[pick.to(candidates.device)]
        keep = torch.ones_like(ratio)
        keep[candidates[:, 0], candidates[:, 1]] = 0
    pg_losses = torch.maximum(unclipped, clipped) * keep
    pg_loss = batch_info.agg(_weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode)
    with torch.no_grad():
        metrics = {"pg_clipfrac": _frac(keep == 0, response_mask, log_prob),
                   "ppo_kl": masked_mean(-log_ratio, response_mask)}
    return pg_loss, metrics


@register_policy_loss("kl_cov")
def compute_policy_loss_kl_cov(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                               config=PolicyLossConfig(), batch_info=_LOCAL, rollout_is_weights=None,
                               generator=None):
    """KL-Cov (Cui et al. 2025): unclipped -A r, plus ppo_kl_coef * |log r| on the
    max(1, int(kl_cov_ratio * valid tokens)) valid tokens of largest covariance
    (A - mean A)(log pi - mean log pi). ppo_kl is the masked mean of |log r| here (verl)."""
    if config.kl_cov_ratio <= 0:
        raise ValueError(f"actor.policy_loss.kl_cov_ratio must be > 0, got {config.kl_cov_ratio}")
    log_ratio = log_prob - old_log_prob
    pg_losses = -advantages * torch.exp(log_ratio)
    valid = response_mask.bool()
    penalised = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
    with torch.no_grad():
        adv, logp = advantages[valid], log_prob[valid]  # valid tokens, row-major
        if len(adv):
            cov = (adv - adv.mean()) * (logp - logp.mean())
            top = torch.topk(cov, max(1, int(len(adv) * config.kl_cov_ratio))).indices
            penalised[torch.nonzero(valid.reshape(-1)).squeeze(-1)[top]] = True
    penalised = penalised.view(valid.shape)
    pg_losses = torch.where(penalised, pg_losses + config.ppo_kl_coef * log_ratio.abs(), pg_losses)
    pg_loss = batch_info.agg(_weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode)
    with torch.no_grad():
        metrics = {"ppo_kl": masked_mean(log_ratio.abs(), response_mask)}
    return pg_loss, metrics


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
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The vanilla mode with explicit clip arguments; returns
    (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)."""
    config = PolicyLossConfig("vanilla", clip_ratio_low, clip_ratio_high, clip_ratio_c)
    info = GlobalBatchInfo(None if global_normalizer is None else {loss_agg_mode: global_normalizer},
                           loss_scale_factor)
    loss, m = compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                                          config, info, rollout_is_weights)
    return loss, m["pg_clipfrac"], m["ppo_kl"], m["pg_clipfrac_lower"]


# ----------------------------------------------------------------------------- value, entropy, KL


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
