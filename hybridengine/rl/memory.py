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
from hybridengine.models.attention import REPEATS_KV_IN_TRAINING
from hybridengine.models.decoder import ModelConfig
from hybridengine.models.lora import resolve_targets
from hybridengine.rl.residency import OFFLOAD_FLAGS, PHASE_USES, offload_parts
from hybridengine.train.memory_advice import fit_error, kv_slots_short
from hybridengine.train.memory_plan import MemoryPlan, RoleSpec, RolloutSpec, plan_memory


# *.megatron.param_dtype and rollout.dtype: param_dtype's names
PARAM_DTYPES = ("bfloat16", "float32")


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
    """A trained role's offloaded parts. optimizer_offload=host_step counts as offloaded; the
    plan holds its optimizer state on the host in every phase (RoleSpec.host_step)."""
    host_step = ("optimizer",) if megatron.optimizer_offload == "host_step" else ()
    return offload_parts(megatron, True) + host_step


def _compiled(role, device: torch.device) -> dict:
    """RoleSpec's fields of what autograd saves in a role's training: its decoder layers
    compiled (use_torch_compile; the engine compiles on CUDA only) and K/V repeated by CUDA's
    attention."""
    cuda = device.type == "cuda"
    return dict(compiled=cuda and bool(role.use_torch_compile),
                repeats_kv=cuda and REPEATS_KV_IN_TRAINING)


def _lora_spec(model) -> dict:
    """RoleSpec's LoRA fields of a role's model section (none without adapters)."""
    if model.lora_rank <= 0:
        return {}
    return dict(lora_rank=model.lora_rank,
                lora_targets=resolve_targets(list(model.target_modules)))


def plan_run_memory(cfg, layout, actor_model: ModelConfig, critic_model: ModelConfig | None,
                    device: torch.device, device_bytes: int | None) -> MemoryPlan:
    """The plan of a loaded config tree or RunConfig (same key paths) on `layout` (RunLayout)."""
    arr, d = cfg.actor_rollout_ref, cfg.data
    seq = d.max_prompt_length + d.max_response_length
    a, r, m = arr.actor, arr.rollout, arr.model
    lora = tuple(_lora_spec(m).values()) or (0, ())
    roles = {"actor": RoleSpec(
        actor_model, layout.actor, param_dtype(a.megatron.param_dtype, device),
        use_distributed_optimizer=a.megatron.use_distributed_optimizer,
        offload=_trained_offload(a.megatron),
        recompute=arr.model.enable_gradient_checkpointing,
        host_step=a.megatron.optimizer_offload == "host_step",
        train_tokens=_tokens(a.use_dynamic_bsz, a.ppo_max_token_len_per_gpu,
                             a.ppo_micro_batch_size_per_gpu, seq),
        forward_tokens=_tokens(r.log_prob_use_dynamic_bsz, r.log_prob_max_token_len_per_gpu,
                               r.log_prob_micro_batch_size_per_gpu, seq),
        lora_rank=lora[0], lora_targets=lora[1], **_compiled(a, device))}
    if uses_reference(cfg) and not lora[0]:     # with LoRA the reference is the actor's base
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
            host_step=c.megatron.optimizer_offload == "host_step",
            train_tokens=_tokens(c.use_dynamic_bsz, c.ppo_max_token_len_per_gpu,
                                 c.ppo_micro_batch_size_per_gpu, seq),
            forward_tokens=_tokens(c.use_dynamic_bsz, c.forward_max_token_len_per_gpu,
                                   c.forward_micro_batch_size_per_gpu, seq),
            **_lora_spec(c.model), **_compiled(c, device))
    rollout = RolloutSpec(seq, layout.rollout.tp, param_dtype(r.dtype, device), r.max_num_seqs,
                          None, r.gpu_memory_utilization, max_prefill_tokens(seq),
                          cfg.trainer.hybrid_engine.reshard_bucket_mb)
    return plan_memory(roles, rollout, PHASE_USES, device_bytes)


# offload=auto's candidates, cheapest first: gradient buckets hold nothing between updates (freed,
# no copy); weights cost one copy each way per step (2 bytes a parameter in bf16), the optimizer
# twelve (fp32 master + Adam moments), host_step moves the Adam update itself to the CPU
_AUTO_ORDER = (("actor", "grad_offload", True), ("critic", "grad_offload", True),
               ("ref", "param_offload", True), ("critic", "param_offload", True),
               ("actor", "param_offload", True), ("actor", "optimizer_offload", True),
               ("critic", "optimizer_offload", True), ("actor", "optimizer_offload", "host_step"),
               ("critic", "optimizer_offload", "host_step"))


def _megatron(cfg, role: str):
    arr = cfg.actor_rollout_ref
    return {"actor": arr.actor, "ref": arr.ref, "critic": cfg.critic}[role].megatron


def _run_roles(cfg) -> tuple[str, ...]:
    """The roles with weights of their own in this run."""
    return ("actor",) + (("ref",) if uses_reference(cfg) else ()) + \
        (("critic",) if uses_critic(cfg) else ())


def replica_sequences(cfg, layout) -> int:
    """Sequences one generation replica gets per step (the batch over the rollout's DP)."""
    return -(-cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n // layout.rollout.dp)


def resolve_auto_offload(cfg, layout, actor_model: ModelConfig, critic_model: ModelConfig | None,
                         device: torch.device) -> list[str]:
    """Replace every `auto` offload flag of the loaded tree `cfg` (in place) with what the memory
    plan needs, and return the flags it set to something other than false ("actor.grad_offload=
    true", ...). Without a device budget (module doc): false. Else, taking the auto flags in
    _AUTO_ORDER, the shortest prefix after which the run fits the budget and the KV cache holds
    a generation replica's whole batch (at most max_num_seqs) at once; when no prefix holds the
    batch, the shortest that fits with the most KV slots; when none fits, all false (preflight
    then reports the plan's error and the settings that would fit)."""
    auto = [(role, flag) for role in ("actor", "ref", "critic") for flag in OFFLOAD_FLAGS.values()
            if getattr(_megatron(cfg, role), flag, None) == "auto"]
    for role, flag in auto:
        setattr(_megatron(cfg, role), flag, False)
    budget = device_budget(cfg, device)
    if budget is None or not auto:
        return []
    steps = [(role, flag, value) for role, flag, value in _AUTO_ORDER
             if (role, flag) in auto and role in _run_roles(cfg)]
    wanted = min(cfg.actor_rollout_ref.rollout.max_num_seqs, replica_sequences(cfg, layout))
    best = None                 # (kv slots, -prefix length) of the best prefix that fits
    for n in range(len(steps) + 1):
        for role, flag, value in steps[:n]:
            setattr(_megatron(cfg, role), flag, value)
        plan = plan_run_memory(cfg, layout, actor_model, critic_model, device, budget)
        if fit_error(plan, budget) is None:
            if plan.kv_slots >= wanted:
                best = (plan.kv_slots, -n)
                break
            best = max(best or (plan.kv_slots, -n), (plan.kv_slots, -n))
        for role, flag, _ in steps[:n]:
            setattr(_megatron(cfg, role), flag, False)
    chosen = steps[:-best[1]] if best else []
    for role, flag, value in chosen:
        setattr(_megatron(cfg, role), flag, value)
    return [f"{role}.{flag}={str(value).lower()}" for role, flag, value in chosen
            if (role, flag, "host_step") not in chosen or value == "host_step"]


def memory_errors(cfg, layout, actor_model, critic_model, device: torch.device) -> list[str]:
    """[] when the run fits its device budget (or has none), else the one line of fit_error."""
    budget = device_budget(cfg, device)
    if budget is None:
        return []
    plan = plan_run_memory(cfg, layout, actor_model, critic_model, device, budget)
    error = fit_error(plan, budget)
    return [error] if error else []


def offload_summary(cfg) -> str:
    """The offload in effect, e.g. "actor grads, optimizer (host_step); ref params", or "none"."""
    parts = []
    for role in _run_roles(cfg):
        m = _megatron(cfg, role)
        on = [part for part, flag in OFFLOAD_FLAGS.items()
              if getattr(m, flag, False) in (True, "host_step")]
        if getattr(m, "optimizer_offload", False) == "host_step":
            on[-1] = "optimizer (host_step)"
        if on:
            parts.append(f"{role} {', '.join(on)}")
    return "; ".join(parts) or "none"


def memory_report(cfg, layout, actor_model, critic_model, device: torch.device) -> list[str]:
    """The lines printed at start: the plan's table, and the KV warning when it applies."""
    budget = device_budget(cfg, device)
    plan = plan_run_memory(cfg, layout, actor_model, critic_model, device, budget)
    where = f", device budget {budget / 2**30:.1f} GiB" if budget else ""
    lines = [f"memory plan (GiB per rank, the heaviest rank of each phase{where}):",
             *plan.table().splitlines(), f"offloaded to the host: {offload_summary(cfg)}"]
    warning = kv_slots_short(plan, replica_sequences(cfg, layout))
    return lines + ([f"warning: {warning}"] if warning else [])
