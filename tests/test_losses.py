"""PPO losses against brute-force per-element loops, and the gradient-accumulation contract:
micro-batch losses with the global normaliser sum to the full-batch loss (values and grads)."""

import math

import pytest
import torch

from hybridengine.rl import losses
from hybridengine.rl.advantages import kl_penalty

D = torch.float64
MODES = losses.LOSS_AGG_MODES


def _batch(seed: int = 0, batch_size: int = 7, max_len: int = 6):
    """Random [B, R] tensors; the mask has ragged lengths, an interior hole and an empty row."""
    g = torch.Generator().manual_seed(seed)
    lengths = [6, 4, 1, 0, 5, 3, 2][:batch_size]
    mask = torch.zeros(batch_size, max_len, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    mask[0, 2] = 0
    old = -torch.rand(batch_size, max_len, generator=g, dtype=D) * 3
    new = old + 0.4 * torch.randn(batch_size, max_len, generator=g, dtype=D)
    advantages = torch.randn(batch_size, max_len, generator=g, dtype=D)
    return old, new, advantages, mask


def _agg_reference(loss, mask, mode, scale=None):
    """Loops over valid tokens; a fully masked row is not a sequence."""
    rows = [[loss[i, t].item() for t in range(loss.shape[1]) if mask[i, t]] for i in range(loss.shape[0])]
    rows = [r for r in rows if r]
    if mode == "token-mean":
        return sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in rows) / len(rows)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows) / len(rows)
    # Dr. GRPO (verl): the token sum over a constant (loss_scale_factor, default R), no sequence count
    return sum(sum(r) for r in rows) / (loss.shape[1] if scale is None else scale)


@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_matches_loops(mode):
    _, _, loss, mask = _batch()
    loss = loss.masked_fill(~mask.bool(), float("inf"))  # padding must never leak in
    assert losses.agg_loss(loss, mask, mode).item() == pytest.approx(_agg_reference(loss, mask, mode))
    if mode == "seq-mean-token-sum-norm":
        got = losses.agg_loss(loss, mask, mode, loss_scale_factor=100)
        assert got.item() == pytest.approx(_agg_reference(loss, mask, mode, scale=100))


def test_loss_normalizer_counts():
    _, _, _, mask = _batch()
    assert losses.loss_normalizer(mask, "token-mean") == int(mask.sum())
    for mode in MODES[1:]:
        assert losses.loss_normalizer(mask, mode) == 6  # one of the 7 rows is empty


def _chunks(batch_size: int):
    """Uneven micro-batches, as DP ranks x micro-batches would cut them."""
    return [slice(0, 3), slice(3, 4), slice(4, 7)]


@pytest.mark.parametrize("mode", MODES)
def test_micro_batch_losses_sum_to_full_batch(mode):
    old, new, advantages, mask = _batch()
    full_logp = new.clone().requires_grad_(True)
    full, *_ = losses.compute_policy_loss(old, full_logp, advantages, mask, 0.2, 0.28, 3.0, mode)
    full.backward()

    parts = _chunks(mask.shape[0])
    normalizer = sum(losses.loss_normalizer(mask[p], mode) for p in parts)
    chunk_logp = new.clone().requires_grad_(True)
    total = 0.0
    for p in parts:
        chunk_loss, *_ = losses.compute_policy_loss(
            old[p], chunk_logp[p], advantages[p], mask[p], 0.2, 0.28, 3.0, mode, global_normalizer=normalizer
        )
        chunk_loss.backward()  # accumulate, no 1/num_chunks scaling
        total = total + chunk_loss.item()
    assert total == pytest.approx(full.item(), rel=1e-12)
    assert torch.allclose(chunk_logp.grad, full_logp.grad, rtol=1e-12, atol=1e-15)
    # a chunk without the global normaliser is a local mean: summing those would be wrong; the
    # Dr. GRPO mode has a constant divisor instead of a normaliser, so its chunks add up as they are
    local_sum = sum(losses.agg_loss(advantages[p], mask[p], mode).item() for p in parts)
    if mode == "seq-mean-token-sum-norm":
        assert local_sum == pytest.approx(losses.agg_loss(advantages, mask, mode).item(), rel=1e-12)
    else:
        assert local_sum != pytest.approx(losses.agg_loss(advantages, mask, mode).item())


@pytest.mark.parametrize("mode", MODES)
def test_value_entropy_kl_losses_chunk_parity(mode):
    old, new, returns, mask = _batch(seed=3)
    parts = _chunks(mask.shape[0])
    normalizer = sum(losses.loss_normalizer(mask[p], mode) for p in parts)
    full_vf, _ = losses.compute_value_loss(new, returns, old, mask, 0.2, mode)
    full_ent = losses.compute_entropy_loss(-old, mask, mode)
    full_kl = losses.compute_kl_loss(new, old, mask, "k3", mode)
    vf = sum(losses.compute_value_loss(new[p], returns[p], old[p], mask[p], 0.2, mode, normalizer)[0] for p in parts)
    ent = sum(losses.compute_entropy_loss(-old[p], mask[p], mode, normalizer) for p in parts)
    kl = sum(losses.compute_kl_loss(new[p], old[p], mask[p], "k3", mode, normalizer) for p in parts)
    assert torch.allclose(vf, full_vf) and torch.allclose(ent, full_ent) and torch.allclose(kl, full_kl)


def _policy_token_reference(old, new, a, low, high, c):
    """One token of dual-clip PPO with clip-higher; returns (loss, clipped, dual_clipped)."""
    ratio = math.exp(min(max(new - old, -20.0), 20.0))
    unclipped = -a * ratio
    clipped = -a * min(max(ratio, 1 - low), 1 + high)
    loss = max(unclipped, clipped)
    dual = a < 0 and loss > -a * c
    if a < 0:
        loss = min(loss, -a * c)
    return loss, clipped > unclipped, dual


def test_policy_loss_matches_per_token_loop():
    old, new, advantages, mask = _batch(seed=5)
    new = new.clone()
    new[1, 0], advantages[1, 0] = old[1, 0] + 2.0, -1.5  # ratio e^2 > c = 3 with A < 0: dual clip
    new[4, 1], advantages[4, 1] = old[4, 1] + 0.25, 1.0  # ratio 1.28 > 1 + high: clip-higher active
    low, high, c = 0.2, 0.28, 3.0
    pg_loss, clipfrac, ppo_kl, clipfrac_lower = losses.compute_policy_loss(
        old, new, advantages, mask, low, high, c, "token-mean"
    )
    token_losses, n_clipped, n_dual, kls = [], 0, 0, []
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if mask[i, t]:
                loss, clipped, dual = _policy_token_reference(
                    old[i, t].item(), new[i, t].item(), advantages[i, t].item(), low, high, c
                )
                token_losses.append(loss)
                n_clipped += clipped
                n_dual += dual
                kls.append(old[i, t].item() - new[i, t].item())
    n = len(token_losses)
    assert n_dual >= 1 and n_clipped >= 2
    assert pg_loss.item() == pytest.approx(sum(token_losses) / n)
    assert clipfrac.item() == pytest.approx(n_clipped / n)
    assert clipfrac_lower.item() == pytest.approx(n_dual / n)
    assert ppo_kl.item() == pytest.approx(sum(kls) / n)


def test_policy_loss_hand_values():
    old = torch.zeros(1, 4, dtype=D)
    new = torch.log(torch.tensor([[1.5, 0.5, 5.0, 1.1]], dtype=D))
    a = torch.tensor([[1.0, -1.0, -2.0, 1.0]], dtype=D)
    mask = torch.ones(1, 4)
    # ratio 1.5, A=1: min(1.5, 1.28) -> loss -1.28 (clipped high)
    # ratio 0.5, A=-1: max(0.5, 0.8) -> loss 0.8 (clipped low)
    # ratio 5.0, A=-2: max(10, 2.56) = 10, dual clip min(10, 6) -> 6
    # ratio 1.1, A=1: -1.1 (inside)
    pg_loss, clipfrac, _, clipfrac_lower = losses.compute_policy_loss(old, new, a, mask, 0.2, 0.28, 3.0)
    assert pg_loss.item() == pytest.approx((-1.28 + 0.8 + 6.0 - 1.1) / 4)
    assert clipfrac.item() == pytest.approx(2 / 4)
    assert clipfrac_lower.item() == pytest.approx(1 / 4)


def test_value_loss_matches_per_token_loop():
    values, vpreds, returns, mask = _batch(seed=7)
    clip = 0.1
    vf_loss, vf_clipfrac = losses.compute_value_loss(vpreds, returns, values, mask, clip, "seq-mean-token-mean")
    per_seq, n_clipped, n_tokens = [], 0, 0
    for i in range(mask.shape[0]):
        row = []
        for t in range(mask.shape[1]):
            if mask[i, t]:
                v, g, old = vpreds[i, t].item(), returns[i, t].item(), values[i, t].item()
                unclipped, clipped = (v - g) ** 2, (min(max(v, old - clip), old + clip) - g) ** 2
                row.append(max(unclipped, clipped))
                n_clipped += clipped > unclipped
                n_tokens += 1
        if row:
            per_seq.append(sum(row) / len(row))
    assert vf_loss.item() == pytest.approx(0.5 * sum(per_seq) / len(per_seq))
    assert vf_clipfrac.item() == pytest.approx(n_clipped / n_tokens)


def test_kl_and_entropy_losses_aggregate_their_token_terms():
    old, new, entropy, mask = _batch(seed=9)
    for kind in ("k1", "k2", "k3"):
        got = losses.compute_kl_loss(new, old, mask, kind, "token-mean")
        assert torch.allclose(got, losses.agg_loss(kl_penalty(new, old, kind), mask, "token-mean"))
    got = losses.compute_entropy_loss(entropy.abs(), mask, "seq-mean-token-sum")
    assert got.item() == pytest.approx(_agg_reference(entropy.abs(), mask, "seq-mean-token-sum"))


def test_bad_arguments_raise():
    old, new, advantages, mask = _batch()
    with pytest.raises(ValueError, match="loss_agg_mode"):
        losses.agg_loss(advantages, mask, "token-sum", global_normalizer=5)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        losses.compute_policy_loss(old, new, advantages, mask, 0.2, 0.2, clip_ratio_c=1.0)


def test_empty_mask_gives_zero_loss_with_graph():
    _, new, advantages, _ = _batch()
    logp = new.clone().requires_grad_(True)
    empty = torch.zeros_like(advantages, dtype=torch.long)
    for mode in MODES:
        loss, *_ = losses.compute_policy_loss(new.detach(), logp, advantages, empty, 0.2, 0.2, 3.0, mode)
        loss.backward()
        assert loss.item() == 0.0 and torch.count_nonzero(logp.grad) == 0
