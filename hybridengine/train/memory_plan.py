"""Device bytes per rank of a whole run, planned from shapes before any weight loads (issue #23).

    plan = plan_memory({"actor": RoleSpec(cfg, Layout(4, 1, 2)), ...}, RolloutSpec(4096),
                       PHASE_USES, device_bytes)
    print(plan.table())                    # GiB per role part (rows) and phase (columns)
    fit_error(plan, device_bytes)          # train.memory_advice: None, or one line: what needs
    kv_slots_short(plan, batch_sequences)  # how much, what fits; None, or: it runs in waves

Pure arithmetic, so a run that cannot fit says so before it loads a byte. Exact (tested against
the engines' allocations): weights (stage_params x param dtype); grads (the optimizer's fp32
buckets by its arithmetic: reverse order, 64-element starts, bucket_mb splits, padded to dp·64,
whole on every DP rank); master (fp32, this rank's 1/dp of each bucket under ZeRO-1); optimizer
(Adam's two moments, the master's size each); kv_cache ((slots + 1)·max_model_len·layers·2·
(kv_heads/t_g)·head_dim·dtype bytes, +1 the scratch row, slots by the runner's plan_num_slots);
the reshard arena (each generation weight that is not this rank's training parameter of the
same name, shape and dtype, 16-byte aligned; its gather buffers are an upper bound).
Estimates (T tokens of a micro-batch, b param bytes, t = tp, s = t with sequence parallelism
else 1, q / kv / I: query / key-value / intermediate width per TP rank, d: head_dim):
  a elements saved per layer and token (train.activation_memory): the eager formula, or the
      compiled one where the role's training compiles its decoder layers (RoleSpec.compiled)
  training activations, stage r of p: (p - r) micro-batches in flight (1F1B) x layers·T·a·b
      (+ a soft-capped layer's group of scores in the backward, capped_group_bytes);
      with recomputation layers·T·(H/s)·b (layer inputs) + one rebuilt layer T·a·b
  forward-only activations: one layer's working set T·(a + 2H/s)·b (+ a soft-capped layer's
      group of scores, capped_group_bytes)
  logits (last stage, LM head): a vocabulary chunk of kernels/logprob.py (T x cols <= 2^28) and
      the gathered [T, H] hidden; training adds fp32 grad_x [T, H] and the head's [V/t, H] grad
      (and, with a final soft-cap, the chunk's tanh)
  rollout: prefill T·max(2H + 4I, 2H + 2(q + 2kv) + q)·b at t_g (T = max_prefill_tokens; +
      a soft-capped layer's group of scores), sampling max_num_seqs x V logits (b + 3 fp32
      copies), the slot state
  context parallelism (c = cp): a rank runs T/c of a micro-batch's tokens (the padding of each
      sequence to a multiple of 2c not counted); all-gather attention also keeps every rank's
      K/V, 2·kv·(T − T/c) more per layer; ZeRO-1 shards over the dp·c replicas
  CUDA graphs of training micro-batches (RoleSpec.graphed, train.cuda_graphs): the graphed
      roles' largest training activations (+ the bucket's pad, < 1/16) in one pool held in
      every phase ("graphs.pool"), in place of the update's own activations
Not counted: per-parameter grads (one at a time), CUDA context, NCCL, fragmentation.

Residency: a part (params, grads, optimizer = master + Adam) a role offloads is on the device
only in the phases that use it (rl/residency.py PHASE_USES, passed in: rl/ is above train/);
with the host step no master or moment is on the device, the update's new weight shards
instead. "reshard" is the gather (training weights + arena), "rollout" the generation (offloaded actor
weights parked but those the generation model shares). Every rank's pipeline stages are
planned; a phase shows its heaviest rank, `peak` the heaviest of all.
MemoryPlan.host: what the offload keeps in host memory on the heaviest rank (host_memory: copies
of offloaded weights and optimizer state, the host step's master and moments; rl.memory checks
it against the host). The KV cache's budget is the runner's: gpu_memory_utilization less
rollout.kv_cache.DEVICE_RESERVE of the device, less the rollout phase's bytes.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from hybridengine.kernels.logprob import _chunks
from hybridengine.models.decoder import ModelConfig, stage_layers
from hybridengine.models.lora import FUSED_LAYER
from hybridengine.models.moe import is_expert_param
from hybridengine.parallel.layout import Layout
from hybridengine.parallel.tensor import padded_vocab_size
from hybridengine.rollout.kv_cache import DEVICE_RESERVE, plan_num_slots
from hybridengine.train.activation_memory import capped_group_bytes, \
    layer_activation_elements
from hybridengine.train.engine import PARTS
from hybridengine.train.stage_shapes import grad_buckets, lora_numels, stage_params

GiB, ARENA_ALIGN_BYTES = 2 ** 30, 16    # hybrid/program.py ALIGN_BYTES (hybrid/ is above train/)
PHASES = ("reshard", "rollout", "old_log_prob", "ref", "values", "update_critic", "update_actor")
# a graphed micro-batch's tokens padded up to its bucket (train.cuda_graphs.bucket_for: < 1/16)
GRAPH_PAD = 1 / 16
# phase -> (the role computing in it, training or forward-only)
COMPUTE = {"old_log_prob": ("actor", False), "ref": ("ref", False), "values": ("critic", False),
           "update_critic": ("critic", True), "update_actor": ("actor", True)}
FIELDS = {"params": ("weights",), "grads": ("grads",), "optimizer": ("master", "optimizer")}


@dataclass(frozen=True)
class RoleSpec:
    """One role. train_tokens: a training micro-batch (ppo_max_token_len_per_gpu with dynamic
    bsz, else micro-batch size x sequence length); forward_tokens: a forward-only one
    (log_prob / forward_max_token_len_per_gpu; None: train_tokens)."""

    cfg: ModelConfig
    layout: Layout
    dtype: torch.dtype = torch.bfloat16
    trained: bool = True                    # has an optimizer (actor, critic; not ref)
    value_head: bool = False                # critic
    use_distributed_optimizer: bool = True
    bucket_mb: float = 40.0
    offload: tuple[str, ...] = ()           # of PARTS
    recompute: bool = False
    host_step: bool = False                 # optimizer_offload=host_step (train/host_step.py)
    compiled: bool = False                  # training runs compiled decoder layers (CUDA)
    graphed: bool = False                   # its training micro-batches in CUDA graphs
    train_tokens: int = 16384
    forward_tokens: int | None = None
    lora_rank: int = 0                      # > 0: the optimizer holds these adapters only
    lora_targets: tuple[str, ...] = ()      # HF module names (models.lora.resolve_targets)


@dataclass(frozen=True)
class RolloutSpec:
    """The actor's generation side: RolloutConfig's budget and the HybridEngine's settings."""

    max_model_len: int
    gen_tp: int = 1
    dtype: torch.dtype = torch.bfloat16
    max_num_seqs: int = 256
    kv_cache_tokens: int | None = None
    gpu_memory_utilization: float = 0.9
    max_prefill_tokens: int = 16384
    reshard_bucket_mb: float = 256.0


@dataclass(frozen=True)
class RoleMemory:
    """One role on one rank, bytes; activations / logits: a training micro-batch, fwd_*: a
    forward-only one."""

    weights: int
    grads: int = 0
    master: int = 0
    optimizer: int = 0
    activations: int = 0
    logits: int = 0
    fwd_activations: int = 0
    fwd_logits: int = 0
    host_state: int = 0             # host_step: fp32 master and moments in host memory


@dataclass(frozen=True)
class MemoryPlan:
    """phases: phase -> {"role.part": bytes} of the phase's heaviest rank; roles: RoleMemory on
    the peak's rank; kv_slots: cache rows for sequences (0: none fits), kv_limit: what capped
    them (max_num_seqs | kv_cache_tokens | memory); reshard: arena + buffers (+ a LoRA base
    kept between switches), heaviest rank."""

    phases: dict[str, dict[str, int]]
    roles: dict[str, RoleMemory]
    kv_cache: int
    kv_slots: int
    kv_limit: str
    reshard: int
    inputs: tuple = field(repr=False, default=())   # plan_memory's arguments, to re-plan
    host: int = 0               # host memory of the offloaded parts, heaviest rank (host_memory)

    def total(self, phase: str) -> int:
        return sum(self.phases[phase].values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.total)

    @property
    def peak(self) -> int:
        return self.total(self.peak_phase) if self.phases else 0

    def table(self) -> str:
        """Fixed width: a row per role part, a column per phase (GiB), a total row."""
        ph = self.phases
        keys = {k for p in ph.values() for k in p}
        rows = [k for k in (f"{r}.{f}" for r in (*self.roles, "rollout") for f in (
            *RoleMemory.__dataclass_fields__, "kv_cache", "reshard", "lora_base")) if k in keys]
        width, cols = max(map(len, rows + ["total"])), [max(len(p), 7) for p in ph]

        def line(name, cells):
            return " ".join([name.ljust(width)] + [c.rjust(w) for c, w in zip(cells, cols)])
        cells = [[f"{ph[p][r] / GiB:.2f}" if r in ph[p] else "-" for p in ph] for r in rows]
        return "\n".join([line("GiB", list(ph))] + [line(r, c) for r, c in zip(rows, cells)]
                         + [line("total", [f"{self.total(p) / GiB:.2f}" for p in ph])])


# --- one rank --------------------------------------------------------------------------------

def role_memory(spec: RoleSpec, pp_rank: int) -> RoleMemory:
    """Bytes of one role on a rank of pipeline stage `pp_rank`."""
    cfg, lay, b, h = spec.cfg, spec.layout, spec.dtype.itemsize, spec.cfg.hidden_size
    params = stage_params(cfg, lay.tp, lay.pp, pp_rank, spec.value_head, ep=lay.ep)
    numels = [math.prod(s) for _, s in params]
    trained = numels
    # EP: E/ep experts, in buckets ZeRO-sharded over expert-DP (train.optimizer; no LoRA)
    ep = lay.ep > 1 and not spec.lora_rank
    experts = [math.prod(s) for n, s in params if is_expert_param(n)] if ep else []
    if spec.lora_rank:          # the base frozen: the optimizer's state is the adapters'
        trained = lora_numels(cfg, lay.tp, lay.pp, pp_rank, spec.lora_rank, spec.lora_targets)
        numels = numels + trained
        if spec.value_head and pp_rank == lay.pp - 1:
            trained = trained + [cfg.hidden_size]        # the value head trains beside them
    grads = master = step_shards = host_state = 0
    if spec.trained:
        g = torch.promote_types(spec.dtype, torch.float32).itemsize
        dense = [math.prod(s) for n, s in params if not is_expert_param(n)] if ep else trained
        for part, replicas in ((dense, lay.num_replicas), (experts, lay.edp)):
            shards = replicas if spec.use_distributed_optimizer else 1
            buckets = grad_buckets(part, spec.bucket_mb, shards) if part else []
            grads, master = grads + sum(buckets) * g, master + sum(buckets) // shards * g
        if spec.host_step:
            # master weights and moments live in host memory; the step writes this rank's new
            # weights into fresh device shards (parameter dtype) once the backward has freed
            # the activations, whose place they take below
            step_shards, host_state, master = master // g * b, 3 * master, 0
    s = lay.tp if lay.sequence_parallel else 1
    a = layer_activation_elements(cfg, lay.tp, lay.sequence_parallel, spec.compiled)
    # a forward-only layer's working set: bounded by the eager count
    a_fwd = layer_activation_elements(cfg, lay.tp, lay.sequence_parallel)
    layers = len(range(*stage_layers(cfg.num_layers, lay.pp, pp_rank)))
    T, Tf = (-(-t // lay.cp) for t in (spec.train_tokens, spec.forward_tokens or
                                        spec.train_tokens))
    if lay.cp > 1 and lay.cp_attention == "allgather":
        gathered = 2 * cfg.num_kv_heads // lay.tp * cfg.head_dim * (lay.cp - 1)
        a, a_fwd = a + gathered, a_fwd + gathered
    act = (lay.pp - pp_rank) * layers * T * (h / s if spec.recompute else a) * b \
        + (T * a * b if spec.recompute else 0)
    act = max(act + capped_group_bytes(cfg, b, backward=True), step_shards)
    logits = fwd_logits = 0
    if pp_rank == lay.pp - 1 and not spec.value_head:
        v = padded_vocab_size(cfg.vocab_size, lay.tp) // lay.tp

        def cols(t):            # the kernel's own column chunks
            return max(e - a for a, e, _ in _chunks(v, 0, v, t, None))

        def chunk(t):           # a chunk of logits and the gathered hidden
            return t * cols(t) * b + t * h * b
        # a final soft-cap's backward keeps the chunk's tanh beside it
        capped = T * cols(T) * b if cfg.final_softcap is not None else 0
        logits, fwd_logits = chunk(T) + T * h * 4 + v * h * b + capped, chunk(Tf)
    return RoleMemory(sum(numels) * b, grads, master, 2 * master, int(act), logits,
                      int(Tf * (a_fwd + 2 * h / s) * b + capped_group_bytes(cfg, b)), fwd_logits,
                      host_state)


def reshard_memory(actor: RoleSpec, g: RolloutSpec,
                   pp_rank: int) -> tuple[int, int, int, int]:
    """(arena, gather buffers, training weights the generation model shares, generation weights
    kept between switches) in bytes on a rank of actor stage `pp_rank` (hybrid/plan.py,
    program.py; zero_redundancy mode: the naive baseline also holds the full model). A LoRA
    actor with t_g < t and p = 1 keeps its base's generation shard (hybrid.lora_switch): that
    is the kept part, and the arena of a switch is then the merged adapted weights."""
    cfg, lay, e = actor.cfg, actor.layout, g.dtype.itemsize
    gen = stage_params(cfg, g.gen_tp,
                       vocab_rows=padded_vocab_size(cfg.vocab_size, lay.tp) // g.gen_tp)
    # LoRA: the generation weights are merged copies (W + s·B·A), never the training tensors,
    # unless only adapters move (then the base's generation shard is built as without LoRA)
    adapter_switches = bool(actor.lora_rank) and lay.pp == 1 and g.gen_tp < lay.tp
    mine = dict(stage_params(cfg, lay.tp, lay.pp, pp_rank)) \
        if actor.dtype == g.dtype and (not actor.lora_rank or adapter_switches) else {}
    if lay.pp > 1 and cfg.tie_word_embeddings:
        mine.pop("lm_head.weight", None)     # the last stage's copy is never read
    align = max(1, ARENA_ALIGN_BYTES // e)
    padded = lambda shape: -(-math.prod(shape) // align) * align     # noqa: E731
    arena = sum(padded(s) for n, s in gen if mine.get(n) != s)
    # EP (hybrid.experts): every expert gathered at training TP first, into a buffer (the
    # stacked parameters are the gather's input: no packed copy)
    gathered = sum(math.prod(s) for n, s in stage_params(cfg, lay.tp, lay.pp, pp_rank)
                   if is_expert_param(n)) if lay.ep > 1 else 0
    shared = sum(math.prod(s) for n, s in gen if mine.get(n) == s
                 and not (gathered and is_expert_param(n)))
    members, buffers = lay.tp // g.gen_tp * lay.pp, 0
    if members > 1 and arena:               # two rotating buffers of one bucket at most
        cap = max(1, int(g.reshard_bucket_mb * 2**20) // e // members)
        per_member = -(-arena // members)
        buffers = (1 if per_member <= cap else 2) * members * min(cap, per_member)
    kept = 0
    if adapter_switches:
        layers = {FUSED_LAYER[t] for t in actor.lora_targets}
        adapted = {n for n, _ in gen if n.endswith(".weight") and n.split(".")[-2] in layers}
        kept, arena = arena, sum(padded(s) for n, s in gen if n in adapted)
    return arena * e, buffers * e + gathered * actor.dtype.itemsize, \
        shared * actor.dtype.itemsize, kept * e



def rollout_fixed(actor: RoleSpec, g: RolloutSpec) -> tuple[int, int]:
    """(KV bytes per token at t_g, the prefill + sampling working set)."""
    cfg, b, t = actor.cfg, g.dtype.itemsize, g.gen_tp
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size / t
    q, kv = cfg.num_heads * d / t, cfg.num_kv_heads * d / t
    prefill = g.max_prefill_tokens * max(2 * h + 4 * i, 2 * h + 2 * (q + 2 * kv) + q) * b + \
        capped_group_bytes(cfg, b)
    sampling = g.max_num_seqs * padded_vocab_size(cfg.vocab_size, actor.layout.tp) * (b + 12)
    return int(2 * cfg.num_layers * kv * b), int(prefill + sampling)


def host_memory(spec: RoleSpec, mem: RoleMemory) -> int:
    """Host bytes a role keeps on one rank: the copies of its offloaded weights and optimizer
    state (master + moments), the host step's state; offloaded gradients are freed, not kept."""
    out = mem.host_state
    for part in spec.offload:
        out += {"params": mem.weights, "optimizer": mem.master + mem.optimizer}.get(part, 0)
    return out


# --- the plan --------------------------------------------------------------------------------

def _phase(phase, roles, mems, stages, uses, gen, rs) -> dict[str, int]:
    """{"role.part": bytes} resident on one rank (its stage per role) in `phase`."""
    out, compute = {}, COMPUTE.get(phase)
    # graphed roles' training activations live in one CUDA graph pool, held in every phase
    pool = max((mems[r, stages[r]].activations for r, s in roles.items() if s.graphed),
               default=0)
    if pool:
        out["graphs.pool"] = int(pool * (1 + GRAPH_PAD))
    for r, spec in roles.items():
        mem = mems[r, stages[r]]
        for part in (PARTS if spec.trained else PARTS[:1]):
            if part not in spec.offload or part in uses.get(r, ()):
                out.update({f"{r}.{f}": getattr(mem, f) for f in FIELDS[part]})
        if compute and compute[0] == r:
            fwd = "" if compute[1] else "fwd_"
            graphed = compute[1] and spec.graphed       # its activations: the pool's
            out.update({f"{r}.{f}": getattr(mem, fwd + f) for f in ("activations", "logits")
                        if not (graphed and f == "activations")})
    if gen is not None and phase == "rollout" and "params" in roles["actor"].offload:
        out["actor.weights"] = rs[2]        # parked, except what the generation model uses
    if gen is not None and phase in ("reshard", "rollout"):
        out["rollout.reshard"] = rs[0] + rs[1]
    if gen is not None and rs[3]:
        out["rollout.lora_base"] = rs[3]     # the base's generation shard, moved once
    return out


def plan_memory(roles: Mapping[str, RoleSpec], rollout: RolloutSpec | None,
                phase_uses: Mapping[str, Mapping[str, tuple[str, ...]]],
                device_bytes: int | None = None, skip: tuple[str, ...] = ()) -> MemoryPlan:
    """The plan of a run (module docstring). roles: "actor" / "ref" / "critic" -> RoleSpec, on
    one world; rollout: None without generation (else needs an actor); phase_uses:
    rl.residency.PHASE_USES; device_bytes: sizes the KV cache by gpu_memory_utilization when
    kv_cache_tokens is None (None: max_num_seqs rows, as on the CPU); skip: phases the run never
    enters (old_log_prob where the update's own forward gives pi_old: rl.memory)."""
    roles, world = dict(roles), next(iter(roles.values())).layout.world_size
    mems = {(r, st): role_memory(s, st) for r, s in roles.items() for st in range(s.layout.pp)}
    combos = sorted({tuple(s.layout.coords(rank)[0] for s in roles.values())
                     for rank in range(world)})
    phases = [p for p in PHASES if COMPUTE.get(p, ("actor",))[0] in roles
              and (p in COMPUTE or rollout is not None) and p not in skip]
    per_rank, resh = [], {}
    for combo in combos:
        stages = dict(zip(roles, combo))
        rs = None if rollout is None else resh.setdefault(
            stages["actor"], reshard_memory(roles["actor"], rollout, stages["actor"]))
        per_rank.append((combo, {p: _phase(p, roles, mems, stages, phase_uses.get(
            "rollout" if p == "reshard" else p, {}), rollout, rs) for p in phases}))
    kv_cache, slots, limit, g = 0, 0, "max_num_seqs", rollout
    if g is not None:
        (bpt, work), L, budget = rollout_fixed(roles["actor"], g), g.max_model_len, None
        if g.kv_cache_tokens is None and device_bytes is not None:
            used = max(sum(out["rollout"].values()) for _, out in per_rank)
            # the runner's own budget (rollout.model_runner): the same reserve off the device
            budget = int((g.gpu_memory_utilization - DEVICE_RESERVE) * device_bytes - used - work)
        try:
            slots = plan_num_slots(g.max_num_seqs, L, bpt, g.kv_cache_tokens, budget)
        except ValueError:                  # the runner refuses: no sequence fits
            slots = 0
        limit = "max_num_seqs" if slots == g.max_num_seqs else \
            "kv_cache_tokens" if g.kv_cache_tokens else "memory"
        kv_cache, state = (slots + 1) * L * bpt if slots else 0, (slots + 1) * ((L + 1) * 16 + 41)
        for _, out in per_rank:             # state: rollout/slot_state.py's per-slot tensors
            out["rollout"].update({"rollout.kv_cache": kv_cache,
                                   "rollout.activations": work + state})
    heaviest = {p: max(per_rank, key=lambda co: sum(co[1][p].values())) for p in phases}
    plan_phases = {p: {k: v for k, v in heaviest[p][1][p].items() if v} for p in phases}
    peak = max(phases, key=lambda p: sum(plan_phases[p].values())) if phases else None
    combo = heaviest[peak][0] if peak else combos[0]
    host = max(sum(host_memory(s, mems[r, st]) for (r, s), st in zip(roles.items(), co))
               for co in combos)
    return MemoryPlan(plan_phases, {r: mems[r, st] for r, st in zip(roles, combo)}, kv_cache,
                      slots, limit, max((a + b + k for a, b, _, k in resh.values()), default=0),
                      (roles, rollout, dict(phase_uses), device_bytes), host)
