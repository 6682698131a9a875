"""Advantage estimators, KL estimators / controllers and DAPO helpers against brute-force
per-element loops and hand-computed values, in float64."""

import math
import statistics

import pytest
import torch
from omegaconf import OmegaConf

from hybridengine.rl import advantages as adv

D = torch.float64


def _batch(seed: int = 0, batch_size: int = 6, max_len: int = 7):
    """Random rewards/values and a mask with trailing padding, an interior hole and an empty row."""
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(batch_size, max_len, generator=g, dtype=D)
    values = torch.randn(batch_size, max_len, generator=g, dtype=D)
    lengths = [7, 5, 3, 6, 1, 4][:batch_size]
    mask = torch.zeros(batch_size, max_len, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    mask[3, 2:4] = 0  # observation tokens inside a multi-turn response
    return rewards, values, mask


def _valid_positions(mask_row):
    return [t for t in range(mask_row.shape[0]) if mask_row[t]]


def _whiten_reference(x, mask):
    selected = x[mask.bool()]
    return (x - selected.mean()) / math.sqrt(selected.var(unbiased=True).item() + 1e-8)


def test_masked_statistics_match_selected_elements():
    x, _, mask = _batch()
    x = x.masked_fill(~mask.bool(), float("nan"))  # padding must never leak in
    selected = x[mask.bool()]
    assert torch.allclose(adv.masked_sum(x, mask), selected.sum())
    assert torch.allclose(adv.masked_mean(x, mask), selected.mean())
    assert torch.allclose(adv.masked_var(x, mask), selected.var(unbiased=True))
    assert torch.allclose(adv.masked_var(x, mask, unbiased=False), selected.var(unbiased=False))
    rows = adv.masked_mean(x, mask, axis=-1)
    for i in range(x.shape[0]):
        assert torch.allclose(rows[i], x[i][mask[i].bool()].mean())
    whitened = adv.masked_whiten(x, mask)[mask.bool()]
    assert torch.allclose(whitened, (selected - selected.mean()) / torch.sqrt(selected.var() + 1e-8))
    assert adv.masked_mean(x, torch.zeros_like(mask)).item() == 0.0


def test_masked_var_needs_two_elements():
    x = torch.arange(4, dtype=D).reshape(2, 2)
    with pytest.raises(ValueError, match="masked_var"):
        adv.masked_var(x, torch.tensor([[1, 0], [0, 0]]))


def _gae_reference(rewards, values, mask, gamma, lam):
    """GAE per row over the response tokens only (masked tokens removed), then whitened."""
    raw = torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        positions = _valid_positions(mask[i])
        gae, next_value = 0.0, 0.0
        for t in reversed(positions):
            delta = rewards[i, t].item() + gamma * next_value - values[i, t].item()
            gae = delta + gamma * lam * gae
            raw[i, t] = gae
            next_value = values[i, t].item()
    returns = (raw + values) * mask
    return _whiten_reference(raw, mask) * mask, returns


def test_gae_matches_per_row_recursion_skipping_masked_tokens():
    rewards, values, mask = _batch()
    for gamma, lam in [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0)]:
        advantages, returns = adv.compute_gae_advantage_return(rewards, values, mask, gamma, lam)
        ref_adv, ref_ret = _gae_reference(rewards, values, mask, gamma, lam)
        assert torch.allclose(advantages, ref_adv), (gamma, lam)
        assert torch.allclose(returns, ref_ret), (gamma, lam)


def test_gae_hand_values_outcome_reward():
    # gamma = lam = 1, reward 1 on the last token: return is 1 everywhere, raw adv = 1 - V_t
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]], dtype=D)
    values = torch.tensor([[0.5, 0.25, 0.75, 9.0]], dtype=D)
    mask = torch.tensor([[1, 1, 1, 0]])
    advantages, returns = adv.compute_gae_advantage_return(rewards, values, mask, 1.0, 1.0)
    assert torch.allclose(returns, torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=D))
    raw = torch.tensor([0.5, 0.75, 0.25], dtype=D)
    expected = (raw - raw.mean()) / torch.sqrt(raw.var() + 1e-8)
    assert torch.allclose(advantages[0, :3], expected)
    assert advantages[0, 3] == 0


def _group_reference(scores, groups):
    members = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(scores[i])
    return members


def test_grpo_matches_per_group_loop():
    rewards, _, mask = _batch()
    groups = ["a", "b", "a", "b", "c", "a"]  # group "c" has one member
    scores = rewards.sum(-1).tolist()
    members = _group_reference(scores, groups)
    for norm_by_std in (True, False):
        advantages, returns = adv.compute_grpo_outcome_advantage(
            rewards, mask, groups, epsilon=1e-6, norm_adv_by_std_in_grpo=norm_by_std
        )
        assert advantages is returns or torch.equal(advantages, returns)
        for i, g in enumerate(groups):
            group = members[g]
            mean, std = (0.0, 1.0) if len(group) == 1 else (statistics.mean(group), statistics.stdev(group))
            expected = (scores[i] - mean) / (std + 1e-6) if norm_by_std else scores[i] - mean
            assert torch.allclose(advantages[i], expected * mask[i].to(D)), (i, norm_by_std)


def test_grpo_rejects_wrong_group_index_length():
    rewards, _, mask = _batch()
    with pytest.raises(ValueError, match="group_index"):
        adv.compute_grpo_outcome_advantage(rewards, mask, [0, 0, 1])


def test_rloo_is_score_minus_mean_of_others():
    rewards, _, mask = _batch()
    groups = torch.tensor([0, 1, 0, 1, 2, 0])
    scores = rewards.sum(-1).tolist()
    advantages, _ = adv.compute_rloo_outcome_advantage(rewards, mask, groups)
    for i, g in enumerate(groups.tolist()):
        others = [scores[j] for j, h in enumerate(groups.tolist()) if h == g and j != i]
        expected = scores[i] - statistics.mean(others) if others else scores[i]
        assert torch.allclose(advantages[i], expected * mask[i].to(D)), i


def test_reinforce_plus_plus_discounts_and_resets_at_masked_tokens():
    rewards, _, mask = _batch()
    gamma = 0.9
    ref_returns = torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        running = 0.0
        for t in reversed(range(rewards.shape[1])):
            running = rewards[i, t].item() + gamma * running
            ref_returns[i, t] = running * mask[i, t].item()
            if not mask[i, t]:
                running = 0.0
    advantages, returns = adv.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma)
    assert torch.allclose(returns, ref_returns)
    assert torch.allclose(advantages, _whiten_reference(ref_returns, mask) * mask)


def test_registry_dispatches_with_uniform_inputs():
    rewards, values, mask = _batch()
    groups = [0, 0, 1, 1, 2, 2]
    inputs = dict(values=values, group_index=groups, gamma=0.99, lam=0.95, epsilon=1e-6, norm_adv_by_std_in_grpo=True)
    expected = {
        "gae": adv.compute_gae_advantage_return(rewards, values, mask, 0.99, 0.95),
        "grpo": adv.compute_grpo_outcome_advantage(rewards, mask, groups),
        "rloo": adv.compute_rloo_outcome_advantage(rewards, mask, groups),
        "reinforce_plus_plus": adv.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, 0.99),
    }
    for name, (ref_adv, ref_ret) in expected.items():
        got_adv, got_ret = adv.get_adv_estimator(name)(rewards, mask, **inputs)
        assert torch.equal(got_adv, ref_adv) and torch.equal(got_ret, ref_ret), name
    assert adv.adv_estimator_uses_critic("gae") and not adv.adv_estimator_uses_critic("grpo")
    with pytest.raises(ValueError, match="adv_estimator"):
        adv.get_adv_estimator("ppo2")
    with pytest.raises(ValueError, match="values"):
        adv.get_adv_estimator("gae")(rewards, mask, group_index=groups)


def test_kl_penalty_kinds_hand_values():
    logp = torch.tensor([-1.0, -2.0, -0.5, -30.0], dtype=D)
    ref = torch.tensor([-1.5, -1.0, -0.5, -1.0], dtype=D)
    d = (logp - ref).tolist()  # log r
    k3 = [min(max(math.exp(-min(max(x, -20), 20)) + min(max(x, -20), 20) - 1, -10), 10) for x in d]
    k2 = [0.5 * x * x for x in d]
    table = {"kl": d, "k1": d, "abs": [abs(x) for x in d], "mse": k2, "k2": k2, "low_var_kl": k3, "k3": k3}
    for kind, expected in table.items():
        assert torch.allclose(adv.kl_penalty(logp, ref, kind), torch.tensor(expected, dtype=D)), kind
    assert adv.kl_penalty(logp, ref, "k3")[3].item() == 10.0  # clamped
    with pytest.raises(ValueError, match="full"):
        adv.kl_penalty(logp, ref, "full")


def test_adaptive_kl_controller_update_and_state():
    ctrl = adv.AdaptiveKLController(init_kl_coef=0.1, target_kl=0.05, horizon=100)
    ctrl.update(current_kl=0.055, n_steps=10)  # error 0.1 -> x1.01
    assert ctrl.value == pytest.approx(0.101)
    ctrl.update(current_kl=5.0, n_steps=10)  # error clipped to +0.2 -> x1.02
    assert ctrl.value == pytest.approx(0.101 * 1.02)
    ctrl.update(current_kl=0.0, n_steps=50)  # error clipped to -0.2 -> x0.9
    assert ctrl.value == pytest.approx(0.101 * 1.02 * 0.9)
    restored = adv.AdaptiveKLController(0.5, 0.05, 100)
    restored.load_state_dict(ctrl.state_dict())
    assert restored.value == ctrl.value
    fixed = adv.FixedKLController(0.2)
    fixed.update(1.0, 100)
    assert fixed.value == 0.2


def test_make_kl_controller_from_config():
    fixed = adv.make_kl_controller({"type": "fixed", "kl_coef": 0.3})
    assert type(fixed) is adv.FixedKLController and fixed.value == 0.3
    cfg = OmegaConf.create({"type": "adaptive", "kl_coef": 0.2, "target_kl": 0.1, "horizon": 500})
    adaptive = adv.make_kl_controller(cfg)
    assert isinstance(adaptive, adv.AdaptiveKLController)
    assert (adaptive.value, adaptive.target, adaptive.horizon) == (0.2, 0.1, 500)
    with pytest.raises(ValueError, match="kl_ctrl.type"):
        adv.make_kl_controller({"type": "pid"})
    with pytest.raises(ValueError, match="horizon"):
        adv.make_kl_controller({"type": "adaptive", "horizon": 0})


def test_apply_kl_penalty_matches_loop_and_updates_controller():
    scores, old, mask = _batch(seed=1)
    ref = old + 0.3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(2), dtype=D)
    ctrl = adv.AdaptiveKLController(init_kl_coef=0.2, target_kl=1.0, horizon=60)
    rewards, metrics = adv.apply_kl_penalty(scores, old, ref, mask, ctrl, kind="k2")
    per_seq = []
    for i in range(scores.shape[0]):
        kls = [0.5 * (old[i, t] - ref[i, t]).item() ** 2 if mask[i, t] else 0.0 for t in range(scores.shape[1])]
        for t, kl in enumerate(kls):
            assert rewards[i, t].item() == pytest.approx(scores[i, t].item() - 0.2 * kl)
        n = int(mask[i].sum())
        per_seq.append(sum(kls) / n if n else 0.0)
    current_kl = sum(per_seq) / len(per_seq)
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(current_kl)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.2
    error = min(max(current_kl / 1.0 - 1, -0.2), 0.2)
    assert ctrl.value == pytest.approx(0.2 * (1 + error * scores.shape[0] / 60))


def test_overlong_penalty_hand_values():
    # max 20, buffer 4: free up to 16 tokens, then -0.25 * factor per token
    penalty = adv.overlong_penalty([10, 16, 17, 18, 20], max_response_length=20, buffer_len=4, penalty_factor=2.0)
    assert torch.allclose(penalty, torch.tensor([0.0, 0.0, -0.5, -1.0, -2.0]))
    with pytest.raises(ValueError, match="overlong_buffer.len"):
        adv.overlong_penalty([1], max_response_length=20, buffer_len=0, penalty_factor=1.0)


def test_dynamic_sampling_keeps_groups_with_varied_metric():
    groups = ["p", "q", "p", "r", "q", "s", "s"]
    metric = [1.0, 0.0, 0.0, 0.7, 0.0, 0.1, 0.1]  # p varied, q uniform, r single, s uniform
    keep = adv.dynamic_sampling_keep_mask(groups, metric)
    assert keep.tolist() == [True, False, True, True, False, False, False]
    # an all-0.1 group whose float std is not exactly 0 is still dropped
    assert not adv.dynamic_sampling_keep_mask([0, 0, 0], [0.1, 0.1, 0.1]).any()
