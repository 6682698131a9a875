"""What to tell the user about a memory plan (train.memory_plan): the one line that says why a
run cannot fit and which settings would make it fit (each suggestion re-planned, so only settings
that do fit are named), and the warning when the rollout's KV cache holds fewer sequences than
the batch needs at once.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from hybridengine.parallel.layout import Layout
from hybridengine.rollout.kv_cache import DEVICE_RESERVE
from hybridengine.train.engine import PARTS
from hybridengine.train.memory_plan import (GiB, MemoryPlan, RoleSpec, RolloutSpec, plan_memory,
                                            rollout_fixed)

# the config keys a suggestion names
_FLAGS, _R = {"params": "param_offload", "grads": "grad_offload",
              "optimizer": "optimizer_offload"}, "actor_rollout_ref"
_KEYS = {"actor": (f"{_R}.actor.megatron", f"{_R}.model.enable_gradient_checkpointing",
                   f"{_R}.actor.ppo_max_token_len_per_gpu"), "ref": (f"{_R}.ref.megatron",),
         "critic": ("critic.megatron", "critic.model.enable_gradient_checkpointing",
                    "critic.ppo_max_token_len_per_gpu")}   # megatron, recompute, tokens keys

# --- what to tell the user -------------------------------------------------------------------

def gib_text(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def _excess(plan: MemoryPlan, device: int) -> float:
    """Bytes over `device` summed over the phases (a change helping any of them counts), plus the
    rollout's shortfall of room for one KV slot (two rows with the scratch one). 0: it fits."""
    roles, g = plan.inputs[:2]
    miss = sum(max(0, plan.total(p) - device) for p in plan.phases)
    if g is None or plan.kv_slots >= 1:
        return miss
    bpt, L = rollout_fixed(roles["actor"], g)[0], g.max_model_len
    room = (g.gpu_memory_utilization - DEVICE_RESERVE) * device
    short = (2 * L - g.kv_cache_tokens) * bpt if g.kv_cache_tokens is not None else \
        plan.total("rollout") + 2 * L * bpt - room
    return miss + max(short, 1)


def fits(plan: MemoryPlan, device_bytes: int) -> bool:
    """Whether the plan fits `device_bytes` per rank with room for a KV slot (fit_error's test,
    without its search for settings)."""
    if plan.inputs[3] != device_bytes:
        plan = plan_memory(*plan.inputs[:3], device_bytes)
    return _excess(plan, device_bytes) <= 0


def _candidates(roles: dict[str, RoleSpec], g: RolloutSpec | None):
    """(setting, roles or None, rollout) of each single change that may lower the peak. A change
    of the actor's layout or recomputation also applies to each role holding the actor's value
    (the default config interpolates theirs from the actor's)."""
    def change(name, fn, follow=None):
        out = {r: fn(s, r == name) if r == name or (follow and name == "actor" and getattr(
            s, follow) == getattr(roles[name], follow)) else s for r, s in roles.items()}
        return None if None in out.values() else out

    def relayout(spec, tp, pp, gen_tp):
        c, world = spec.cfg, spec.layout.world_size
        if world % (tp * pp) or c.num_layers < pp or tp % gen_tp or any(
                n % tp for n in (c.num_heads, c.num_kv_heads, c.intermediate_size)):
            return None
        sp = spec.layout.sequence_parallel or spec.layout.tp == 1   # config default: true
        return replace(spec, layout=Layout.of_world(tp, pp, world, sp))
    for name, s in roles.items():
        meg, ckpt, tok = (*_KEYS.get(name, (f"{name}.megatron",)), None, None)[:3]
        for part in [p for p in (PARTS if s.trained else PARTS[:1]) if p not in s.offload]:
            yield f"{meg}.{_FLAGS[part]}=true", change(name, lambda x, _, p=part: replace(
                x, offload=x.offload + (p,))), g
        if s.trained and not s.host_step:       # the optimizer's step on the host
            yield f"{meg}.optimizer_offload=host_step", change(name, lambda x, _: replace(
                x, offload=tuple(dict.fromkeys(x.offload + ("optimizer",))), host_step=True)), g
        if s.trained and ckpt and not s.recompute:
            yield f"{ckpt}=true", change(name, lambda x, _: replace(x, recompute=True),
                                         "recompute"), g
        lay, gtp = s.layout, g.gen_tp if g is not None and name == "actor" else 1
        for key, tp, pp in (("tensor", 2 * lay.tp, lay.pp), ("pipeline", lay.tp, 2 * lay.pp)):
            yield f"{meg}.{key}_model_parallel_size={tp if key == 'tensor' else pp}", change(
                name, lambda x, own, t=tp, p=pp: relayout(x, t, p, gtp if own else 1), "layout"), g
        if s.trained and tok and s.train_tokens >= 2 * (g.max_model_len if g else 1):
            yield f"{tok}={s.train_tokens // 2}", change(name, lambda x, _: replace(
                x, train_tokens=x.train_tokens // 2)), g
    if g is None:
        return
    if roles["actor"].layout.tp % (2 * g.gen_tp) == 0:
        yield f"{_R}.rollout.tensor_model_parallel_size={2 * g.gen_tp}", roles, replace(
            g, gen_tp=2 * g.gen_tp)
    for u in [u for u in (0.7, 0.8, 0.9, 0.95) if u > g.gpu_memory_utilization
              and g.kv_cache_tokens is None]:
        yield f"{_R}.rollout.gpu_memory_utilization={u}", roles, replace(
            g, gpu_memory_utilization=u)


def fit_error(plan: MemoryPlan, device_bytes: int,
              host_fits: Callable[[MemoryPlan], bool] | None = None) -> str | None:
    """None when the plan fits `device_bytes` per rank (with a KV slot); else one line: the phase
    that overflows, its largest parts, the device, and the single settings that, re-planned, fit
    (the mildest value per key); else the changes, picked greedily, that fit together; else
    that nothing does. host_fits: whether a re-planned setting's host memory fits (a setting
    that fits the device but not the host is not named)."""
    roles, g, uses, planned_for = plan.inputs
    plan = plan if planned_for == device_bytes else plan_memory(roles, g, uses, device_bytes)
    excess = _excess(plan, device_bytes)
    if excess <= 0:
        return None
    phase = plan.peak_phase if plan.peak > device_bytes else "rollout"
    parts = ", ".join(f"{k} {gib_text(v)}" for k, v in sorted(plan.phases[phase].items(),
                                                          key=lambda kv: -kv[1])[:3])
    why = f"but the device has {gib_text(device_bytes)}"
    if plan.peak <= device_bytes:           # what overflows is the KV cache's room
        why = (f"and kv_cache_tokens={g.kv_cache_tokens}" if g.kv_cache_tokens is not None else
               f"before its KV cache and {_R}.rollout.gpu_memory_utilization="
               f"{g.gpu_memory_utilization} of {gib_text(device_bytes)}") + \
            f" leaves no room for one sequence of max_model_len={g.max_model_len}"
    head = f"memory plan: {phase} needs {gib_text(plan.total(phase))} per GPU ({parts}) {why}"

    def excess_of(r, g2):      # over the device; a plan the host cannot hold: never taken
        p = plan_memory(r, g2, uses, device_bytes)
        x = _excess(p, device_bytes)
        return x if x > 0 or host_fits is None or host_fits(p) else math.inf

    def replan(candidates):     # [(excess, setting, roles, rollout)], best first
        return sorted(((excess_of(r, g2), s, r, g2) for s, r, g2 in candidates
                       if r is not None), key=lambda c: c[0])
    tried, ok = replan(_candidates(roles, g)), {}
    for x, s, r, g2 in tried:
        if x <= 0 and s.split("=")[0] not in ok:
            ok[s.split("=")[0]] = (plan_memory(r, g2, uses, device_bytes).peak, s)
    if ok:
        return f"{head}; fits with " + ", or ".join(
            f"{s} (peak {gib_text(p)})" for p, s in sorted(ok.values())[:4])
    chosen = []
    while tried and tried[0][0] < excess and len(chosen) < 8:    # greedy: the best change again
        excess, setting, *state = tried[0]
        chosen.append(setting)
        if excess <= 0:
            return f"{head}; fits with {' and '.join(chosen)} together"
        tried = replan(_candidates(*state))
    return head + ("; no combination of offload, gradient checkpointing, parallel sizes, "
                   "micro-batch tokens and KV budget fits: use more GPUs or a smaller model")


def kv_slots_short(plan: MemoryPlan, batch_sequences: int) -> str | None:
    """A warning line when the KV cache holds fewer max_model_len sequences than one generation
    replica's batch (the rollout then runs in waves); None otherwise."""
    g, n = plan.inputs[1], plan.kv_slots
    if g is None or n >= batch_sequences:
        return None
    why = f"{plan.kv_limit}={getattr(g, plan.kv_limit)}" if plan.kv_limit != "memory" else \
        f"gpu_memory_utilization={g.gpu_memory_utilization} leaves {gib_text(plan.kv_cache)}"
    return (f"memory plan: the KV cache holds {n} sequences of max_model_len={g.max_model_len} "
            f"({_R}.rollout.{why}) but a generation replica gets {batch_sequences}: the rollout "
            f"runs in {-(-batch_sequences // max(n, 1))} waves (more room: optimizer_offload, "
            f"param_offload, a higher gpu_memory_utilization or rollout tp, a lower max_model_len)")
