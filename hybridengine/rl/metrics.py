"""Batch statistics with verl's metric names, and the model FLOPs of one RL step."""
from __future__ import annotations

import time

import torch

from hybridengine.device_memory import max_allocated, max_reserved
from hybridengine.rl.batch import Batch
from hybridengine.rl.flops import decoder_flops
from hybridengine.rl.rollout_correction import rollout_logprobs_known


def _stats(prefix: str, x: torch.Tensor) -> dict[str, float]:
    if x.numel() == 0:          # e.g. advantages of a batch whose responses are all empty
        return {f"{prefix}/mean": 0.0, f"{prefix}/max": 0.0, f"{prefix}/min": 0.0}
    return {f"{prefix}/mean": x.mean().item(), f"{prefix}/max": x.max().item(),
            f"{prefix}/min": x.min().item()}


def rollout_probs_diff(rollout_logprob: torch.Tensor, old_logprob: torch.Tensor,
                       valid: torch.Tensor) -> dict[str, float]:
    """How far the rollout engine's token probabilities are from the trainer's (numerics, bf16
    drift), as verl's calculate_debug_metrics defines them: |p_rollout - p_train| over the
    response tokens, in probability space (verl's FAQ: a mean below 0.005 is normal, above 0.01
    a precision problem of the inference engine), and the two probabilities' Pearson
    correlation."""
    if not valid.any():
        return {}
    p_rollout, p_train = rollout_logprob[valid].double().exp(), old_logprob[valid].double().exp()
    diff = (p_rollout - p_train).abs()
    out = {"training/rollout_probs_diff_max": diff.max().item(),
           "training/rollout_probs_diff_mean": diff.mean().item(),
           "training/rollout_probs_diff_std": diff.std().item() if diff.numel() > 1 else 0.0}
    if diff.numel() > 1 and p_train.std() > 0 and p_rollout.std() > 0:   # else undefined (NaN)
        out["training/rollout_actor_probs_pearson_corr"] = \
            torch.corrcoef(torch.stack([p_train, p_rollout]))[0, 1].item()
    return out


def batch_metrics(batch: Batch, has_critic: bool, probs_diff: bool = True) -> dict[str, float]:
    """verl's data metrics of the step; probs_diff: the rollout's probabilities against the
    trainer's pi_old (off in bypass mode, where pi_old is the rollout's own, as verl)."""
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
    if probs_diff and "old_logprob" in t and rollout_logprobs_known(batch):
        out.update(rollout_probs_diff(t["rollout_logprob"], t["old_logprob"], valid))
    return out


def step_flops(model_cfg, seqlens: list[int], cfg, has_ref: bool,
               has_critic: bool, head_tokens: int | None = None) -> dict[str, float]:
    """Model FLOPs of the step's training-engine phases, keyed by their timing_s/ names:
    old/ref log-prob and value forwards, actor/critic updates (fwd+bwd per epoch; LoRA: no
    weight gradients of the base). Generation is
    not counted (perf/gen_tokens_per_s measures it), so perf/mfu is the training phases'
    utilisation over the whole step time."""
    c = model_cfg
    # MoE: a token runs top_k experts (the router's [H, E] product is a rounding error beside
    # them); the dense layers a sparse model keeps are counted as sparse ones
    width = c.num_experts_per_tok * c.moe_intermediate_size if c.num_experts else \
        c.intermediate_size
    args = (c.num_layers, c.hidden_size, width, c.num_heads, c.num_kv_heads, c.head_dim)
    # the LM head runs on head_tokens positions (the responses': rl.batch.build_microbatch),
    # None: on every token
    skipped = 0 if head_tokens is None else sum(seqlens) - head_tokens
    lm_fwd = float(decoder_flops(*args, c.vocab_size, seqlens)) - \
        2.0 * c.hidden_size * c.vocab_size * skipped
    # a LoRA actor's backward computes no gradient of the frozen weights: fwd + input grads
    # (the adapters' own products are a rounding error beside the base's)
    passes = 2 if cfg.actor_rollout_ref.model.lora_rank > 0 else 3
    out = {"old_log_prob": lm_fwd,
           "update_actor": passes * lm_fwd * cfg.actor_rollout_ref.actor.ppo_epochs}
    if has_ref:
        out["ref"] = lm_fwd
    if has_critic:
        value_fwd = float(decoder_flops(*args, 1, seqlens))
        out["values"] = value_fwd
        out["update_critic"] = 3 * value_fwd * cfg.critic.ppo_epochs
    return out


def perf_metrics(batch: Batch, timings: dict[str, float], flops: dict[str, float], world: int,
                 peak: float | None, device: torch.device) -> dict[str, float]:
    """verl's perf/ keys of a step: tokens, step time, throughput per rank and MFU, over the
    whole step and per phase (each over its own time). `flops`: step_flops's; `peak`: a rank's
    peak FLOP/s (None off-GPU: the measured rate of _cpu_peak)."""
    tokens = sum(batch.seqlens)
    step_s = timings["step"]
    out = {"perf/total_num_tokens": tokens, "perf/time_per_step": step_s,
           "perf/throughput": tokens / step_s / world}
    rates = {"perf/mfu": sum(flops.values()) / step_s / world}
    rates.update({f"perf/mfu/{phase}": f / timings[phase] / world
                  for phase, f in flops.items() if timings.get(phase)})
    peak = peak or _cpu_peak(max(rates.values()))
    out.update({key: rate / peak for key, rate in rates.items()})
    if device.type == "cuda":
        out["perf/max_memory_allocated_gb"] = max_allocated() / 2**30
        out["perf/max_memory_reserved_gb"] = max_reserved() / 2**30
    return out


_CPU_PEAK: list[float] = []


def _cpu_peak(achieved: float = 0.0) -> float:
    """The MFU denominator off-GPU, per rank: the best fp32 rate of 1024^2 matmuls this process
    measured (best of 5, once), raised to any rate a step `achieved`. A measured rate, not a
    datasheet peak: a busy machine can measure low, and a step never shows mfu > 1."""
    if not _CPU_PEAK:
        a = torch.randn(1024, 1024)
        a @ a
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            a @ a
            best = min(best, time.perf_counter() - t0)
        _CPU_PEAK.append(2 * 1024**3 / best)
    _CPU_PEAK[0] = max(_CPU_PEAK[0], achieved)
    return _CPU_PEAK[0]
