"""training/rollout_probs_diff_* and training/rollout_actor_probs_pearson_corr against a
transcription of verl's calculate_debug_metrics (verl/utils/debug/metrics.py at volcengine/verl
b178a3c): the difference of the rollout's and the trainer's token probabilities, in probability
space, over the response mask (a ragged batch with an empty row)."""
import pytest
import torch

from hybridengine.rl.batch import Batch
from hybridengine.rl.metrics import batch_metrics


def _verl_debug_metrics(rollout_log_probs, old_log_probs, response_mask):
    actor_probs, rollout_probs = torch.exp(old_log_probs), torch.exp(rollout_log_probs)
    mask = response_mask.bool()
    diff = torch.masked_select(torch.abs(actor_probs - rollout_probs), mask)
    corr = torch.corrcoef(torch.stack([torch.masked_select(actor_probs, mask),
                                       torch.masked_select(rollout_probs, mask)]))[0][1]
    return {"training/rollout_probs_diff_max": torch.max(diff).item(),
            "training/rollout_probs_diff_mean": torch.mean(diff).item(),
            "training/rollout_probs_diff_std": torch.std(diff).item(),
            "training/rollout_actor_probs_pearson_corr": corr.item()}


def test_rollout_probs_diff_is_verls():
    g = torch.Generator().manual_seed(0)
    lens, max_resp = [5, 0, 3, 8], 8
    batch = Batch([[1, 2]] * 4, [list(range(3, 3 + n)) for n in lens], [0, 0, 1, 1],
                  ["d"] * 4, ["1"] * 4, [{}] * 4, max_resp)
    old = -torch.rand(4, max_resp, generator=g, dtype=torch.float64) * 4
    rollout = old + 0.3 * torch.randn(4, max_resp, generator=g, dtype=torch.float64)
    t = batch.tensors
    for key in ("token_level_scores", "token_level_rewards", "advantages", "returns"):
        t[key] = torch.zeros(4, max_resp)
    t["old_logprob"], t["rollout_logprob"] = old, rollout
    ours = batch_metrics(batch, has_critic=False)
    want = _verl_debug_metrics(rollout, old, batch.response_mask)
    for key, value in want.items():
        assert ours[key] == pytest.approx(value, rel=1e-9), key
    # log-space differences of 0.3 nats, probabilities of up to 1: the metric is not |Δ log p|
    assert ours["training/rollout_probs_diff_max"] < 1.0
