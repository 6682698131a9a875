"""KL between the policy and the reference on sampled tokens: the per-token estimators (k1, k2,
k3), the fixed and adaptive KL coefficient controllers, and the KL penalty folded into the reward.

Same ``[B, R]`` + ``response_mask`` contract as ``hybridengine.rl.advantages`` (which re-exports
these names). Semantics follow verl's ``core_algos`` (kl_penalty, FixedKLController,
AdaptiveKLController, apply_kl_penalty in its ray_trainer).
"""

from collections.abc import Mapping
from typing import Any

import torch

from hybridengine.rl.masked_stats import check_shapes, masked_mean

Tensor = torch.Tensor

KL_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
# algorithm.kl_ctrl.type: make_kl_controller's
KL_CONTROLLERS = ("fixed", "adaptive")


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
    raise ValueError(f"algorithm.kl_ctrl.type={kind!r} is unknown; choose one of "
                     f"{', '.join(KL_CONTROLLERS)}")


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
    check_shapes(scores=token_level_scores, old=old_log_prob, ref=ref_log_prob, mask=response_mask)
    kld = kl_penalty(old_log_prob, ref_log_prob, kind)  # [B, R]
    kld = torch.where(response_mask.bool(), kld, torch.zeros_like(kld))
    beta = kl_ctrl.value
    token_level_rewards = token_level_scores - beta * kld
    current_kl = masked_mean(kld, response_mask, axis=-1).mean().item()
    kl_ctrl.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
    return token_level_rewards, metrics
