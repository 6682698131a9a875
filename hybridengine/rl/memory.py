"""The run's memory plan (train.memory_plan) from its config: preflight stops a run that cannot
fit before any weight loads (one line, exit 2: what needs how much, what the device has, which
settings fit), and the trainer prints the plan's table at start with a warning when the KV
cache holds fewer sequences than a generation replica's batch.

The device budget is trainer.device_memory_gb, else the GPU's total memory; on the CPU, without
that key, there is nothing to check against (the table is still printed). What the offload keeps
in host memory (weights, optimizer state, the host step's state) must fit the host too:
trainer.host_memory_gb, else most of the memory the host has available at start (host_budget).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import os

import torch

from hybridengine.config import uses_critic, uses_reference
from hybridengine.hybrid.generator import max_prefill_tokens
from hybridengine.models.decoder import ModelConfig
from hybridengine.models.lora import resolve_targets
from hybridengine.rl.residency import OFFLOAD_FLAGS, PHASE_USES, offload_parts
from hybridengine.rl.rollout_correction import RolloutCorrectionConfig
from hybridengine.rl.training_graphs import graph_requests, graphs_line, graphs_off
from hybridengine.rollout.rollout_config import STATIC_ONLY_BACKENDS
from hybridengine.train.memory_advice import fit_error, fits, gib_text, kv_slots_short
from hybridengine.train.memory_plan import (MemoryPlan, RoleSpec, RolloutSpec, host_memory,
                                            plan_memory)


# *.megatron.param_dtype and rollout.dtype: param_dtype's names
PARAM_DTYPES = ("bfloat16", "float32")
# share of the host's available memory the offloaded state may take without
# trainer.host_memory_gb (the rest: the processes' own heap, loading, the page cache)
HOST_SHARE = 0.85


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
    compiled (use_torch_compile; the engine compiles on CUDA only). CUDA's flash attention
    takes fewer K/V heads as they are (models.attention): nothing repeated is kept."""
    cuda = device.type == "cuda"
    return dict(compiled=cuda and bool(role.use_torch_compile))


def _lora_spec(model) -> dict:
    """RoleSpec's LoRA fields of a role's model section (none without adapters)."""
    if model.lora_rank <= 0:
        return {}
    return dict(lora_rank=model.lora_rank,
                lora_targets=resolve_targets(list(model.target_modules)))


def old_log_prob_runs(cfg) -> bool:
    """Whether any step of the run enters the old-log-prob forward (rl.trainer._score). Not in
    bypass mode (pi_old is pi_rollout), nor where the update's first mini-batch holds the whole
    batch (any number of epochs), nothing reads pi_old before the update (no KL in the reward,
    no rollout importance weights) and the actor updates from step 1 (critic_warmup): that
    mini-batch's own forward then gives every row's pi_old (Trainer._old_logprob_from_update)."""
    corr = RolloutCorrectionConfig.from_config(cfg.algorithm.rollout_correction)
    if corr.bypass_mode:
        return False
    one_mini_batch = cfg.actor_rollout_ref.actor.ppo_mini_batch_size >= cfg.data.train_batch_size
    return corr.reads_pi_old_first(cfg.algorithm.use_kl_in_reward) or \
        cfg.trainer.critic_warmup > 1 or not one_mini_batch


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
    for name, asked in graph_requests(cfg).items():
        if asked and graphs_off(roles[name], device) is None:
            roles[name] = dataclasses.replace(roles[name], graphed=True)
    rollout = RolloutSpec(seq, layout.rollout.tp, param_dtype(r.dtype, device), r.max_num_seqs,
                          None, r.gpu_memory_utilization, max_prefill_tokens(seq),
                          cfg.trainer.hybrid_engine.reshard_bucket_mb)
    skip = () if old_log_prob_runs(cfg) else ("old_log_prob",)
    return plan_memory(roles, rollout, PHASE_USES, device_bytes, skip)


# offload=auto's values per flag, and what each costs a step: gradient buckets hold nothing
# between updates (freed, no copy); weights cross PCIe once each way (their bytes twice), the
# optimizer's fp32 master and moments likewise; host_step moves grads and weights only, but the
# CPU's Adam (~30 bytes of host memory traffic per parameter) is slower than both copies
_AUTO_VALUES = {"grad_offload": (True,), "param_offload": (True,),
                "optimizer_offload": (True, "host_step")}
# (part, value) -> (plan field, bytes moved per byte of that field); grads cost a token byte so
# that, of two equal plans, the one with fewer flags wins
_AUTO_COST = {("grads", True): ("grads", 1e-9), ("params", True): ("weights", 2.0),
              ("optimizer", True): ("state", 2.0), ("optimizer", "host_step"): ("state", 3.0)}
_PART = {flag: part for part, flag in OFFLOAD_FLAGS.items()}


def _megatron(cfg, role: str):
    arr = cfg.actor_rollout_ref
    return {"actor": arr.actor, "ref": arr.ref, "critic": cfg.critic}[role].megatron


def _run_roles(cfg) -> tuple[str, ...]:
    """The roles with weights of their own in this run."""
    return ("actor",) + (("ref",) if uses_reference(cfg) else ()) + \
        (("critic",) if uses_critic(cfg) else ())


def replica_sequences(cfg, layout) -> int:
    """Sequences one generation replica gets per round (data.gen_batch_size prompts x n over the
    rollout's DP)."""
    return -(-cfg.data.gen_batch_size * cfg.actor_rollout_ref.rollout.n // layout.rollout.dp)


def ranks_per_host() -> int:
    """Ranks sharing this host's memory: torchrun's LOCAL_WORLD_SIZE, else SLURM's tasks per
    node (srun; "4(x2)" reads 4), else 1."""
    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        digits = "".join(itertools.takewhile(str.isdigit, os.environ.get(key, "")))
        if digits:
            return max(1, int(digits))
    return 1


def host_budget(cfg, device: torch.device) -> int | None:
    """Host bytes the offloaded state of this host's ranks may take: trainer.host_memory_gb,
    else on CUDA HOST_SHARE of the memory available now (/proc/meminfo MemAvailable: free pages
    and reclaimable cache); None (no check) on the CPU without that key, or where the kernel
    does not say."""
    if cfg.trainer.host_memory_gb is not None:
        return int(cfg.trainer.host_memory_gb * 2**30)
    if device.type != "cuda":
        return None
    available = _host_available_at_start()
    return None if available is None else int(HOST_SHARE * available)


@functools.cache
def _host_available_at_start() -> int | None:
    """MemAvailable in bytes, read once per process: preflight reads it before anything is
    allocated, and the report printed after the offloaded state is pinned must name that budget,
    not what the run itself has left (session 17: 7B's start table said 32.3 GiB allowed beside
    the 85.1 GiB it had pinned)."""
    try:
        with open("/proc/meminfo") as f:
            return 1024 * next(int(ln.split()[1]) for ln in f if ln.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def _host_error(plan, host: int | None) -> str | None:
    """None when the offloaded state of this host's ranks fits `host`; else one line."""
    n = ranks_per_host()
    if host is None or plan.host * n <= host:
        return None
    roles = plan.inputs[0]
    parts = ", ".join(f"{r} {gib_text(host_memory(s, plan.roles[r]))}" for r, s in roles.items()
                      if host_memory(s, plan.roles[r]))
    return (f"memory plan: the offloaded state needs {gib_text(plan.host)} of host memory per rank "
            f"({parts}), {n} rank(s) on this host: {gib_text(plan.host * n)}, but the host has "
            f"{gib_text(host)} (trainer.host_memory_gb, else {HOST_SHARE:.0%} of MemAvailable): "
            f"offload less (host_step keeps 12 bytes per trained parameter), use LoRA "
            f"(actor_rollout_ref.model.lora_rank) or more GPUs")


def _auto_cost(plan, role: str, part: str, value) -> float:
    field, per_byte = _AUTO_COST[part, value]
    mem = plan.roles[role]
    size = mem.master + mem.optimizer if field == "state" else getattr(mem, field)
    return per_byte * size


def resolve_auto_offload(cfg, layout, actor_model: ModelConfig, critic_model: ModelConfig | None,
                         device: torch.device) -> list[str]:
    """Replace every `auto` offload flag of the loaded tree `cfg` (in place) with what the memory
    plan needs, and return the flags it set to something other than false ("actor.grad_offload=
    true", ...). Without a device budget (module doc): false. Else, of every assignment of the
    auto flags (each false or one of _AUTO_VALUES), cheapest first by the bytes a step moves
    (_AUTO_COST, sizes from the plan without offload), the first that fits the device and the
    host (host_budget) and whose KV cache holds a generation replica's whole batch (at most
    max_num_seqs) at once; when none holds the batch, the one that fits with the most KV slots
    (the cheapest of those); when none fits both, the cheapest that fits the device (preflight
    then reports the host's shortfall); when none fits the device, all false (preflight reports
    the plan's error and the settings that would fit)."""
    auto = [(role, flag) for role in ("actor", "ref", "critic") for flag in OFFLOAD_FLAGS.values()
            if getattr(_megatron(cfg, role), flag, None) == "auto"]
    for role, flag in auto:
        setattr(_megatron(cfg, role), flag, False)
    budget = device_budget(cfg, device)
    if budget is None or not auto:
        return []
    host = host_budget(cfg, device)
    base = plan_run_memory(cfg, layout, actor_model, critic_model, device, budget)
    flags = [(role, flag) for role, flag in auto if role in _run_roles(cfg) and (
        role != "ref" or flag == "param_offload")]          # the reference trains nothing
    options = [[(role, flag, v) for v in (False, *_AUTO_VALUES[flag])] for role, flag in flags]
    ranked = sorted(itertools.product(*options), key=lambda combo: (
        sum(_auto_cost(base, r, _PART[f], v) for r, f, v in combo if v is not False),
        sum(v is not False for _, _, v in combo)))
    wanted = min(cfg.actor_rollout_ref.rollout.max_num_seqs, replica_sequences(cfg, layout))
    best = device_only = None   # (kv slots, -rank) of the best assignment that fits; the
    for i, combo in enumerate(ranked):      # cheapest that fits the device but not the host
        for role, flag, value in combo:
            setattr(_megatron(cfg, role), flag, value)
        plan = plan_run_memory(cfg, layout, actor_model, critic_model, device, budget)
        if not fits(plan, budget):
            continue
        if _host_error(plan, host) is not None:
            device_only = i if device_only is None else device_only
            continue
        if plan.kv_slots >= wanted:
            best = (plan.kv_slots, -i)
            break
        best = max(best or (plan.kv_slots, -i), (plan.kv_slots, -i))
    # none fits both: the device-fitting one, so that preflight names the host as the limit
    chosen = ranked[-best[1]] if best else ranked[device_only] if device_only is not None \
        else [(r, f, False) for r, f in flags]
    for role, flag, value in chosen:
        setattr(_megatron(cfg, role), flag, value)
    return [f"{role}.{flag}={str(value).lower()}" for role, flag, value in chosen
            if value is not False]


def memory_errors(cfg, layout, actor_model, critic_model, device: torch.device) -> list[str]:
    """[] when the run fits its device budget (or has none), else the one line of fit_error."""
    budget = device_budget(cfg, device)
    if budget is None:
        return []
    plan = plan_run_memory(cfg, layout, actor_model, critic_model, device, budget)
    host = host_budget(cfg, device)
    error = fit_error(plan, budget, lambda p: _host_error(p, host) is None) or \
        _host_error(plan, host)
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


def paged_unsupported(cfg, actor_model: ModelConfig) -> str | None:
    """Why this run's rollout cannot take kv_layout=paged, or None."""
    r = cfg.actor_rollout_ref.rollout
    if r.name != "builtin":
        return f"rollout.name={r.name} manages its own cache"
    if r.attn_backend in STATIC_ONLY_BACKENDS:
        return f"rollout.attn_backend={r.attn_backend} reads static rows"
    if any(actor_model.attention_spec(i) for i in range(actor_model.num_layers)):
        return "the model has sliding-window or soft-capped attention"
    return None


def resolve_kv_layout(cfg, layout, actor_model: ModelConfig, critic_model: ModelConfig | None,
                      device: torch.device) -> None:
    """rollout.kv_layout=auto of the loaded tree `cfg`, in place (after the offload flags):
    static, a row of max_model_len tokens per sequence, while a generation replica's batch has
    a row each (bench/RESULTS.md: paged makes 0.97x static's tok/s on 256 x (512 + 256),
    session 22, and equals it in a GRPO step, session 21); paged where the device budget holds
    fewer rows than that batch and the paged layout can run (paged_unsupported): static would
    hold the rest back until rows free, where paged's blocks follow the tokens actually held
    (1.01-1.05x) and admit the whole batch, preempting the youngest if they run out (long
    responses, 0.5B, half the rows: paged 1.23x static, session 30). Without a device budget
    (the CPU without trainer.device_memory_gb) or with the rows capped by max_num_seqs (paged
    is capped the same): static."""
    r = cfg.actor_rollout_ref.rollout
    if r.kv_layout != "auto":
        return
    r.kv_layout = "static"
    budget = device_budget(cfg, device)
    if budget is None or paged_unsupported(cfg, actor_model) is not None:
        return
    plan = plan_run_memory(cfg, layout, actor_model, critic_model, device, budget)
    if plan.kv_limit == "memory" and 1 <= plan.kv_slots < replica_sequences(cfg, layout):
        r.kv_layout = "paged"


def resolve_and_check(cfg, layout, actor_model: ModelConfig, critic_model: ModelConfig | None,
                      device: torch.device) -> tuple[list[str], list[str]]:
    """The memory plan's part of preflight on the loaded tree `cfg`: the `auto` offload flags,
    then rollout.kv_layout=auto, resolved in place; returns (the offload flags set, as
    resolve_auto_offload's; memory_errors' lines)."""
    chosen = resolve_auto_offload(cfg, layout, actor_model, critic_model, device)
    resolve_kv_layout(cfg, layout, actor_model, critic_model, device)
    return chosen, memory_errors(cfg, layout, actor_model, critic_model, device)


def _kv_line(cfg, plan: MemoryPlan, layout, actor_model: ModelConfig) -> str | None:
    """The KV cache's line of the start report: the warning when static rows run the batch in
    waves (kv_slots_short; with kv_layout=static set where paged would take the whole batch, it
    says so), the paged layout's size in tokens."""
    r = cfg.actor_rollout_ref.rollout
    if r.name != "builtin" or plan.inputs[1] is None:
        return None
    if r.kv_layout != "paged":
        warning = kv_slots_short(plan, replica_sequences(cfg, layout))
        if warning and plan.kv_limit == "memory" and paged_unsupported(cfg, actor_model) is None:
            warning += "; actor_rollout_ref.rollout.kv_layout=paged (or auto) admits the whole " \
                "batch in blocks"
        return f"warning: {warning}" if warning else None
    L = plan.inputs[1].max_model_len
    rows = f"{plan.kv_slots} rows" if plan.kv_limit == "memory" else \
        f"at least {plan.kv_slots} rows"
    return (f"KV cache: paged, blocks of {r.block_size} tokens in {gib_text(plan.kv_cache)} or "
            f"more ({rows} of max_model_len={L}); a generation replica's "
            f"{replica_sequences(cfg, layout)} sequences are admitted as their blocks fit")


def memory_report(cfg, layout, actor_model, critic_model, device: torch.device) -> list[str]:
    """The lines printed at start: the plan's table, the KV cache's line and the training CUDA
    graphs' line when they apply."""
    budget = device_budget(cfg, device)
    plan = plan_run_memory(cfg, layout, actor_model, critic_model, device, budget)
    where = f", device budget {budget / 2**30:.1f} GiB" if budget else ""
    host = host_budget(cfg, device)
    lines = [f"memory plan (GiB per rank, the heaviest rank of each phase{where}):",
             *plan.table().splitlines(), f"offloaded to the host: {offload_summary(cfg)}"
             + (f" ({gib_text(plan.host)} per rank, {ranks_per_host()} rank(s) on this host"
                + (f" of {gib_text(host)} allowed)" if host is not None else ")")
                if plan.host else "")]
    extra = (_kv_line(cfg, plan, layout, actor_model), graphs_line(cfg, plan, device))
    return lines + [line for line in extra if line]
