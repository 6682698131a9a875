"""Advantage estimators, KL estimators and KL controllers on padded response tensors.

Contract: every tensor is ``[B, R]`` (B sequences, R = max response length) with a
``response_mask`` ``[B, R]`` that is 1 on real response tokens and 0 elsewhere (padding after
EOS, or tool/observation tokens inside a multi-turn response). Outcome estimators read the
sequence score as ``token_level_rewards.sum(-1)``. Every advantage / return tensor returned here
is zero outside the mask, so no padding value can leak into a sum that forgets the mask.

Semantics follow verl's ``core_algos`` (names, defaults, edge cases), with one deliberate
difference: verl leaves arbitrary values at masked positions; we zero them.

Estimators run on the whole batch, identically on every rank: group statistics (GRPO, RLOO) and
whitening (GAE, REINFORCE++) are batch-global, so computing them on a DP shard would change them.
ReMax, OPO, GRPO pass@k and GPG live in ``advantages_more`` (a leaf module; registered below).
"""

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import torch

from hybridengine.rl.advantages_more import (compute_gpg_outcome_advantage, compute_grpo_passk_outcome_advantage,
                                             compute_opo_outcome_advantage, compute_remax_outcome_advantage)

Tensor = torch.Tensor


# ----------------------------------------------------------------------------- masked statistics


def masked_sum(values: Tensor, mask: Tensor, axis: int | None = None) -> Tensor:
    """Sum of ``values`` where ``mask`` is set; NaN/inf at masked-out positions are ignored."""
    kept = torch.where(mask.bool(), values, torch.zeros_like(values))
    return kept.sum() if axis is None else kept.sum(dim=axis)


def masked_mean(values: Tensor, mask: Tensor, axis: int | None = None) -> Tensor:
    """Mean over the masked elements; 0 where the mask is empty (verl returns 0 there too)."""
    count = mask.to(values.dtype)
    count = count.sum() if axis is None else count.sum(dim=axis)
    return masked_sum(values, mask, axis) / count.clamp(min=1)


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance over all masked elements (Bessel-corrected by default, as verl)."""
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = int(mask.bool().sum())
        if count < 2:
            raise ValueError(f"masked_var: unbiased variance needs >= 2 masked elements, got {count}")
        variance = variance * (count / (count - 1))
    return variance


def masked_whiten(values: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """(values - mean) / sqrt(var + 1e-8) with mean/var over the masked elements."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def _check_shapes(**tensors: Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 2:
        raise ValueError(f"expected equal [B, R] shapes, got {shapes}")


# ----------------------------------------------------------------------------- estimators


@torch.no_grad()
def compute_gae_advantage_return(
    token_level_rewards: Tensor, values: Tensor, response_mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """GAE(gamma, lam). Returns (advantages whitened over the mask, returns = raw GAE + values).

    Masked tokens are skipped, not cut: the TD recursion at a response token uses the value and
    GAE of the next *response* token, so observation tokens inside a multi-turn response neither
    end the episode nor contribute a reward or a value (verl's behaviour).
    """
    _check_shapes(token_level_rewards=token_level_rewards, values=values, response_mask=response_mask)
    valid = response_mask.bool()
    next_value = torch.zeros_like(values[:, 0])  # [B] value of the next response token
    last_gae = torch.zeros_like(values[:, 0])  # [B] GAE of the next response token
    advantages = torch.zeros_like(values)  # [B, R]
    for t in reversed(range(values.shape[1])):
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        gae = delta + gamma * lam * last_gae
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        last_gae = torch.where(valid[:, t], gae, last_gae)
        advantages[:, t] = last_gae
    zeros = torch.zeros_like(values)
    returns = torch.where(valid, advantages + values, zeros)
    advantages = torch.where(valid, masked_whiten(advantages, response_mask), zeros)
    return advantages, returns


def _group_inverse(group_index: Sequence[Hashable] | Tensor, batch_size: int) -> tuple[Tensor, int]:
    """Map arbitrary group ids (ints, uid strings) to ``[B]`` int64 ids 0..num_groups-1."""
    ids = group_index.tolist() if isinstance(group_index, Tensor) else list(group_index)
    if len(ids) != batch_size:
        raise ValueError(f"group_index has {len(ids)} entries for a batch of {batch_size} sequences")
    first_seen: dict[Hashable, int] = {}
    inverse = [first_seen.setdefault(g, len(first_seen)) for g in ids]
    return torch.tensor(inverse, dtype=torch.long), len(first_seen)


def _group_stats(scores: Tensor, inverse: Tensor, num_groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per-group (count, mean, unbiased std) of ``scores`` [B]; each returned as [num_groups]."""
    inverse = inverse.to(scores.device)
    count = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device)
    count = count.index_add(0, inverse, torch.ones_like(scores))
    mean = torch.zeros_like(count).index_add(0, inverse, scores) / count
    sq_dev = torch.zeros_like(count).index_add(0, inverse, (scores - mean[inverse]) ** 2)
    std = torch.sqrt(sq_dev / (count - 1).clamp(min=1))
    return count, mean, std


@torch.no_grad()
def compute_grpo_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    group_index: Sequence[Hashable] | Tensor,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[Tensor, Tensor]:
    """GRPO: (score - group mean) / (group std + eps), broadcast over the response.

    A group of one has mean 0 and std 1 (verl), so its advantage is its raw score.
    ``norm_adv_by_std_in_grpo=False`` drops the std division (Dr. GRPO). Returns (adv, adv).
    """
    _check_shapes(token_level_rewards=token_level_rewards, response_mask=response_mask)
    scores = token_level_rewards.sum(dim=-1)  # [B]
    inverse, num_groups = _group_inverse(group_index, scores.shape[0])
    count, mean, std = _group_stats(scores, inverse, num_groups)
    singleton = count == 1
    mean = torch.where(singleton, torch.zeros_like(mean), mean)
    std = torch.where(singleton, torch.ones_like(std), std)
    inverse = inverse.to(scores.device)
    advantage = scores - mean[inverse]
    if norm_adv_by_std_in_grpo:
        advantage = advantage / (std[inverse] + epsilon)
    advantages = advantage.unsqueeze(-1) * response_mask.to(scores.dtype)
    return advantages, advantages


@torch.no_grad()
def compute_rloo_outcome_advantage(
    token_level_rewards: Tensor, response_mask: Tensor, group_index: Sequence[Hashable] | Tensor
) -> tuple[Tensor, Tensor]:
    """RLOO: score minus the mean score of the *other* members of its group.

    Equals (score - group mean) * n / (n - 1); a group of one keeps its raw score (verl).
    """
    _check_shapes(token_level_rewards=token_level_rewards, response_mask=response_mask)
    scores = token_level_rewards.sum(dim=-1)  # [B]
    inverse, num_groups = _group_inverse(group_index, scores.shape[0])
    count, mean, _ = _group_stats(scores, inverse, num_groups)
    n = count[inverse.to(scores.device)]
    leave_one_out = (scores - mean[inverse.to(scores.device)]) * n / (n - 1).clamp(min=1)
    advantage = torch.where(n > 1, leave_one_out, scores)
    advantages = advantage.unsqueeze(-1) * response_mask.to(scores.dtype)
    return advantages, advantages


@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: Tensor, response_mask: Tensor, gamma: float
) -> tuple[Tensor, Tensor]:
    """REINFORCE++: discounted return-to-go, whitened over the whole batch.

    The running return restarts after every masked token (verl's "reset after EOS"), so a
    masked span splits the response into independently discounted segments.
    """
    _check_shapes(token_level_rewards=token_level_rewards, response_mask=response_mask)
    valid = response_mask.bool()
    returns = torch.zeros_like(token_level_rewards)  # [B, R]
    running = torch.zeros_like(token_level_rewards[:, 0])  # [B]
    for t in reversed(range(token_level_rewards.shape[1])):
        running = token_level_rewards[:, t] + gamma * running
        returns[:, t] = running
        running = torch.where(valid[:, t], running, torch.zeros_like(running))
    zeros = torch.zeros_like(returns)
    advantages = torch.where(valid, masked_whiten(returns, response_mask), zeros)
    return advantages, torch.where(valid, returns, zeros)


@torch.no_grad()
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: Tensor, response_mask: Tensor, group_index: Sequence[Hashable] | Tensor
) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline (arXiv:2501.03262): score minus its group's mean score (a group of one
    keeps its score), i.e. Dr. GRPO's advantage, whitened over the batch's response tokens.
    Returns (adv, adv)."""
    centred, _ = compute_grpo_outcome_advantage(token_level_rewards, response_mask, group_index,
                                                norm_adv_by_std_in_grpo=False)
    advantages = torch.where(response_mask.bool(), masked_whiten(centred, response_mask), torch.zeros_like(centred))
    return advantages, advantages


# ----------------------------------------------------------------------------- registry

AdvantageFn = Callable[..., tuple[Tensor, Tensor]]
_ADV_ESTIMATORS: dict[str, AdvantageFn] = {}
_CRITIC_ESTIMATORS: set[str] = set()


def register_adv_estimator(name: str, uses_critic: bool = False) -> Callable[[AdvantageFn], AdvantageFn]:
    """Register ``fn(token_level_rewards, response_mask, **inputs) -> (advantages, returns)``.

    ``inputs`` is always the full keyword set (values, group_index, gamma, lam, epsilon,
    norm_adv_by_std_in_grpo, reward_baselines); an estimator takes what it needs, ignores the rest.
    """

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        if name in _ADV_ESTIMATORS and _ADV_ESTIMATORS[name] is not fn:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        _ADV_ESTIMATORS[name] = fn
        if uses_critic:
            _CRITIC_ESTIMATORS.add(name)
        return fn

    return decorator


def get_adv_estimator(name: str) -> AdvantageFn:
    """The estimator registered as ``name`` (algorithm.adv_estimator in verl's config)."""
    if name not in _ADV_ESTIMATORS:
        raise ValueError(f"algorithm.adv_estimator={name!r} is unknown; choose from {sorted(_ADV_ESTIMATORS)}")
    return _ADV_ESTIMATORS[name]


def adv_estimator_uses_critic(name: str) -> bool:
    """Whether the estimator needs critic values (and so a critic role)."""
    get_adv_estimator(name)
    return name in _CRITIC_ESTIMATORS


def _required(value: Any, field: str, estimator: str) -> Any:
    if value is None:
        raise ValueError(f"advantage estimator {estimator!r} needs {field}")
    return value


@register_adv_estimator("gae", uses_critic=True)
def _gae(token_level_rewards, response_mask, *, values=None, gamma=1.0, lam=1.0, **_):
    values = _required(values, "values", "gae")
    return compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam)


@register_adv_estimator("grpo")
def _grpo(
    token_level_rewards, response_mask, *, group_index=None, epsilon=1e-6, norm_adv_by_std_in_grpo=True, **_
):
    group_index = _required(group_index, "group_index", "grpo")
    return compute_grpo_outcome_advantage(
        token_level_rewards, response_mask, group_index, epsilon, norm_adv_by_std_in_grpo
    )


@register_adv_estimator("rloo")
def _rloo(token_level_rewards, response_mask, *, group_index=None, **_):
    group_index = _required(group_index, "group_index", "rloo")
    return compute_rloo_outcome_advantage(token_level_rewards, response_mask, group_index)


@register_adv_estimator("reinforce_plus_plus")
def _reinforce_plus_plus(token_level_rewards, response_mask, *, gamma=1.0, **_):
    return compute_reinforce_plus_plus_outcome_advantage(token_level_rewards, response_mask, gamma)


@register_adv_estimator("reinforce_plus_plus_baseline")
def _reinforce_plus_plus_baseline(token_level_rewards, response_mask, *, group_index=None, **_):
    group_index = _required(group_index, "group_index", "reinforce_plus_plus_baseline")
    return compute_reinforce_plus_plus_baseline_outcome_advantage(token_level_rewards, response_mask, group_index)


@register_adv_estimator("remax")
def _remax(token_level_rewards, response_mask, *, reward_baselines=None, **_):
    reward_baselines = _required(reward_baselines, "reward_baselines (greedy responses' scores)", "remax")
    return compute_remax_outcome_advantage(token_level_rewards, response_mask, reward_baselines)


def _group_ids(group_index: Any, estimator: str, batch_size: int) -> Tensor:
    """``group_index`` (uids) as the [B] int64 ids 0..G-1 that advantages_more's estimators take."""
    return _group_inverse(_required(group_index, "group_index", estimator), batch_size)[0]


@register_adv_estimator("opo")
def _opo(token_level_rewards, response_mask, *, group_index=None, **_):
    ids = _group_ids(group_index, "opo", token_level_rewards.shape[0])
    return compute_opo_outcome_advantage(token_level_rewards, response_mask, ids)


@register_adv_estimator("grpo_passk")
def _grpo_passk(
    token_level_rewards, response_mask, *, group_index=None, epsilon=1e-6, norm_adv_by_std_in_grpo=True, **_
):
    ids = _group_ids(group_index, "grpo_passk", token_level_rewards.shape[0])
    return compute_grpo_passk_outcome_advantage(
        token_level_rewards, response_mask, ids, epsilon, norm_adv_by_std_in_grpo
    )


@register_adv_estimator("gpg")
def _gpg(token_level_rewards, response_mask, *, group_index=None, **_):
    ids = _group_ids(group_index, "gpg", token_level_rewards.shape[0])
    return compute_gpg_outcome_advantage(token_level_rewards, response_mask, ids)


# ----------------------------------------------------------------------------- KL

KL_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


def kl_penalty(logprob: Tensor, ref_logprob: Tensor, kind: str) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token logprobs, [B, R] -> [B, R].

    k1 = log r, k2 = (log r)^2 / 2, k3 = exp(-log r) + log r - 1 with log r = logprob - ref
    (Schulman, "Approximating KL divergence"); k3 is clamped to [-10, 10] as in verl.
    """
    log_ratio = logprob - ref_logprob
    if kind in ("kl", "k1"):
        return log_ratio
    if kind == "abs":
        return log_ratio.abs()
    if kind in ("mse", "k2"):
        return 0.5 * log_ratio.square()
    if kind in ("low_var_kl", "k3"):
        # the exp overflows for |log r| > ~88 in fp32; the clamp to 20 keeps k3 finite
        neg_log_ratio = torch.clamp(-log_ratio, min=-20.0, max=20.0)
        return torch.clamp(torch.exp(neg_log_ratio) - neg_log_ratio - 1, min=-10.0, max=10.0)
    raise ValueError(f"KL penalty kind {kind!r} is unknown; choose from {KL_KINDS}")


class FixedKLController:
    """Constant KL coefficient ``value``."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient is fixed."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController(FixedKLController):
    """Adaptive KL coefficient (Ziegler et al. 2019, arXiv:1909.08593).

    value *= 1 + clip(current_kl / target_kl - 1, -0.2, 0.2) * n_steps / horizon.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if target_kl <= 0:
            raise ValueError(f"kl_ctrl.target_kl must be > 0, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"kl_ctrl.horizon must be > 0, got {horizon}")
        super().__init__(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon


def make_kl_controller(kl_ctrl: Any) -> FixedKLController:
    """Build from verl's ``algorithm.kl_ctrl`` (a mapping or attribute object: type, kl_coef,
    target_kl, horizon; verl's defaults fill missing fields)."""

    def field(name: str, default: Any) -> Any:
        if isinstance(kl_ctrl, Mapping):
            return kl_ctrl.get(name, default)
        return getattr(kl_ctrl, name, default)

    kind, kl_coef = field("type", "fixed"), field("kl_coef", 0.001)
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(kl_coef, field("target_kl", 0.1), field("horizon", 10000))
    raise ValueError(f"algorithm.kl_ctrl.type={kind!r} is unknown; choose 'fixed' or 'adaptive'")


@torch.no_grad()
def apply_kl_penalty(
    token_level_scores: Tensor,
    old_log_prob: Tensor,
    ref_log_prob: Tensor,
    response_mask: Tensor,
    kl_ctrl: FixedKLController,
    kind: str = "kl",
) -> tuple[Tensor, dict[str, float]]:
    """KL in the reward: rewards = scores - beta * kl (kl zero off the mask); updates ``kl_ctrl``.

    The controller sees current_kl = batch mean of each sequence's masked-mean KL, with
    n_steps = B (verl). Call it once per step on the whole batch, identically on every rank.
    """
    _check_shapes(scores=token_level_scores, old=old_log_prob, ref=ref_log_prob, mask=response_mask)
    kld = kl_penalty(old_log_prob, ref_log_prob, kind)  # [B, R]
    kld = torch.where(response_mask.bool(), kld, torch.zeros_like(kld))
    beta = kl_ctrl.value
    token_level_rewards = token_level_scores - beta * kld
    current_kl = masked_mean(kld, response_mask, axis=-1).mean().item()
    kl_ctrl.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
    return token_level_rewards, metrics


# ----------------------------------------------------------------------------- DAPO


def overlong_penalty(
    response_lengths: Tensor | Sequence[int], max_response_length: int, buffer_len: int, penalty_factor: float
) -> Tensor:
    """DAPO soft overlong punishment, per sequence [B], to add to the sequence score.

    0 up to ``max_response_length - buffer_len`` tokens, then falling linearly to
    ``-penalty_factor`` at ``max_response_length``: min(-(len - (max - buffer)) / buffer * factor, 0).
    """
    if not 0 < buffer_len <= max_response_length:
        raise ValueError(
            f"overlong_buffer.len={buffer_len} must be in (0, max_response_length={max_response_length}]"
        )
    lengths = torch.as_tensor(response_lengths, dtype=torch.get_default_dtype())
    exceed = lengths - (max_response_length - buffer_len)
    return torch.clamp(-exceed / buffer_len * penalty_factor, max=0.0)


def dynamic_sampling_keep_mask(
    group_index: Sequence[Hashable] | Tensor, metric_values: Tensor | Sequence[float]
) -> Tensor:
    """DAPO filter_groups: bool [B], True for sequences whose group's metric values differ.

    A group whose members all share one value gives zero group-relative advantage, so it is
    dropped. Groups of one are kept (verl keeps them: std is undefined, not zero). Values are
    compared exactly (max > min), so float round-off in a std cannot keep a uniform group.
    """
    metric = torch.as_tensor(metric_values, dtype=torch.float64).flatten()
    inverse, num_groups = _group_inverse(group_index, metric.shape[0])
    group_max = torch.full((num_groups,), -torch.inf, dtype=torch.float64).scatter_reduce(0, inverse, metric, "amax")
    group_min = torch.full((num_groups,), torch.inf, dtype=torch.float64).scatter_reduce(0, inverse, metric, "amin")
    count = torch.zeros(num_groups, dtype=torch.long).index_add(0, inverse, torch.ones_like(inverse))
    keep_group = (group_max > group_min) | (count == 1)
    return keep_group[inverse]
