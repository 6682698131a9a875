"""Advantage estimators on padded response tensors: the estimators, their registry and the DAPO
helpers (overlong penalty, dynamic-sampling filter).

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
The masked statistics live in ``masked_stats`` and the KL estimators / controllers / reward
penalty in ``kl``; both are re-exported here, where callers and tests import them from.
"""

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from hybridengine.rl.advantages_more import (compute_gpg_outcome_advantage, compute_grpo_passk_outcome_advantage,
                                             compute_opo_outcome_advantage, compute_remax_outcome_advantage)
from hybridengine.rl.kl import (KL_KINDS, AdaptiveKLController, FixedKLController,  # noqa: F401 (re-exported)
                                apply_kl_penalty, kl_penalty, make_kl_controller)
from hybridengine.rl.masked_stats import (check_shapes, masked_mean, masked_sum,  # noqa: F401 (re-exported)
                                          masked_var, masked_whiten)

Tensor = torch.Tensor


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
    check_shapes(token_level_rewards=token_level_rewards, values=values, response_mask=response_mask)
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
    check_shapes(token_level_rewards=token_level_rewards, response_mask=response_mask)
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
    check_shapes(token_level_rewards=token_level_rewards, response_mask=response_mask)
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
    check_shapes(token_level_rewards=token_level_rewards, response_mask=response_mask)
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


# algorithm.filter_groups.metric: the per-sequence values dynamic sampling compares in a group
# (rl.rollout reads them from the reward's extras: seq_reward is the score itself)
FILTER_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")


def adv_estimator_names() -> tuple[str, ...]:
    """algorithm.adv_estimator's choices: the registered estimators, in registration order."""
    return tuple(_ADV_ESTIMATORS)


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
