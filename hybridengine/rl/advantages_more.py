"""verl's ReMax, OPO, GRPO pass@k and GPG outcome estimators (apart from ``advantages`` for size).

Same contract as ``hybridengine.rl.advantages``: tensors are ``[B, R]`` with a ``response_mask``,
the sequence score is ``token_level_rewards.sum(-1)``, and every returned tensor is zero outside
the mask. One difference at the boundary: a group estimator here takes ``group_ids``, a ``[B]``
int64 tensor of ids ``0 .. G-1``, not raw uids. ``advantages`` maps uids (ints or strings) to
such ids and registers these functions under verl's names, so this module imports nothing from it
(it is a leaf: no import cycle). Semantics follow verl's ``core_algos`` (edge cases included), with
the same one deliberate difference: verl leaves values at masked positions; we zero them.
"""

import torch

Tensor = torch.Tensor


def _broadcast(advantage: Tensor, response_mask: Tensor) -> tuple[Tensor, Tensor]:
    """[B] per-sequence advantage -> ([B, R], same tensor) over the response, zero off the mask."""
    advantages = torch.where(response_mask.bool(), advantage.unsqueeze(-1), 0.0)
    return advantages, advantages


def _groups(group_ids: Tensor, scores: Tensor) -> tuple[Tensor, int, Tensor]:
    """(ids on the scores' device, number of groups G, [G] member counts) of ``group_ids`` [B]."""
    if tuple(group_ids.shape) != tuple(scores.shape):
        raise ValueError(f"group_ids has shape {tuple(group_ids.shape)} for {scores.shape[0]} sequences")
    ids = group_ids.to(device=scores.device, dtype=torch.long)
    num_groups = int(ids.max()) + 1 if ids.numel() else 0
    return ids, num_groups, _group_sum(torch.ones_like(scores), ids, num_groups)


def _group_sum(values: Tensor, ids: Tensor, num_groups: int) -> Tensor:
    """[B] -> [G]: the sum of ``values`` over each group."""
    return torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add(0, ids, values)


@torch.no_grad()
def compute_remax_outcome_advantage(
    token_level_rewards: Tensor, response_mask: Tensor, reward_baselines: Tensor
) -> tuple[Tensor, Tensor]:
    """ReMax (Li et al., arXiv:2310.10505): return-to-go minus the prompt's greedy-response score.

    returns[t] = sum of the rewards at response tokens >= t (undiscounted; rewards at masked
    positions are dropped); advantages = returns - reward_baselines, with ``reward_baselines``
    ``[B]`` the score of a greedy response to each sequence's prompt. Returns (adv, returns).
    """
    valid = response_mask.bool()
    zeros = torch.zeros_like(token_level_rewards)
    if tuple(reward_baselines.shape) != tuple(token_level_rewards.shape[:1]):
        raise ValueError(f"reward_baselines has shape {tuple(reward_baselines.shape)}, "
                         f"expected [{token_level_rewards.shape[0]}]")
    rewards = torch.where(valid, token_level_rewards, zeros)
    returns = rewards.flip(-1).cumsum(-1).flip(-1)  # [B, R]
    baselines = reward_baselines.to(returns).unsqueeze(-1)  # [B, 1]
    return torch.where(valid, returns - baselines, zeros), torch.where(valid, returns, zeros)


@torch.no_grad()
def compute_opo_outcome_advantage(
    token_level_rewards: Tensor, response_mask: Tensor, group_ids: Tensor
) -> tuple[Tensor, Tensor]:
    """OPO (arXiv:2505.23585): score minus its group's length-weighted mean score.

    The baseline is sum_j L_j s_j / sum_j L_j over the group, L_j = the number of response tokens
    (mask sum), OPO's optimal baseline under its gradient-norm-proportional-to-length
    approximation. A group of one has baseline 0 (verl), so it keeps its raw score. Returns (adv, adv).
    """
    scores = token_level_rewards.sum(dim=-1)  # [B]
    lengths = response_mask.to(scores.dtype).sum(dim=-1)  # [B]
    ids, num_groups, count = _groups(group_ids, scores)
    weighted = _group_sum(lengths * scores, ids, num_groups)  # [G]
    total_length = _group_sum(lengths, ids, num_groups)  # [G]
    # a group of empty responses (total length 0) trains no token: any finite baseline does
    mean = weighted / torch.where(total_length > 0, total_length, torch.ones_like(total_length))
    baseline = torch.where(count > 1, mean, torch.zeros_like(mean))
    return _broadcast(scores - baseline[ids], response_mask)


@torch.no_grad()
def compute_grpo_passk_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    group_ids: Tensor,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[Tensor, Tensor]:
    """GRPO for pass@k (arXiv:2503.19595, as verl cites): only each group's best response learns.

    Its advantage is (best score - second-best score), divided by (group std + eps) when
    ``norm_adv_by_std_in_grpo`` (std unbiased, as torch.std); every other response gets 0. Every
    group needs >= 2 responses. Among tied best scores the first in batch order is "the best"; a
    tie makes its advantage 0 anyway. Returns (adv, adv).
    """
    scores = token_level_rewards.sum(dim=-1)  # [B]
    ids, num_groups, count = _groups(group_ids, scores)
    if bool((count < 2).any()):
        raise ValueError(f"grpo_passk compares a prompt's best two responses: every group needs >= 2 "
                         f"(actor_rollout_ref.rollout.n >= 2); {int((count < 2).sum())} group(s) have 1")
    batch_size = scores.shape[0]
    position = torch.arange(batch_size, device=scores.device)
    lowest = torch.full((num_groups,), -torch.inf, dtype=scores.dtype, device=scores.device)
    best = lowest.scatter_reduce(0, ids, scores, "amax")  # [G]
    at_best = torch.where(scores == best[ids], position, batch_size)
    first_best = torch.full_like(best, batch_size, dtype=torch.long).scatter_reduce(0, ids, at_best, "amin")
    is_best = position == first_best[ids]  # [B] one True per group
    runner_up = lowest.scatter_reduce(0, ids, torch.where(is_best, -torch.inf, scores), "amax")  # [G]
    advantage = best - runner_up  # [G]
    if norm_adv_by_std_in_grpo:
        mean = _group_sum(scores, ids, num_groups) / count
        std = torch.sqrt(_group_sum((scores - mean[ids]) ** 2, ids, num_groups) / (count - 1))
        advantage = advantage / (std + epsilon)
    return _broadcast(torch.where(is_best, advantage[ids], torch.zeros_like(scores)), response_mask)


@torch.no_grad()
def compute_gpg_outcome_advantage(
    token_level_rewards: Tensor, response_mask: Tensor, group_ids: Tensor
) -> tuple[Tensor, Tensor]:
    """GPG (Group Policy Gradient, AMAP-ML/GPG): alpha * (score - group mean score).

    alpha = B / max(number of nonzero scores in the batch, 1) rescales the gradient when most
    scores are 0; a group of one has mean 0 (verl). verl's f_norm is fixed at 1 there and is
    dropped here. Returns (adv, adv).
    """
    scores = token_level_rewards.sum(dim=-1)  # [B]
    ids, num_groups, count = _groups(group_ids, scores)
    mean = _group_sum(scores, ids, num_groups) / count.clamp(min=1)
    baseline = torch.where(count > 1, mean, torch.zeros_like(mean))
    alpha = scores.shape[0] / max(int(torch.count_nonzero(scores)), 1)
    return _broadcast(alpha * (scores - baseline[ids]), response_mask)
