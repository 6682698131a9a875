"""torch.compile as the engine uses it: how a function is compiled, and what compiling cost.

`compile_fn(fn, **torch_compile_kwargs)` is torch.compile(fn) called without duck sizing: dynamo
otherwise gives two sizes that happen to be equal at the first call one symbol and guards on
their equality, so a later call where they differ compiles again. Seen on the rollout
(tests/test_compile_bound.py): a decode batch of 16 rows against the 16 stop-token slots (the
commit compiled again for every other batch), the cache's slot count against the offset of an
index array in the prefill's host-to-device buffer (the whole prefill compiled again).

`CompileWatch.poll()` reads the compilations torch recorded since the last poll
(torch._dynamo.utils.get_compilation_metrics: one record per compiled frame, with its seconds
and, for a recompilation, the guard that failed) and returns their seconds (the metric
`timing_s/compile`) and, once the warm-up polls are over, one line per compilation: a
compilation after warm-up is a mid-run stall, and its line says which function and why.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import torch


def compile_fn(fn, **kwargs):
    """torch.compile(fn, **kwargs), each call (where compilation happens) without duck sizing."""
    compiled = torch.compile(fn, **kwargs)
    from torch.fx.experimental import _config as fx_config

    @functools.wraps(fn)
    def run(*args, **kw):
        with fx_config.patch(use_duck_shape=False):
            return compiled(*args, **kw)
    return run


def _records() -> list:
    try:
        from torch._dynamo.utils import get_compilation_metrics
    except ImportError:        # pragma: no cover - a torch without the records
        return []
    return list(get_compilation_metrics())


def _runtime(record) -> bool:
    """A record of work at run time (a lazily compiled backward, inductor's first-launch
    autotuning), not of a frame's compilation."""
    return bool(getattr(record, "is_runtime", False))


def _seconds(record) -> float:
    """Seconds of one record: a frame's compilation (dynamo + the backend's forward), or the
    run-time work (a backward compiled at its first call, first-launch autotuning)."""
    if _runtime(record):
        return (getattr(record, "duration_us", None) or 0) / 1e6
    if getattr(record, "is_forward", True) is False:
        return (getattr(record, "backward_cumulative_compile_time_us", None) or 0) / 1e6
    return float(getattr(record, "entire_frame_compile_time_s", None) or 0.0)


def _key(record) -> tuple:
    """Tells records apart (torch keeps the same objects; run-time ones share a compile id)."""
    return id(record), str(getattr(record, "compile_id", "")), getattr(record, "start_time_us",
                                                                        None)


def describe(record) -> str:
    """One line: `_prefill_hidden (model_runner.py:357), 18.3 s: <first guard that failed>`."""
    where = f"{os.path.basename(getattr(record, 'co_filename', '') or '?')}:" \
            f"{getattr(record, 'co_firstlineno', '?')}"
    reason = (getattr(record, "recompile_reason", None) or "").strip()
    lines = reason.splitlines()
    cause = (lines[0] + (f" (+{len(lines) - 1} more lines)" if len(lines) > 1 else "")) \
        if lines else "first compilation of this function"
    return f"{getattr(record, 'co_name', '?')} ({where}), {_seconds(record):.1f} s: {cause}"


@dataclass
class CompileReport:
    seconds: float = 0.0                            # of the records since the last poll
    late: list[str] = field(default_factory=list)   # describe() of each one after warm-up


class CompileWatch:
    """Polls torch's compilation records (process-wide: rollout and training alike); the first
    `warmup_polls` polls are the warm-up, whose compilations are expected."""

    def __init__(self, warmup_polls: int = 1):
        self.warmup_polls, self.polls = warmup_polls, 0
        self._seen = {_key(r) for r in _records()}    # compilations before this watch: not ours

    def poll(self) -> CompileReport:
        self.polls += 1
        records = _records()
        new = [r for r in records if _key(r) not in self._seen]
        # torch keeps the last 64 records: remember only those still there
        self._seen = {_key(r) for r in records}
        report = CompileReport(sum(_seconds(r) for r in new))
        if self.polls > self.warmup_polls:      # run-time work: a line when it stalled
            report.late = [describe(r) for r in new if not _runtime(r) or _seconds(r) >= 1.0]
        return report


_PARTS_US = (("dynamo", "dynamo_cumulative_compile_time_us"),
             ("aot", "aot_autograd_cumulative_compile_time_us"),
             ("inductor", "inductor_cumulative_compile_time_us"),
             ("codegen", "inductor_code_gen_cumulative_compile_time_us"),
             ("triton", "triton_compile_time_us"),
             ("autotune", "runtime_triton_autotune_time_us"))


def compile_breakdown() -> list[str]:
    """One line per compilation record torch holds (its last 64): where the time went (dynamo,
    AOTAutograd, inductor, its code generation, Triton, run-time autotuning) and inductor's local
    FX-graph cache hits / misses. For benchmarks' warm-up: a compilation that a warm cache
    should have made short shows here as the part that stayed long."""
    lines = []
    for r in _records():
        parts = ", ".join(f"{name} {(getattr(r, key, None) or 0) / 1e6:.1f}"
                          for name, key in _PARTS_US if getattr(r, key, None))
        hits = getattr(r, "inductor_fx_local_cache_hit_count", None)
        misses = getattr(r, "inductor_fx_local_cache_miss_count", None)
        cache = f"; fx cache {hits or 0} hit / {misses or 0} miss" if hits or misses else ""
        kind = "run time" if _runtime(r) else "backward" if getattr(r, "is_forward", True) is \
            False else "frame"
        lines.append(f"{describe(r)} [{kind}; {parts or 'no parts'}{cache}]")
    return lines


def compile_timers(min_seconds: float = 0.5) -> dict[str, float]:
    """torch's timed compilation steps so far in this process (dynamo_timed: tracing, AOT,
    inductor's lowering and code generation, `PyCodeCache.load_by_key_path` — loading a cached
    graph's module, which builds a C++ wrapper's binding — `async_compile.wait`, ...), seconds
    summed over all compilations, the steps of at least min_seconds, longest first."""
    from torch._dynamo.utils import compile_times
    names, values = compile_times(repr="csv", aggregate=True)
    timers = {n: float(v) for n, v in zip(names, values) if float(v) >= min_seconds}
    return dict(sorted(timers.items(), key=lambda kv: -kv[1]))
