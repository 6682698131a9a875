"""Batch statistics with verl's metric names, and the model FLOPs of one RL step."""
from __future__ import annotations

import torch

from hybridengine.rl.advantages import masked_mean
from hybridengine.rl.batch import Batch
from hybridengine.rl.flops import decoder_flops


def _stats(prefix: str, x: torch.Tensor) -> dict[str, float]:
    if x.numel() == 0:          # e.g. advantages of a batch whose responses are all empty
        return {f"{prefix}/mean": 0.0, f"{prefix}/max": 0.0, f"{prefix}/min": 0.0}
    return {f"{prefix}/mean": x.mean().item(), f"{prefix}/max": x.max().item(),
            f"{prefix}/min": x.min().item()}


def batch_metrics(batch: Batch, has_critic: bool) -> dict[str, float]:
    t, mask = batch.tensors, batch.response_mask
    valid = mask.bool()
    resp_len = mask.sum(-1)
    prompt_len = torch.tensor([len(p) for p in batch.prompt_ids], dtype=torch.float32)
    out = {}
    out.update(_stats("critic/score", t["token_level_scores"].sum(-1)))
    out.update(_stats("critic/rewards", t["token_level_rewards"].sum(-1)))
    out.update(_stats("critic/advantages", t["advantages"][valid]))
    out.update(_stats("critic/returns", t["returns"][valid]))
    out.update(_stats("response_length", resp_len))
    out["response_length/clip_ratio"] = (resp_len >= batch.max_response_length).float().mean().item()
    out.update(_stats("prompt_length", prompt_len))
    if has_critic:
        values, returns = t["values"], t["returns"]
        out.update(_stats("critic/values", values[valid]))
        var_ret = torch.var(returns[valid])
        out["critic/vf_explained_var"] = (1.0 - torch.var(returns[valid] - values[valid])
                                          / (var_ret + 1e-5)).item()
    # NaN: the backend does not report the sampling distribution's log-probs (vLLM at T != 1)
    if "rollout_logprob" in t and "old_logprob" in t and \
            not t["rollout_logprob"][valid].isnan().any():
        # How far the rollout engine's log-probs are from the trainer's (numerics, bf16 drift).
        diff = (t["rollout_logprob"] - t["old_logprob"]).abs()
        out["training/rollout_probs_diff_max"] = diff[valid].max().item() if valid.any() else 0.0
        out["training/rollout_probs_diff_mean"] = masked_mean(diff, mask).item()
    return out


def step_flops(model_cfg, seqlens: list[int], cfg, has_ref: bool,
               has_critic: bool) -> dict[str, float]:
    """Model FLOPs of the step's training-engine phases, keyed by their timing_s/ names:
    old/ref log-prob and value forwards, actor/critic updates (fwd+bwd per epoch). Generation is
    not counted (perf/gen_tokens_per_s measures it), so perf/mfu is the training phases'
    utilisation over the whole step time."""
    c = model_cfg
    args = (c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads,
            c.head_dim)
    lm_fwd = float(decoder_flops(*args, c.vocab_size, seqlens))
    out = {"old_log_prob": lm_fwd,
           "update_actor": 3 * lm_fwd * cfg.actor_rollout_ref.actor.ppo_epochs}
    if has_ref:
        out["ref"] = lm_fwd
    if has_critic:
        value_fwd = float(decoder_flops(*args, 1, seqlens))
        out["values"] = value_fwd
        out["update_critic"] = 3 * value_fwd * cfg.critic.ppo_epochs
    return out
