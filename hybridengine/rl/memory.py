"""The run's memory plan (train.memory_plan) from its config: preflight stops a run that cannot
fit before any weight loads (one line, exit 2: what needs how much, what the device has, which
settings fit), and the trainer prints the plan's table at start with a warning when the KV
cache holds fewer sequences than a generation replica's batch.

The device budget is trainer.device_memory_gb, else the GPU's total memory; on the CPU, without
that key, there is nothing to check against (the table is still printed).
"""
from __future__ import annotations

import torch

from hybridengine.config import uses_critic, uses_reference
from hybridengine.hybrid.generator import max_prefill_tokens
from hybridengine.models.decoder import ModelConfig
from hybridengine.rl.residency import PHASE_USES, offload_parts
from hybridengine.train.memory_advice import fit_error, kv_slots_short
from hybridengine.train.memory_plan import MemoryPlan, RoleSpec, RolloutSpec, plan_memory


def param_dtype(name: str, device: torch.device) -> torch.dtype:
    """A role's weight dtype: bf16 only where it is fast and intended; CPU runs (tests, the
    default job) stay fp32."""
    return torch.float32 if device.type == "cpu" or name == "float32" else torch.bfloat16


def device_budget(cfg, device: torch.device) -> int | None:
    """Bytes per rank the plan must fit in (module doc); None: no check."""
    if cfg.trainer.device_memory_gb is not None:
        return int(cfg.trainer.device_memory_gb * 2**30)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return None


def _tokens(dynamic: bool, max_tokens: int, micro: int | None, seq_len: int) -> int:
    return max_tokens if dynamic or micro is None else micro * seq_len


def _trained_offload(megatron) -> tuple[str, ...]:
    """A trained role's offloaded parts. optimizer_offload=host_step counts as offloaded (on the
    device in no phase but the update's, where only its staging buffers are: an over-estimate
    there)."""
    host_step = ("optimizer",) if megatron.optimizer_offload == "host_step" else ()
    return offload_parts(megatron, True) + host_step


def plan_run_memory(cfg, layout, actor_model: ModelConfig, critic_model: ModelConfig | None,
                    device: torch.device, device_bytes: int | None) -> MemoryPlan:
    """The plan of a loaded config tree or RunConfig (same key paths) on `layout` (RunLayout)."""
    arr, d = cfg.actor_rollout_ref, cfg.data
    seq = d.max_prompt_length + d.max_response_length
    a, r = arr.actor, arr.rollout
    roles = {"actor": RoleSpec(
        actor_model, layout.actor, param_dtype(a.megatron.param_dtype, device),
        use_distributed_optimizer=a.megatron.use_distributed_optimizer,
        offload=_trained_offload(a.megatron),
        recompute=arr.model.enable_gradient_checkpointing,
        train_tokens=_tokens(a.use_dynamic_bsz, a.ppo_max_token_len_per_gpu,
                             a.ppo_micro_batch_size_per_gpu, seq),
        forward_tokens=_tokens(r.log_prob_use_dynamic_bsz, r.log_prob_max_token_len_per_gpu,
                               r.log_prob_micro_batch_size_per_gpu, seq))}
    if uses_reference(cfg):
        f = arr.ref
        roles["ref"] = RoleSpec(
            actor_model, layout.ref, param_dtype(f.megatron.param_dtype, device), trained=False,
            offload=offload_parts(f.megatron, False),
            train_tokens=_tokens(f.log_prob_use_dynamic_bsz, f.log_prob_max_token_len_per_gpu,
                                 f.log_prob_micro_batch_size_per_gpu, seq))
    if uses_critic(cfg):
        c = cfg.critic
        roles["critic"] = RoleSpec(
            critic_model or actor_model, layout.critic, param_dtype(c.megatron.param_dtype, device),
            value_head=True, use_distributed_optimizer=c.megatron.use_distributed_optimizer,
            offload=_trained_offload(c.megatron),
            recompute=c.model.enable_gradient_checkpointing,
            train_tokens=_tokens(c.use_dynamic_bsz, c.ppo_max_token_len_per_gpu,
                                 c.ppo_micro_batch_size_per_gpu, seq),
            forward_tokens=_tokens(c.use_dynamic_bsz, c.forward_max_token_len_per_gpu,
                                   c.forward_micro_batch_size_per_gpu, seq))
    rollout = RolloutSpec(seq, layout.rollout.tp, param_dtype(r.dtype, device), r.max_num_seqs,
                          None, r.gpu_memory_utilization, max_prefill_tokens(seq),
                          cfg.trainer.hybrid_engine.reshard_bucket_mb)
    return plan_memory(roles, rollout, PHASE_USES, device_bytes)


def memory_errors(cfg, layout, actor_model, critic_model, device: torch.device) -> list[str]:
    """[] when the run fits its device budget (or has none), else the one line of fit_error."""
    budget = device_budget(cfg, device)
    if budget is None:
        return []
    plan = plan_run_memory(cfg, layout, actor_model, critic_model, device, budget)
    error = fit_error(plan, budget)
    return [error] if error else []


def memory_report(cfg, layout, actor_model, critic_model, device: torch.device) -> list[str]:
    """The lines printed at start: the plan's table, and the KV warning when it applies."""
    budget = device_budget(cfg, device)
    plan = plan_run_memory(cfg, layout, actor_model, critic_model, device, budget)
    where = f", device budget {budget / 2**30:.1f} GiB" if budget else ""
    lines = [f"memory plan (GiB per rank, the heaviest rank of each phase{where}):",
             *plan.table().splitlines()]
    per_replica = -(-cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n
                    // layout.rollout.dp)
    warning = kv_slots_short(plan, per_replica)
    return lines + ([f"warning: {warning}"] if warning else [])
