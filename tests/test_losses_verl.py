"""verl parity of the policy-loss side: every policy-loss mode, agg_loss in its four modes (whole
batch and micro-batches with the global normaliser), and the rollout-correction IS weights, each
against a transcription of verl's formula written here (verl/trainer/ppo/core_algos.py,
rollout_corr_helper.py at the snapshot this repo follows) on seeded float64 inputs with ragged
masks, an empty row, extreme ratios and negative advantages; rel <= 1e-6."""

import math

import pytest
import torch

from hybridengine.config import load_config, validate_config
from hybridengine.config.checks import POLICY_LOSS_MODES, ROLLOUT_IS_LEVELS
from hybridengine.rl import losses, rollout_correction as rc
from hybridengine.rl.batch import Batch
from hybridengine.rl.losses import GlobalBatchInfo, PolicyLossConfig

D = torch.float64
MODES = losses.LOSS_AGG_MODES
REL = 1e-6


def _close(ours, ref, what=""):
    ours = torch.as_tensor(ours, dtype=D)
    ref = torch.as_tensor(ref, dtype=D)
    torch.testing.assert_close(ours, ref, rtol=REL, atol=1e-12, msg=lambda m: f"{what}: {m}")


def _inputs(seed: int = 0):
    """[8, 12]: ragged rows, an interior hole, an empty row; log-ratios of +-25 (past verl's +-20
    clamp) and 12 (GSPO's 10), a row of negative advantages."""
    g = torch.Generator().manual_seed(seed)
    batch_size, width = 8, 12
    mask = torch.zeros(batch_size, width, dtype=D)
    for i, n in enumerate([12, 7, 1, 0, 9, 4, 12, 3]):
        mask[i, :n] = 1
    mask[0, 5] = 0
    old = -torch.rand(batch_size, width, generator=g, dtype=D) * 3
    new = old + 0.5 * torch.randn(batch_size, width, generator=g, dtype=D)
    new[1, 2], new[4, 3], new[6, 0] = old[1, 2] + 25.0, old[4, 3] - 25.0, old[6, 0] + 1.5
    new[2, 0] = old[2, 0] + 12.0    # a one-token sequence past GSPO's log-ratio clamp at 10
    advantages = 2 * torch.randn(batch_size, width, generator=g, dtype=D)
    advantages[6] = -advantages[6].abs()
    return old, new, advantages, mask


# ----------------------------------------------------------------------------- verl, transcribed


def v_masked_sum(values, mask, axis=None):
    kept = torch.where(mask.bool(), values, 0.0) * mask
    return kept.sum() if axis is None else kept.sum(axis)


def v_masked_mean(values, mask, axis=None):
    return v_masked_sum(values, mask, axis) / ((mask.sum() if axis is None else mask.sum(axis)) + 1e-8)


def v_agg_loss(loss_mat, loss_mask, mode, dp_size=1, batch_num_tokens=None, global_batch_size=None,
               loss_scale_factor=None):
    if mode == "token-mean":
        n = loss_mask.sum() if batch_num_tokens is None else batch_num_tokens
        return v_masked_sum(loss_mat, loss_mask) / n * dp_size
    if mode == "seq-mean-token-sum-norm":
        seq = torch.sum(loss_mat * loss_mask, dim=-1)
        return seq.sum() / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    count = loss_mask.sum(-1)
    seq = torch.sum(loss_mat * loss_mask, dim=-1)
    if mode == "seq-mean-token-mean":
        seq = seq / (count + 1e-8)
    seq_mask = (count > 0).to(loss_mat.dtype)
    n = seq_mask.sum() if global_batch_size is None else global_batch_size
    return v_masked_sum(seq, seq_mask) / n * dp_size


def v_vanilla(old, logp, adv, mask, mode, cfg, info, w):
    nkl = torch.clamp(logp - old, min=-20.0, max=20.0)
    ratio = torch.exp(nkl)
    ppo_kl = v_masked_mean(-nkl, mask)
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high)
    c1 = torch.maximum(l1, l2)
    clipfrac = v_masked_mean(torch.gt(l2, l1).to(D), mask)
    l3 = -adv * cfg.clip_ratio_c
    c2 = torch.min(l3, c1)
    lower = v_masked_mean(torch.gt(c1, l3) * (adv < 0).to(D), mask)
    pg = torch.where(adv < 0, c2, c1)
    if w is not None:
        pg = pg * w
    return v_agg_loss(pg, mask, mode, **info), {"pg_clipfrac": clipfrac, "ppo_kl": ppo_kl,
                                                "pg_clipfrac_lower": lower}


def v_gspo(old, logp, adv, mask, mode, cfg, info, w):
    nkl = logp - old
    lengths = torch.sum(mask, dim=-1).clamp(min=1)
    nkl_seq = torch.sum(nkl * mask, dim=-1) / lengths
    log_s = torch.clamp(logp - logp.detach() + nkl_seq.detach().unsqueeze(-1), max=10.0)
    s = torch.exp(log_s)
    l1 = -adv * s
    l2 = -adv * torch.clamp(s, 1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high)
    pg = torch.maximum(l1, l2)
    if w is not None:
        pg = pg * w
    loss = v_agg_loss(pg, mask, "seq-mean-token-mean", **info)
    return loss, {"pg_clipfrac": v_masked_mean(torch.gt(l2, l1).to(D), mask),
                  "ppo_kl": v_masked_mean(-nkl, mask), "pg_clipfrac_lower": torch.tensor(0.0)}


def v_gpg(old, logp, adv, mask, mode, cfg, info, w):
    pg = -logp * adv
    if w is not None:
        pg = pg * w
    return v_agg_loss(pg, mask, mode, **info), {}


def v_clip_cov(old, logp, adv, mask, mode, cfg, info, w, generator=None):
    nkl = logp - old
    ratio = torch.exp(nkl)
    ppo_kl = v_masked_mean(-nkl, mask)
    l1 = -adv * ratio
    corr = torch.ones_like(adv)
    l2 = -adv * torch.clamp(ratio, 1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high)
    clip_by_origin = (l2 > l1) & (mask > 0)
    cov = (adv - v_masked_mean(adv, mask)) * (logp - v_masked_mean(logp.detach(), mask))
    cov[mask == 0] = -torch.inf
    cov[clip_by_origin] = -torch.inf
    clip_num = max(int(cfg.clip_cov_ratio * mask.sum().item()), 1)
    idx = torch.nonzero((cov < cfg.clip_cov_ub) & (cov > cfg.clip_cov_lb) & (mask > 0))
    num_candidates = len(idx)
    if len(idx) > 0:
        perm = torch.randperm(len(idx), generator=generator)
        idx = idx[perm[: min(clip_num, len(idx))]]
    corr[idx[:, 0], idx[:, 1]] = 0
    clipfrac = v_masked_mean((corr == 0).to(D), mask)
    pg = torch.maximum(l1, l2) * corr
    if w is not None:
        pg = pg * w
    return v_agg_loss(pg, mask, mode, **info), {"pg_clipfrac": clipfrac, "ppo_kl": ppo_kl}, \
        (num_candidates, clip_num)


def v_kl_cov(old, logp, adv, mask, mode, cfg, info, w):
    nkl = logp - old
    ratio = torch.exp(nkl)
    ppo_kl_abs = v_masked_mean(nkl.abs(), mask)
    pg = -adv * ratio
    pg_kl = -adv * ratio + cfg.ppo_kl_coef * nkl.abs()
    valid = mask > 0
    valid_idx = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
    a, lp = adv[valid].detach().reshape(-1), logp[valid].detach().reshape(-1)
    if len(a):
        cov = (a - a.mean()) * (lp - lp.mean())
        k = max(1, int(len(cov) * cfg.kl_cov_ratio))
        top = valid_idx[torch.topk(cov, k, largest=True).indices]
        rows, cols = top // adv.shape[1], top % adv.shape[1]
        pg = pg.clone()
        pg[rows, cols] = pg_kl[rows, cols]
    if w is not None:
        pg = pg * w
    return v_agg_loss(pg, mask, mode, **info), {"ppo_kl": ppo_kl_abs}


VERL = {"vanilla": v_vanilla, "gspo": v_gspo, "gpg": v_gpg, "kl_cov": v_kl_cov,
        "clip_cov": lambda *a: v_clip_cov(*a, generator=torch.Generator().manual_seed(7))[:2]}
CONFIGS = {  # mode -> settings that exercise it (clip-higher, a random clip_cov subset, kl_cov top-k)
    "vanilla": PolicyLossConfig("vanilla", 0.2, 0.28, 3.0),
    "gspo": PolicyLossConfig("gspo", 3e-4, 4e-4),
    "gpg": PolicyLossConfig("gpg"),
    "clip_cov": PolicyLossConfig("clip_cov", 0.2, 0.28, clip_cov_ratio=0.05, clip_cov_lb=0.5),
    "kl_cov": PolicyLossConfig("kl_cov", kl_cov_ratio=0.2, ppo_kl_coef=0.5),
}


def _ours(mode_name, old, logp, adv, mask, agg_mode, cfg, info, w):
    fn = losses.get_policy_loss_fn(mode_name)
    return fn(old, logp, adv, mask, agg_mode, cfg, info, rollout_is_weights=w,
              generator=torch.Generator().manual_seed(7))


def _is_weights(old, mask, seed=11):
    """Truncated token IS weights from a rollout log-prob that drifts from old (some far)."""
    g = torch.Generator().manual_seed(seed)
    rollout = old + 0.3 * torch.randn(old.shape, generator=g, dtype=D)
    rollout[2, 0] = old[2, 0] - 30.0
    return rc.compute_rollout_is_weights(old - rollout, mask, "token", 2.0)[0]


# ----------------------------------------------------------------------------- policy losses


def test_registry_matches_config_choices():
    assert losses.policy_loss_modes() == POLICY_LOSS_MODES
    assert set(VERL) == set(POLICY_LOSS_MODES) and rc.IS_LEVELS == ROLLOUT_IS_LEVELS
    with pytest.raises(ValueError, match="loss_mode='sapo' is unknown; choose from vanilla, gspo"):
        losses.get_policy_loss_fn("sapo")


@pytest.mark.parametrize("agg_mode", MODES)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("mode", POLICY_LOSS_MODES)
def test_policy_loss_matches_verl(mode, agg_mode, weighted):
    old, new, adv, mask = _inputs(seed=1)
    w = _is_weights(old, mask) if weighted else None
    cfg = CONFIGS[mode]
    ours_lp, ref_lp = new.clone().requires_grad_(True), new.clone().requires_grad_(True)
    loss, metrics = _ours(mode, old, ours_lp, adv, mask, agg_mode, cfg, GlobalBatchInfo(), w)
    ref_loss, ref_metrics = VERL[mode](old, ref_lp, adv, mask, agg_mode, cfg, {}, w)
    _close(loss, ref_loss, f"{mode} loss")
    assert set(metrics) == set(ref_metrics)
    for key in metrics:
        _close(metrics[key], ref_metrics[key], f"{mode} {key}")
    loss.backward()
    ref_loss.backward()
    _close(ours_lp.grad, ref_lp.grad, f"{mode} grad")


def test_policy_inputs_reach_every_branch():
    """The inputs above are not vacuous: clips, dual clips, a random clip_cov subset, kl_cov top-k."""
    old, new, adv, mask = _inputs(seed=1)
    _, m = losses.compute_policy_loss_vanilla(old, new, adv, mask, config=CONFIGS["vanilla"])
    assert m["pg_clipfrac"] > 0 and m["pg_clipfrac_lower"] > 0
    _, m, (candidates, num_cut) = v_clip_cov(old, new, adv, mask, "token-mean", CONFIGS["clip_cov"], {}, None)
    assert candidates > num_cut > 1 and m["pg_clipfrac"] > 0
    assert int(mask.sum() * CONFIGS["kl_cov"].kl_cov_ratio) > 1
    _, m = losses.compute_policy_loss_gspo(old, new, adv, mask, config=CONFIGS["gspo"])
    assert 0 < m["pg_clipfrac"] < 1


@pytest.mark.parametrize("agg_mode", MODES)
@pytest.mark.parametrize("mode", POLICY_LOSS_MODES)
def test_micro_batches_with_global_info(mode, agg_mode):
    """Each micro-batch with GlobalBatchInfo equals verl's loss on that micro-batch with its
    global_batch_info; where the token choice is not micro-batch-local, they sum to the whole."""
    old, new, adv, mask = _inputs(seed=2)
    w = _is_weights(old, mask, seed=5)
    cfg, scale = CONFIGS[mode], 20.0
    info = GlobalBatchInfo.of(mask, scale)
    v_info = dict(batch_num_tokens=mask.sum(), global_batch_size=(mask.sum(-1) > 0).sum(),
                  loss_scale_factor=scale)
    total, ref_total = 0.0, 0.0
    for p in (slice(0, 3), slice(3, 4), slice(4, 8)):
        loss, _ = _ours(mode, old[p], new[p], adv[p], mask[p], agg_mode, cfg, info, w[p])
        ref, _ = VERL[mode](old[p], new[p], adv[p], mask[p], agg_mode, cfg, v_info, w[p])
        _close(loss, ref, f"{mode} micro-batch")
        total, ref_total = total + loss, ref_total + ref
    if mode not in ("clip_cov", "kl_cov"):      # their token choice is micro-batch-local (rl.losses)
        whole, _ = VERL[mode](old, new, adv, mask, agg_mode, cfg, {"loss_scale_factor": scale}, w)
        _close(total, whole, f"{mode} sum of micro-batches")


def test_legacy_vanilla_wrapper_is_the_vanilla_mode():
    old, new, adv, mask = _inputs(seed=3)
    got = losses.compute_policy_loss(old, new, adv, mask, 0.2, 0.28, 3.0, "seq-mean-token-mean")
    loss, m = losses.compute_policy_loss_vanilla(old, new, adv, mask, "seq-mean-token-mean", CONFIGS["vanilla"])
    assert torch.equal(got[0], loss) and torch.equal(got[2], m["ppo_kl"])


# ----------------------------------------------------------------------------- agg_loss


@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_whole_and_micro_batches_match_verl(mode):
    _, _, loss_mat, mask = _inputs(seed=4)
    _close(losses.agg_loss(loss_mat, mask, mode), v_agg_loss(loss_mat, mask, mode), "whole batch")
    _close(losses.agg_loss(loss_mat, mask, mode, loss_scale_factor=300),
           v_agg_loss(loss_mat, mask, mode, loss_scale_factor=300), "with loss_scale_factor")
    # micro-batches cut to their own padded width; the constant factor keeps them summing
    width = mask.shape[-1]
    info = GlobalBatchInfo.of(mask, width)
    total = 0.0
    for p in (slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)):
        w = int(torch.nonzero(mask[p])[:, 1].max()) + 1     # the last valid column
        total = total + info.agg(loss_mat[p, :w], mask[p, :w], mode)
    _close(total, v_agg_loss(loss_mat, mask, mode), "sum of micro-batches")


def test_dr_grpo_divides_by_the_constant_only():
    _, _, loss_mat, mask = _inputs(seed=6)
    got = losses.agg_loss(loss_mat, mask, "seq-mean-token-sum-norm", global_normalizer=123, loss_scale_factor=64)
    _close(got, (loss_mat * mask).sum() / 64, "Dr. GRPO")
    # the micro-batch's own width would differ from batch to batch
    narrow = losses.agg_loss(loss_mat[2:4, :1], mask[2:4, :1], "seq-mean-token-sum-norm")
    assert narrow.item() == pytest.approx((loss_mat[2, 0]).item())


# ----------------------------------------------------------------------------- rollout correction


def v_is_weights(log_ratio, mask, level, threshold, batch_normalize):
    """compute_rollout_correction_weights + compute_is_metrics (verl), single process."""
    if level == "token":
        for_metrics = log_ratio
        w = torch.exp(torch.clamp(log_ratio, min=-20.0, max=20.0))
    else:
        for_metrics = v_masked_sum(log_ratio, mask, axis=-1).unsqueeze(-1)
        w = torch.exp(torch.clamp(for_metrics, min=-20.0, max=20.0)).expand_as(log_ratio)
    w = w * mask
    m, lower = {}, 1.0 / threshold
    if level == "sequence":
        m["rollout_is_max"] = torch.exp(torch.clamp(for_metrics.max(), max=20.0)).item()
        m["rollout_is_min"] = torch.exp(for_metrics.min()).item()
        m["rollout_is_mean"] = v_masked_mean(w, mask).item()
        m["rollout_is_ratio_fraction_high"] = (for_metrics > math.log(threshold)).to(D).mean().item()
        m["rollout_is_ratio_fraction_low"] = (for_metrics < math.log(lower)).to(D).mean().item()
    else:
        m["rollout_is_mean"] = v_masked_mean(w, mask).item()
        m["rollout_is_ratio_fraction_high"] = v_masked_mean((w > threshold).to(D), mask).item()
        m["rollout_is_ratio_fraction_low"] = v_masked_mean((w < lower).to(D), mask).item()
        m["rollout_is_max"] = w.masked_fill(~mask.bool(), float("-inf")).max().item()
        m["rollout_is_min"] = w.masked_fill(~mask.bool(), float("inf")).min().item()
    clamped = w.clamp(min=lower, max=threshold)
    mean = v_masked_mean(clamped, mask)
    var = v_masked_mean(clamped.square(), mask) - mean.square()
    m["rollout_is_std"] = torch.sqrt(torch.clamp(var, min=0.0)).item() if mask.sum() > 1 else 0.0
    m["rollout_is_eff_sample_size"] = 1.0 / v_masked_mean((clamped / (mean + 1e-8)).square(), mask).item()
    seq = v_masked_mean(w, mask, axis=-1)
    m.update(rollout_is_seq_mean=seq.mean().item(), rollout_is_seq_std=seq.std().item(),
             rollout_is_seq_max=seq.max().item(), rollout_is_seq_min=seq.min().item(),
             rollout_is_seq_max_deviation=(seq - 1.0).abs().max().item(),
             rollout_is_seq_fraction_high=(seq > threshold).to(D).mean().item(),
             rollout_is_seq_fraction_low=(seq < lower).to(D).mean().item())
    w = w.clamp(max=threshold).detach()
    if batch_normalize:
        if level == "token":
            norm = v_masked_mean(w, mask)
        else:
            seq_mask = (mask.sum(-1) > 0).to(D)
            norm = (v_masked_mean(w, mask, axis=-1) * seq_mask).sum() / seq_mask.sum().clamp_min(1e-8)
        w = w / norm if norm > 1e-8 else w
        m["rollout_is_batch_norm_factor"] = norm.item() if norm > 1e-8 else 1.0
    return w, m


def v_offpolicy(old, rollout, mask):
    m = {}
    mean_old = v_masked_mean(old, mask, axis=-1)
    m["training_ppl"] = torch.exp(-mean_old).mean().item()
    m["training_log_ppl"] = (-mean_old).mean().item()
    m["kl"] = v_masked_mean(rollout - old, mask).item()
    log_ratio = old - rollout
    m["k3_kl"] = v_masked_mean(torch.exp(log_ratio) - log_ratio - 1, mask).item()
    mean_rollout = v_masked_mean(rollout, mask, axis=-1)
    m["rollout_ppl"] = torch.exp(-mean_rollout).mean().item()
    m["rollout_log_ppl"] = (-mean_rollout).mean().item()
    diff = mean_rollout - mean_old
    m.update(log_ppl_diff=diff.mean().item(), log_ppl_abs_diff=diff.abs().mean().item(),
             log_ppl_diff_max=diff.max().item(), log_ppl_diff_min=diff.min().item(),
             ppl_ratio=torch.exp(diff).mean().item())
    rho = torch.exp(torch.clamp(log_ratio, min=-20.0, max=20.0))
    m["chi2_token"] = (v_masked_mean(rho.square(), mask) - 1.0).item()
    seq = torch.clamp(v_masked_sum(log_ratio, mask, axis=-1), min=-20.0, max=20.0)
    m["chi2_seq"] = (torch.exp(2.0 * seq).mean() - 1.0).item()
    return m


def _rollout_logprob(old, seed=8):
    """old's rows drifted: small noise, a token past the +-20 safety bound, a row far off."""
    g = torch.Generator().manual_seed(seed)
    rollout = old + 0.2 * torch.randn(old.shape, generator=g, dtype=D)
    rollout[0, 1] = old[0, 1] - 24.0
    rollout[5, :4] = old[5, :4] + 2.0
    return rollout


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("threshold", [2.0, 5.0])
@pytest.mark.parametrize("level", ROLLOUT_IS_LEVELS)
def test_is_weights_match_verl(level, threshold, normalize):
    old, _, _, mask = _inputs(seed=9)
    rollout = _rollout_logprob(old)
    weights, metrics = rc.compute_rollout_is_weights(old - rollout, mask, level, threshold, normalize)
    ref, _ = v_is_weights(old - rollout, mask, level, threshold, normalize)
    _close(weights, ref, "weights")
    assert not weights.requires_grad and weights[mask == 0].abs().sum() == 0
    # statistics: verl's over the sequences (an empty row is padding here, not a sequence)
    rows = mask.sum(-1) > 0
    _, ref_metrics = v_is_weights((old - rollout)[rows], mask[rows], level, threshold, normalize)
    assert set(metrics) == set(ref_metrics)
    for key in metrics:
        _close(metrics[key], ref_metrics[key], key)
    assert metrics["rollout_is_ratio_fraction_high"] > 0 and metrics["rollout_is_ratio_fraction_low"] > 0


def test_offpolicy_metrics_match_verl():
    old, _, _, mask = _inputs(seed=10)
    rollout = _rollout_logprob(old, seed=12)
    rows = mask.sum(-1) > 0
    got = rc.compute_offpolicy_metrics(old, rollout, mask)
    ref = v_offpolicy(old[rows], rollout[rows], mask[rows])
    assert set(got) == set(ref)
    for key in got:
        _close(got[key], ref[key], key)


def _batch(old, rollout, mask):
    lengths = [int(n) for n in mask.sum(-1)]
    b = Batch([[1]] * len(lengths), [[2] * n for n in lengths], list(range(len(lengths))), ["x"] * len(lengths),
              [None] * len(lengths), [{}] * len(lengths), mask.shape[1])
    b.tensors.update(old_logprob=old.float(), rollout_logprob=rollout.float())
    return b


def test_apply_rollout_correction_on_a_batch():
    old, _, _, mask = _inputs(seed=13)
    mask = (torch.arange(mask.shape[1])[None] < mask.sum(-1, keepdim=True)).to(D)   # no holes
    rollout = _rollout_logprob(old)
    off = _batch(old, rollout, mask)
    metrics = rc.apply_rollout_correction(off, rc.RolloutCorrectionConfig())
    assert "rollout_is_weights" not in off.tensors
    assert all(k.startswith("rollout_corr/") for k in metrics) and "rollout_corr/k3_kl" in metrics
    on = _batch(old, rollout, mask)
    cfg = rc.RolloutCorrectionConfig("sequence", 3.0)
    metrics = rc.apply_rollout_correction(on, cfg)
    expected, _ = v_is_weights((old - rollout).float().double(), mask, "sequence", 3.0, False)
    torch.testing.assert_close(on.tensors["rollout_is_weights"].double(), expected, rtol=1e-5, atol=1e-6)
    assert "rollout_corr/rollout_is_seq_mean" in metrics
    unknown = _batch(old, torch.full_like(rollout, float("nan")), mask)
    with pytest.raises(ValueError, match="rollout_is=sequence needs the rollout's sampling log-probs"):
        rc.apply_rollout_correction(unknown, cfg)
    assert rc.apply_rollout_correction(unknown, rc.RolloutCorrectionConfig()) == {}


# ----------------------------------------------------------------------------- config


def test_default_config_is_verls():
    from hybridengine.rl.roles import policy_loss_config
    cfg = load_config([])
    assert policy_loss_config(cfg.actor_rollout_ref.actor) == PolicyLossConfig()
    assert rc.RolloutCorrectionConfig.from_config(cfg.algorithm.rollout_correction) == rc.RolloutCorrectionConfig()
    assert cfg.actor_rollout_ref.actor.loss_scale_factor is None


RECIPE = ["--config", "configs/gsm8k_qwen2_5_0_5b.yaml"]
A, RC = "actor_rollout_ref.actor.", "algorithm.rollout_correction."


@pytest.mark.parametrize("override, message", [
    (A + "policy_loss.loss_mode=sapo", "policy_loss.loss_mode='sapo': choose one of vanilla, gspo, gpg, clip_cov"),
    (RC + "rollout_is=tokens", "rollout_correction.rollout_is='tokens': choose one of token, sequence or null"),
    (RC + "rollout_is_threshold=0", "rollout_is_threshold=0.0 must be > 0"),
    (A + "loss_scale_factor=-1", "loss_scale_factor=-1.0 must be > 0"),
    (A + "policy_loss.clip_cov_ratio=0", "clip_cov_ratio=0.0 must be > 0"),
    (A + "policy_loss.clip_cov_lb=6", "clip_cov_lb=6.0 must be < clip_cov_ub=5.0"),
    (RC + "rollout_rs=token_k1", "rejection sampling is not supported"),
    (RC + "loss_type=reinforce", "loss_type='reinforce' needs bypass_mode=true"),
])
def test_bad_values_are_one_line(override, message):
    cfg = load_config(RECIPE + [override])
    with pytest.raises(ValueError) as info:
        validate_config(cfg, world_size=1)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_verl_overrides_are_accepted():
    cfg = load_config(RECIPE + [A + "policy_loss.loss_mode=gspo", A + "loss_scale_factor=1024",
                                RC + "rollout_is=token", RC + "rollout_is_threshold=2.5"])
    validate_config(cfg, world_size=1)
    assert cfg.actor_rollout_ref.actor.loss_scale_factor == 1024.0
