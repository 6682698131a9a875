"""Every registered advantage estimator against a transcription of verl's formula (core_algos at
volcengine/verl b178a3c), written here as verl writes it (per-sample loops over uid groups), in
float64: ragged masks with an empty row and an interior hole, groups of one and of n, groups whose
scores are all equal, negative scores, string uids. Compared on the response tokens (rel 1e-6); we
also zero every position outside the mask, where verl leaves values. Then ReMax's greedy baselines
through the RolloutCollector with a fake generator, and the config's estimator tables."""

from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hybridengine.config import load_config, validate_config
from hybridengine.config.checks import GROUP_ESTIMATORS
from hybridengine.config.loading import CHOICES
from hybridengine.rl import advantages as adv

D = torch.float64
ROOT = Path(__file__).resolve().parent.parent
N = 4  # responses per prompt in the grouped batches


# ----------------------------------------------------------------------------- verl, transcribed


def _verl_masked_mean(x, mask):
    return (torch.where(mask.bool(), x, 0.0) * mask).sum() / (mask.sum() + 1e-8)


def _verl_masked_whiten(x, mask):
    mean = _verl_masked_mean(x, mask)
    count = mask.sum()
    var = _verl_masked_mean((x - mean) ** 2, mask) * (count / (count - 1))
    return (x - mean) * torch.rsqrt(var + 1e-8)


def _by_uid(scores, uids):
    members = defaultdict(list)
    for i, uid in enumerate(uids):
        members[uid].append(scores[i])
    return members


def verl_gae(rewards, values, mask, gamma, lam):
    next_value, last_gae, reversed_adv = 0.0, 0.0, []
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        gae = delta + gamma * lam * last_gae
        next_value = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_value
        last_gae = gae * mask[:, t] + (1 - mask[:, t]) * last_gae
        reversed_adv.append(last_gae)
    advantages = torch.stack(reversed_adv[::-1], dim=1)
    return _verl_masked_whiten(advantages, mask), advantages + values


def verl_grpo(rewards, mask, uids, epsilon=1e-6, norm_adv_by_std_in_grpo=True):
    scores = rewards.sum(-1)
    members = _by_uid(scores, uids)
    mean = {u: torch.tensor(0.0) if len(s) == 1 else torch.stack(s).mean() for u, s in members.items()}
    std = {u: torch.tensor(1.0) if len(s) == 1 else torch.stack(s).std() for u, s in members.items()}
    out = scores.clone()
    for i, u in enumerate(uids):
        out[i] = (scores[i] - mean[u]) / (std[u] + epsilon) if norm_adv_by_std_in_grpo else scores[i] - mean[u]
    out = out.unsqueeze(-1) * mask
    return out, out


def verl_rloo(rewards, mask, uids):
    scores = rewards.sum(-1)
    members = _by_uid(scores, uids)
    out = scores.clone()
    for i, u in enumerate(uids):
        n = len(members[u])
        if n > 1:
            mean = torch.stack(members[u]).mean()
            out[i] = scores[i] * n / (n - 1) - mean * n / (n - 1)
    out = out.unsqueeze(-1) * mask
    return out, out


def verl_reinforce_plus_plus(rewards, mask, gamma):
    returns, running = torch.zeros_like(rewards), 0.0
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    return _verl_masked_whiten(returns, mask) * mask, returns


def verl_reinforce_plus_plus_baseline(rewards, mask, uids):
    scores = rewards.sum(-1)
    members = _by_uid(scores, uids)
    out = scores.clone()
    for i, u in enumerate(uids):
        out[i] = scores[i] - (0.0 if len(members[u]) == 1 else torch.stack(members[u]).mean())
    out = out.unsqueeze(-1).tile([1, rewards.shape[1]]) * mask
    out = _verl_masked_whiten(out, mask) * mask
    return out, out


def verl_remax(rewards, reward_baselines, mask):
    returns = (rewards * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    return returns - reward_baselines.unsqueeze(-1) * mask, returns


def verl_opo(rewards, mask, uids):
    scores, lengths = rewards.sum(-1), mask.sum(-1)
    members, member_lengths = _by_uid(scores, uids), _by_uid(lengths, uids)
    baseline = {}
    for u, s in members.items():
        if len(s) == 1:
            baseline[u] = torch.tensor(0.0)
        else:
            lens = torch.stack(member_lengths[u])
            baseline[u] = (lens * torch.stack(s)).sum() / lens.sum()
    out = scores.clone()
    for i, u in enumerate(uids):
        out[i] = scores[i] - baseline[u]
    out = out.unsqueeze(-1) * mask
    return out, out


def verl_grpo_passk(rewards, mask, uids, epsilon=1e-6, norm_adv_by_std_in_grpo=True):
    scores = rewards.sum(-1)
    out = torch.zeros_like(scores)
    members, rows = _by_uid(scores, uids), _by_uid(list(range(len(uids))), uids)
    for u, s in members.items():
        group = torch.stack(s)
        if group.numel() < 2:
            raise ValueError(f"pass@k needs 2 samples per group, group {u} has {group.numel()}")
        top, top_idx = torch.topk(group, 2)
        advantage = top[0] - top[1]
        if norm_adv_by_std_in_grpo:
            advantage = advantage / (group.std() + epsilon)
        out[rows[u][top_idx[0].item()]] = advantage
    out = out.unsqueeze(-1) * mask
    return out, out


def verl_gpg(rewards, mask, uids):
    scores = rewards.sum(-1)
    alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1)
    members = _by_uid(scores, uids)
    out = scores.clone()
    for i, u in enumerate(uids):
        mean = torch.tensor(0.0) if len(members[u]) == 1 else torch.stack(members[u]).mean()
        out[i] = alpha * (scores[i] - mean) / 1.0
    out = out.unsqueeze(-1) * mask
    return out, out


# ----------------------------------------------------------------------------- inputs


def _case(seed: int, singletons: bool = True, dense: bool = False):
    """Groups p0..p4 of N responses (p0 all scored 1, p1 all 0: zero variance) and, when
    `singletons`, two lone responses; rows shuffled. Ragged mask: one empty row, one full row,
    an interior hole. Outcome rewards sit on the last response token (position 0 for an empty
    row, as the collector puts them); `dense` adds noise on every position, masked or not."""
    g = torch.Generator().manual_seed(seed)
    uids = [f"p{k}" for k in range(5) for _ in range(N)] + (["solo-a", "solo-b"] if singletons else [])
    uids = [uids[i] for i in torch.randperm(len(uids), generator=g).tolist()]
    batch_size, width = len(uids), 9
    lengths = torch.randint(1, width + 1, (batch_size,), generator=g)
    lengths[0], lengths[1] = 0, width
    mask = (torch.arange(width)[None] < lengths[:, None]).to(D)
    mask[1, 3:5] = 0  # observation tokens inside a multi-turn response
    choices = torch.tensor([-1.0, 0.0, 0.5, 1.0, -0.25], dtype=D)
    scores = choices[torch.randint(0, len(choices), (batch_size,), generator=g)]
    scores = torch.where(torch.tensor([u == "p0" for u in uids]), 1.0, scores)
    scores = torch.where(torch.tensor([u == "p1" for u in uids]), 0.0, scores)
    rewards = torch.zeros(batch_size, width, dtype=D)
    rewards[torch.arange(batch_size), (lengths - 1).clamp(min=0)] = scores
    if dense:
        rewards = rewards + 0.3 * torch.randn(batch_size, width, generator=g, dtype=D)
    values = torch.randn(batch_size, width, generator=g, dtype=D)
    baselines = {u: torch.randn((), generator=g, dtype=D) for u in sorted(set(uids))}
    reward_baselines = torch.stack([baselines[u] for u in uids])
    return SimpleNamespace(rewards=rewards, values=values, mask=mask, uids=uids, reward_baselines=reward_baselines)


def _assert_matches(ours, ref, mask, name):
    valid = mask.bool()
    assert torch.equal(ours[~valid], torch.zeros_like(ours[~valid])), f"{name}: nonzero outside the mask"
    a, b = ours[valid], ref[valid]
    assert torch.isfinite(a).all(), name
    err = ((a - b).abs() / (b.abs() + 1e-3)).max().item() if a.numel() else 0.0
    assert err <= 1e-6, f"{name}: max relative error {err:.3g}"


def _ours(name, case, **options):
    inputs = dict(values=case.values, group_index=case.uids, gamma=1.0, lam=1.0, epsilon=1e-6,
                  norm_adv_by_std_in_grpo=True, reward_baselines=case.reward_baselines)
    inputs.update(options)
    return adv.get_adv_estimator(name)(case.rewards, case.mask, **inputs)


CASES = [(seed, dense) for seed in range(4) for dense in (False, True)]


@pytest.mark.parametrize("seed, dense", CASES)
def test_group_estimators_match_verl(seed, dense):
    case = _case(seed, dense=dense)
    r, m, u = case.rewards, case.mask, case.uids
    table = {
        "grpo": verl_grpo(r, m, u),
        "rloo": verl_rloo(r, m, u),
        "reinforce_plus_plus_baseline": verl_reinforce_plus_plus_baseline(r, m, u),
        "opo": verl_opo(r, m, u),
        "gpg": verl_gpg(r, m, u),
    }
    for name, (ref_adv, ref_ret) in table.items():
        ours_adv, ours_ret = _ours(name, case)
        _assert_matches(ours_adv, ref_adv, m, name)
        _assert_matches(ours_ret, ref_ret, m, f"{name} returns")
    ours, _ = _ours("grpo", case, norm_adv_by_std_in_grpo=False)
    _assert_matches(ours, verl_grpo(r, m, u, norm_adv_by_std_in_grpo=False)[0], m, "grpo (Dr. GRPO)")


@pytest.mark.parametrize("seed, dense", CASES)
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_passk_matches_verl(seed, dense, norm_by_std):
    case = _case(seed, singletons=False, dense=dense)
    ref_adv, _ = verl_grpo_passk(case.rewards, case.mask, case.uids, norm_adv_by_std_in_grpo=norm_by_std)
    ours_adv, ours_ret = _ours("grpo_passk", case, norm_adv_by_std_in_grpo=norm_by_std)
    _assert_matches(ours_adv, ref_adv, case.mask, "grpo_passk")
    assert torch.equal(ours_adv, ours_ret)
    with pytest.raises(ValueError, match="rollout.n >= 2"):
        _ours("grpo_passk", _case(seed, singletons=True, dense=dense))


@pytest.mark.parametrize("seed, dense", CASES)
def test_token_level_estimators_match_verl(seed, dense):
    case = _case(seed, dense=dense)
    r, m = case.rewards, case.mask
    for gamma, lam in [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0)]:
        ours = _ours("gae", case, gamma=gamma, lam=lam)
        for got, ref, what in zip(ours, verl_gae(r, case.values, m, gamma, lam), ("adv", "returns")):
            _assert_matches(got, ref, m, f"gae {what} gamma={gamma} lam={lam}")
        ours = _ours("reinforce_plus_plus", case, gamma=gamma)
        for got, ref, what in zip(ours, verl_reinforce_plus_plus(r, m, gamma), ("adv", "returns")):
            _assert_matches(got, ref, m, f"reinforce_plus_plus {what} gamma={gamma}")
    ours = _ours("remax", case)
    for got, ref, what in zip(ours, verl_remax(r, case.reward_baselines, m), ("adv", "returns")):
        _assert_matches(got, ref, m, f"remax {what}")


def test_degenerate_groups_stay_finite_and_zero_off_the_mask():
    rewards = torch.tensor([[1.0, 0.0], [2.0, 0.0], [0.5, 0.0], [-0.5, 0.0]], dtype=D)
    mask = torch.tensor([[0, 0], [0, 0], [1, 1], [1, 0]], dtype=D)
    uids = ["empty", "empty", "x", "x"]  # a group of empty responses: verl's OPO divides 0 by 0
    for name in ("opo", "gpg", "rloo", "grpo", "reinforce_plus_plus_baseline", "grpo_passk"):
        got, _ = adv.get_adv_estimator(name)(rewards, mask, group_index=uids)
        assert torch.isfinite(got).all() and not got[:2].any(), name
    # pass@k: a tied best gives 0 to every member, whichever is picked as "the best"
    got, _ = adv.get_adv_estimator("grpo_passk")(rewards[2:], torch.ones_like(mask[2:]), group_index=[7, 7])
    assert got[0].tolist() == pytest.approx([1.0 / (0.5 ** 0.5 + 1e-6)] * 2) and not got[1].any()  # std 1/sqrt(2)
    tied = torch.tensor([[1.0], [1.0], [0.0]], dtype=D)
    got, _ = adv.get_adv_estimator("grpo_passk")(tied, torch.ones_like(tied), group_index=[0, 0, 0])
    assert not got.any()


def test_estimators_need_their_inputs():
    case = _case(0)
    with pytest.raises(ValueError, match="reward_baselines"):
        adv.get_adv_estimator("remax")(case.rewards, case.mask, group_index=case.uids)
    with pytest.raises(ValueError, match=r"reward_baselines has shape \(3,\)"):
        adv.get_adv_estimator("remax")(case.rewards, case.mask, reward_baselines=torch.zeros(3, dtype=D))
    for name in CHOICES["algorithm.adv_estimator"]:
        inputs = dict(values=case.values, reward_baselines=case.reward_baselines)
        if name in GROUP_ESTIMATORS:
            with pytest.raises(ValueError, match="group_index"):
                adv.get_adv_estimator(name)(case.rewards, case.mask, **inputs)
        else:  # group ids are not needed, so they are not asked for
            adv.get_adv_estimator(name)(case.rewards, case.mask, **inputs)


def test_config_tables_agree_with_the_registry():
    names = set(CHOICES["algorithm.adv_estimator"])
    assert names == set(adv._ADV_ESTIMATORS)
    assert set(GROUP_ESTIMATORS) <= names
    assert {n for n in names if adv.adv_estimator_uses_critic(n)} == {"gae"}  # checks.uses_critic
    for name in GROUP_ESTIMATORS:
        cfg = load_config(["--config", str(ROOT / "configs" / "gsm8k_qwen2_5_0_5b.yaml"),
                           f"algorithm.adv_estimator={name}", "actor_rollout_ref.rollout.n=1"])
        with pytest.raises(ValueError, match=f"adv_estimator={name} compares the responses"):
            validate_config(cfg, 1)
    cfg = load_config(["--config", str(ROOT / "configs" / "gsm8k_qwen2_5_0_5b.yaml"),
                       "algorithm.adv_estimator=remax", "actor_rollout_ref.rollout.n=1"])
    assert validate_config(cfg, 1).critic is None


# ----------------------------------------------------------------------------- ReMax collector


class _Tokenizer:
    eos_token_id = 0

    def batch_decode(self, ids, skip_special_tokens=True):
        return [" ".join(str(t) for t in seq) for seq in ids]


class _Generator:
    """Sampled: prompt p's sample j is [p0, j+1] (all [p0, 1] when p0 is even: a uniform group);
    greedy: p0 % 3 + 1 copies of p0. Records every call's SamplingParams."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, params):
        self.calls.append(params)
        if params.greedy:
            out = [[p[0]] * (p[0] % 3 + 1) for p in prompts]
        else:
            out = [[p[0], 1 if p[0] % 2 == 0 else j + 1] for p in prompts for j in range(params.n)]
        return SimpleNamespace(response_ids=out, logprobs=[[-0.5] * len(r) for r in out], seconds=1.0,
                               num_generated_tokens=sum(len(r) for r in out), slots=None)


def _reward(data_source, solution_str, ground_truth, extra_info):
    tokens = [int(t) for t in solution_str.split()]
    return float(len(tokens) * 10 + sum(tokens[1:]) - ground_truth)


def _greedy_score(prompt):
    return _reward(None, " ".join([str(prompt[0])] * (prompt[0] % 3 + 1)), prompt[0] % 5, None)


def _collector(tmp_path, *overrides):
    from hybridengine.rl.rollout import RolloutCollector
    cfg = load_config([f"actor_rollout_ref.model.path={tmp_path}", "actor_rollout_ref.rollout.n=3",
                       "data.max_response_length=8", "algorithm.adv_estimator=remax", *overrides])
    dataset = [{"prompt_ids": [p, 9, 9], "data_source": "fake", "ground_truth": p % 5, "extra_info": {}}
               for p in (4, 7, 10, 13, 2, 5)]
    return RolloutCollector(cfg, _Tokenizer(), _Generator(), reward_fn=_reward), dataset


def test_remax_collects_greedy_baselines(tmp_path):
    from hybridengine.rl.trainer import Trainer
    collector, dataset = _collector(tmp_path, "data.train_batch_size=3")
    batch, metrics = collector.collect([0, 1, 2], lambda: None, step=1, dataset=dataset)
    sampled, greedy = collector.generator.calls
    assert sampled.n == 3 and greedy.n == 1 and greedy.greedy and (greedy.top_p, greedy.top_k) == (1.0, -1)
    assert greedy.max_tokens == sampled.max_tokens and greedy.stop_token_ids == sampled.stop_token_ids
    expected = torch.tensor([_greedy_score(p) for p in batch.prompt_ids])
    assert torch.equal(batch.tensors["reward_baselines"], expected) and len(batch) == 9
    assert metrics["timing_s/gen_max"] > 0
    # the trainer hands them to the estimator
    batch.tensors["token_level_scores"] = batch.tensors["token_level_scores"].double()
    fake_trainer = SimpleNamespace(cfg=collector.cfg, kl_ctrl=None)
    Trainer._advantages(fake_trainer, batch)
    ref, _ = verl_remax(batch.tensors["token_level_scores"], expected.double(), batch.response_mask.double())
    _assert_matches(batch.tensors["advantages"], ref, batch.response_mask, "remax via the trainer")


def test_remax_baselines_follow_dynamic_sampling(tmp_path):
    collector, dataset = _collector(tmp_path, "data.train_batch_size=2", "data.gen_batch_size=2",
                                    "algorithm.filter_groups.enable=true",
                                    "algorithm.filter_groups.metric=seq_reward")
    rounds = iter([[2, 3]])
    batch, _ = collector.collect([0, 1], lambda: next(rounds, None), step=1, dataset=dataset)
    # even prompts sample a uniform group: round 1 keeps 7 (drops 4), round 2 keeps 13 (drops 10)
    assert sorted({p[0] for p in batch.prompt_ids}) == [7, 13]
    expected = torch.tensor([_greedy_score(p) for p in batch.prompt_ids])
    assert torch.equal(batch.tensors["reward_baselines"], expected)
    assert len(collector.generator.calls) == 4  # two rounds, each sampled + greedy


def test_dynamic_sampling_short_of_groups_says_so(tmp_path, capsys):
    """max_num_gen_batches rounds without train_batch_size informative groups: verl's DAPO
    trainer raises; here the step trains on the groups kept, with one warning line."""
    collector, dataset = _collector(tmp_path, "data.train_batch_size=2", "data.gen_batch_size=2",
                                    "algorithm.adv_estimator=grpo",
                                    "algorithm.filter_groups.enable=true",
                                    "algorithm.filter_groups.metric=seq_reward",
                                    "algorithm.filter_groups.max_num_gen_batches=1")
    batch, metrics = collector.collect([0, 1], lambda: [2, 3], step=5, dataset=dataset)
    assert sorted({p[0] for p in batch.prompt_ids}) == [7] and metrics["train/num_gen_batches"] == 1
    assert capsys.readouterr().out.strip() == (
        "warning: step 5: dynamic sampling kept 1 of data.train_batch_size=2 groups in "
        "max_num_gen_batches=1 rounds; the step trains on those (verl stops with an error: raise "
        "algorithm.filter_groups.max_num_gen_batches, 0 for no limit)")
    collector, dataset = _collector(tmp_path, "data.train_batch_size=2", "data.gen_batch_size=2",
                                    "algorithm.adv_estimator=grpo",
                                    "algorithm.filter_groups.enable=true",
                                    "algorithm.filter_groups.metric=seq_reward")
    collector.collect([0, 1], lambda: None, step=6, dataset=dataset)
    assert "groups before the data ran out;" in capsys.readouterr().out
    collector.collect([1, 3], lambda: None, step=7, dataset=dataset)      # 7 and 13: both kept
    assert capsys.readouterr().out == ""


def test_other_estimators_skip_the_greedy_rollout(tmp_path):
    collector, dataset = _collector(tmp_path, "data.train_batch_size=2", "algorithm.adv_estimator=grpo")
    batch, metrics = collector.collect([0, 1], lambda: None, step=1, dataset=dataset)
    assert len(collector.generator.calls) == 1 and "reward_baselines" not in batch.tensors
    assert "timing_s/gen_max" not in metrics


def test_validation_groups_by_the_data_source_column_not_the_reward_key(tmp_path):
    """val/test_score/<name>: the rows' data_source column names the groups (verl's _validate),
    whichever column (data.reward_fn_key) chose the rewards; val/reward/mean over all rows."""
    collector, dataset = _collector(tmp_path, "data.train_batch_size=2",
                                    "algorithm.adv_estimator=grpo")
    for i, item in enumerate(dataset):
        item["metrics_source"] = "even" if i % 2 == 0 else "odd"     # the data_source column
    out = collector.validate(dataset)
    scores = {i: _greedy_score(item["prompt_ids"]) for i, item in enumerate(dataset)}
    assert set(out) >= {"val/test_score/even", "val/test_score/odd", "val/reward/mean"}
    assert "val/test_score/fake" not in out
    assert out["val/test_score/even"] == pytest.approx(sum(scores[i] for i in (0, 2, 4)) / 3)
    assert out["val/test_score/odd"] == pytest.approx(sum(scores[i] for i in (1, 3, 5)) / 3)
    assert out["val/reward/mean"] == pytest.approx(sum(scores.values()) / 6)
