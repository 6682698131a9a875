"""The benchmarks' memory check: the plan rl.memory makes for a run (what the trainer prints at
start) beside the device peaks its steps measured, per phase and overall (tools/bench_ppo.py's
"plan", "measured_peak_gb", "measured_over_plan" and "phases")."""
from __future__ import annotations

from hybridengine.rl.memory import device_budget, plan_run_memory

PHASE_PEAK = "perf/max_memory_allocated_gb/"
# the trainer's rollout phase gathers the weights (the plan's reshard), then generates
TRAINER_PHASE = {"reshard": "rollout"}


def phase_peaks(peaks: dict[str, float], metrics: dict) -> dict[str, float]:
    """`peaks` (phase -> GiB) raised to a step's perf/max_memory_allocated_gb/<phase>."""
    for key, gb in metrics.items():
        if key.startswith(PHASE_PEAK):
            phase = key[len(PHASE_PEAK):]
            peaks[phase] = max(peaks.get(phase, 0.0), gb)
    return peaks


def _ratio(measured, planned):
    return measured / planned if measured and planned else None


def memory_check(trainer, measured_gb: float | None,
                 measured_phases: dict[str, float] | None = None) -> dict:
    """The memory plan the trainer prints at start (rl.memory: GiB per rank, its heaviest phase,
    the KV slots it expects, each phase's total) beside `measured_gb`, the largest
    perf/max_memory_allocated_gb of any step (None off CUDA, which reports none), and measured /
    planned; "phases": per trainer phase, the plan's GiB (the larger of reshard and rollout for its
    rollout; None for a phase the plan has not) beside `measured_phases` (phase_peaks: the
    largest of any step; None where none was measured)."""
    t = trainer
    critic = t.critic.engine.cfg if t.critic is not None else None
    plan = plan_run_memory(t.cfg, t.layout, t.actor.engine.cfg, critic, t.device,
                           device_budget(t.cfg, t.device))
    peak_gb, measured_phases = plan.peak / 2**30, measured_phases or {}
    planned = {p: plan.total(p) / 2**30 for p in plan.phases}
    rows: dict[str, float | None] = {}        # trainer phase -> the plan's GiB (its largest)
    for p, gb in planned.items():
        name = TRAINER_PHASE.get(p, p)
        rows[name] = max(rows.get(name) or 0.0, gb)
    rows.update({name: None for name in measured_phases if name not in rows})
    phases = {name: {"plan_gb": gb, "measured_gb": measured_phases.get(name),
                     "measured_over_plan": _ratio(measured_phases.get(name), gb)}
              for name, gb in rows.items()}
    return {"plan": {"peak_gb": peak_gb, "peak_phase": plan.peak_phase,
                     "kv_slots": plan.kv_slots, "phases_gb": planned},
            "measured_peak_gb": measured_gb,
            "measured_over_plan": _ratio(measured_gb, peak_gb), "phases": phases}
