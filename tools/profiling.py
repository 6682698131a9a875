"""Kernel tables out of a torch.profiler run, per named range (torch.profiler.record_function).

    with torch.profiler.profile(activities=[CPU, CUDA]) as prof:
        ... code that opens record_function("update_actor"), ("decode"), ... ...
    table = kernel_table(prof, ["update_actor", "decode"])

Each device kernel is charged to the innermost named range that encloses it on the device: the
profiler records every record_function range a second time on the GPU timeline (a "user
annotation" spanning the range's kernels), so a CUDA-graph replay's kernels go to the range
around the replay. Where a torch records no such annotations, a kernel goes to the range around
the host op that launched it (its linked correlation id). For each range: kernel time, kernel
count, time per category (gemm, attention, comm, copy, other), busy time per stream next to the
range's span on the device (whether communication and copies overlap), and the top kernels by
time. Without device kernels (CPU runs) host ops by self time play their part, so the tables
can be tested off-GPU.
"""
from __future__ import annotations

import bisect
import gc
import re
import time
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import torch
from torch.autograd import DeviceType

CATEGORIES = (
    ("comm", re.compile(r"nccl|c10d|all_?gather|reduce_?scatter|all_?reduce|broadcast", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("gemm", re.compile(r"gemm|cutlass|xmma|cublas|nvjet|matmul|\bmm\b|addmm|linear", re.I)),
    # inductor's fused pointwise / reduction kernels name the ops they fuse: "cat" or "copy" in
    # triton_poi_fused_cat_mul_silu_silu_backward_split_0 made that 42 ms of an update "copy"
    # (bench/RESULTS.md session 37)
    ("fused", re.compile(r"^triton_(poi|per|red)_")),
    ("copy", re.compile(r"copy|memcpy|memset|cat|index|gather|scatter|fill", re.I)),
)


def category(kernel_name: str) -> str:
    for name, pattern in CATEGORIES:
        if pattern.search(kernel_name):
            return name
    return "other"


def _owner(event, ranges: set[str]) -> str | None:
    while event is not None:
        if event.name in ranges:
            return event.name
        event = event.cpu_parent
    return None


def timeline(spans: Iterable[tuple[float, float, str]]) -> tuple[list[float], list]:
    """Nested spans (start, end, name) -> (starts, owners): from starts[i] until the next start
    the innermost enclosing span is owners[i] (None: no span)."""
    starts, owners, stack = [], [], []          # stack: (end, name) of the open spans

    def close(until: float):
        while stack and stack[-1][0] <= until:
            end = stack.pop()[0]
            starts.append(end)
            owners.append(stack[-1][1] if stack else None)

    for start, end, name in sorted(spans, key=lambda s: (s[0], -s[1])):
        close(start)
        stack.append((end, name))
        starts.append(start)
        owners.append(name)
    close(float("inf"))
    return starts, owners


def owner_at(starts: list[float], owners: list, t: float):
    i = bisect.bisect_right(starts, t) - 1
    return owners[i] if i >= 0 else None


def _device_kernels(events, ranges: set[str]) -> list:
    """The device's work: its kernels and copies, not the annotations record_function leaves on
    the device timeline (the named ranges' and every other one's)."""
    return [e for e in events if e.device_type == DeviceType.CUDA and e.name not in ranges
            and not getattr(e, "is_user_annotation", False)]


def _work_items(events, ranges: set[str]):
    """(range, kernel name, start_us, end_us, stream, launcher) of every device kernel
    (launcher: _launch_label), or of every host op (its self time; launcher None) when the run
    had no device kernels."""
    device = [e for e in events if e.device_type == DeviceType.CUDA]
    annotations = [e for e in device if e.name in ranges]
    kernels = _device_kernels(events, ranges)
    if kernels:
        index = _host_index(events)
        if annotations:
            starts, owners = timeline((a.time_range.start, a.time_range.end, a.name)
                                      for a in annotations)
            owner = lambda k: owner_at(starts, owners, k.time_range.start)     # noqa: E731
        else:
            owner = lambda k: _owner(_launcher(k, index), ranges)              # noqa: E731
        for k in kernels:
            yield (owner(k), k.name, k.time_range.start, k.time_range.end, k.device_resource_id,
                   _launch_label(k, index))
        return
    for e in events:        # host ops by self time (a matmul's work is its own, not its children's)
        if e.device_type == DeviceType.CPU and e.name not in ranges and e.self_cpu_time_total > 0:
            start = e.time_range.start
            yield _owner(e, ranges), e.name, start, start + e.self_cpu_time_total, e.thread, None


_RUNTIME = ("cuda", "cu")       # cudaLaunchKernel, cudaGraphLaunch, cudaMemcpyAsync, cuLaunch...


def _host_index(events) -> tuple[dict, dict]:
    """({CUDA correlation id: the runtime call}, {external id: the host op}): a kernel's own id
    is the correlation id of the runtime call that launched it (the runtime call then nests in
    the op, on the op's thread); its linked_correlation_id, where set (> 0), is the op's id.
    The two numberings are apart, so each has its own map."""
    runtime, ops = {}, {}
    for e in events:
        if e.device_type != DeviceType.CPU or e.is_async:
            continue
        if e.name.startswith(_RUNTIME):
            runtime[e.id] = e
        elif not getattr(e, "linked_correlation_id", 0) and e.id > 0:
            ops[e.id] = e
    return runtime, ops


def _launcher(kernel, index: tuple[dict, dict]):
    """The host event that launched `kernel` (the runtime call, else the op), or None."""
    runtime, ops = index
    event = runtime.get(kernel.id)
    link = getattr(kernel, "linked_correlation_id", 0)
    if event is None and link > 0:
        event = ops.get(link)
    return event


def _launch_label(kernel, index: tuple[dict, dict]) -> str:
    """What launched `kernel`: the innermost enclosing sub-range (a record_function whose name
    holds a dot, e.g. "train.optimizer") of its host launch, else the host op that launched it."""
    event, op = _launcher(kernel, index), None
    while event is not None:
        if _is_sub_range(event.name):
            return event.name
        if op is None and not event.name.startswith(_RUNTIME):
            op = event.name
        event = event.cpu_parent
    return op or "unknown"


def idle_gaps(items: Iterable[tuple[float, float, str]], min_gap_us: float = 5.0
              ) -> tuple[float, dict[str, float]]:
    """(start_us, end_us, launcher) of one range's device work -> (idle us, {launcher: idle us}):
    every gap of at least min_gap_us in which no work ran, charged to the launcher of the work
    that ended it (the device waited for the host to launch that)."""
    total, by, busy_end = 0.0, defaultdict(float), None
    for start, end, label in sorted(items):
        if busy_end is not None and start - busy_end >= min_gap_us:
            total += start - busy_end
            by[label] += start - busy_end
        busy_end = end if busy_end is None else max(busy_end, end)
    return total, dict(by)


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def profile_ranges(fn, ranges: Iterable[str], top: int = 12) -> dict:
    """Run fn() under torch.profiler (CPU, and CUDA when present; the device synchronized
    before the profile closes) and return kernel_table of its named ranges."""
    from torch.profiler import ProfilerActivity, profile
    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    return kernel_table(prof, ranges, top)


def _is_sub_range(name: str) -> bool:
    """A record_function sub-range's name ("train.forward"), not an op's ("aten::mm")."""
    return "." in name and "::" not in name


def host_sub_ranges(events, ranges: set[str]) -> dict[str, dict[str, list]]:
    """{range: {sub-range: [host ms, count]}}: the host's wall time inside each sub-range
    (record_function names with a dot) of each named range, nested ones counted in their
    own name too. Beside idle_by_launcher_ms it says whether the device waited because the
    host spent that long there."""
    out: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    for e in events:
        if e.device_type != DeviceType.CPU or e.is_async or not _is_sub_range(e.name):
            continue
        owner = _owner(e.cpu_parent, ranges)
        if owner is not None:
            slot = out[owner][e.name]
            slot[0] += (e.time_range.end - e.time_range.start) / 1e3
            slot[1] += 1
    return out


def kernel_table(prof, ranges: Iterable[str], top: int = 12) -> dict:
    """{range: {kernel_ms, kernels, span_ms, by_category_ms, streams_busy_ms, top, host_ms}};
    kernels outside every named range go to "other" (only when there are some). host_ms:
    host_sub_ranges' {sub-range: [ms, count]} of the range, where it has any."""
    names = set(ranges)
    events = prof.events()
    rows = defaultdict(list)
    for owner, kname, start, end, stream, launcher in _work_items(events, names):
        rows[owner or "other"].append((kname, start, end, stream, launcher))
    host = host_sub_ranges(events, names)
    out = {}
    for owner, items in rows.items():
        by_name, by_cat, by_stream = defaultdict(lambda: [0, 0.0]), defaultdict(float), \
            defaultdict(list)
        for kname, start, end, stream, _ in items:
            by_name[kname][0] += 1
            by_name[kname][1] += end - start
            by_cat[category(kname)] += end - start
            by_stream[str(stream)].append((start, end))
        ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
        out[owner] = {
            "kernel_ms": round(sum(e - s for _, s, e, _, _ in items) / 1e3, 3),
            "kernels": len(items),
            "span_ms": round((max(e for _, _, e, _, _ in items)
                              - min(s for _, s, _, _, _ in items)) / 1e3, 3),
            "by_category_ms": {c: round(us / 1e3, 3) for c, us in
                               sorted(by_cat.items(), key=lambda kv: -kv[1])},
            "streams_busy_ms": {s: round(_busy_us(iv) / 1e3, 3) for s, iv in by_stream.items()},
            "top": [[n[:120], c, round(us / 1e3, 3)] for n, (c, us) in ranked],
        }
        if items[0][4] is not None:            # device kernels: where the device waited
            idle, by = idle_gaps((s, e, launcher) for _, s, e, _, launcher in items)
            out[owner]["idle_ms"] = round(idle / 1e3, 3)
            out[owner]["idle_by_launcher_ms"] = {
                k: round(v / 1e3, 3) for k, v in sorted(by.items(), key=lambda kv: -kv[1])[:top]}
        if host.get(owner):
            out[owner]["host_ms"] = {k: [round(ms, 3), n] for k, (ms, n) in
                                     sorted(host[owner].items(), key=lambda kv: -kv[1][0])}
    return out


def host_diagnosis(fn, top: int = 30, stack_depth: int = 4) -> dict:
    """fn() once under cProfile and, on CUDA, torch's sync debug mode: where the host's time
    goes (functions by own time and by cumulative time, ms and calls) and which Python lines
    made the host wait for the device (a synchronising CUDA call: an .item(), a device-to-host
    copy, a nonzero), each with its `stack_depth` innermost callers and a count. A host-bound
    phase's cure depends on which of the two it is: work per call, or a wait that empties the
    device's queue."""
    import cProfile
    import pstats
    import traceback
    import warnings

    syncs: dict[str, int] = defaultdict(int)
    cuda = torch.cuda.is_available()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" not in str(message):
            return
        frames = traceback.extract_stack()[:-1]
        # the innermost frames outside torch and warnings: the caller that synchronised
        ours = [f for f in frames if "/torch/" not in f.filename and "warnings" not in f.filename]
        key = " <- ".join(f"{Path(f.filename).name}:{f.lineno}({f.name})"
                          for f in reversed(ours[-stack_depth:]))
        syncs[key] += 1

    profiler = cProfile.Profile()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        shown, warnings.showwarning = warnings.showwarning, record
        try:
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            profiler.enable()
            fn()
        finally:
            profiler.disable()
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = shown
    stats = pstats.Stats(profiler).stats      # {(file, line, name): (cc, nc, tt, ct, callers)}

    def rows(index):
        ranked = sorted(stats.items(), key=lambda kv: -kv[1][index])[:top]
        return [[f"{Path(f).name}:{line}({name})", nc, round(tt * 1e3, 2), round(ct * 1e3, 2)]
                for (f, line, name), (_, nc, tt, ct, _) in ranked]

    def callers(n_functions=12, n_callers=5):
        """Who called the functions of most own time: a builtin's own time (torch.tensor,
        Batch.select's indexing) says nothing of which line to change without them."""
        out = {}
        for (f, line, name), (_, _, _, _, by) in sorted(stats.items(),
                                                        key=lambda kv: -kv[1][2])[:n_functions]:
            ranked = sorted(by.items(), key=lambda kv: -kv[1][2])[:n_callers]  # by own time
            out[f"{Path(f).name}:{line}({name})"] = [
                [f"{Path(cf).name}:{cl}({cn})", v[1], round(v[2] * 1e3, 2)]
                for (cf, cl, cn), v in ranked]
        return out
    return {"columns": ["function", "calls", "own_ms", "cumulative_ms"],
            "by_own_time": rows(2), "by_cumulative_time": rows(3),
            "callers_columns": ["caller", "calls", "own_ms"], "callers": callers(),
            "syncs": dict(sorted(syncs.items(), key=lambda kv: -kv[1])[:top])}


class GcPauses:
    """Python's garbage collections while installed (gc.callbacks): per generation, how many ran
    and their milliseconds, taken (and reset) once per step. A collection of the oldest
    generation walks every tracked object, the compiled graphs' included: a host pause the device
    waits out when it lands inside a host-bound phase (the update phases' run-to-run spread is the
    suspect it tests)."""

    def __init__(self):
        self._started: float | None = None
        self._counts, self._ms = [0, 0, 0], [0.0, 0.0, 0.0]
        gc.callbacks.append(self._on_collect)

    def _on_collect(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            generation = info["generation"]
            self._counts[generation] += 1
            self._ms[generation] += (time.perf_counter() - self._started) * 1e3
            self._started = None

    def take(self) -> dict:
        """{"collections": [gen 0, 1, 2], "ms": [...]} since the last take."""
        out = {"collections": self._counts, "ms": [round(ms, 2) for ms in self._ms]}
        self._counts, self._ms = [0, 0, 0], [0.0, 0.0, 0.0]
        return out

    def close(self) -> None:
        gc.callbacks.remove(self._on_collect)


def full_collection_ms(repeats: int = 3) -> dict:
    """What one full collection costs this process now: the best of `repeats` with what
    rl.gc_freeze froze left frozen (the collections a frozen run pays), then with it given back to
    the collector (what Python's automatic full collections cost without the freeze); the frozen
    state as it was after."""
    def best() -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            gc.collect()
            times.append((time.perf_counter() - t0) * 1e3)
        return round(min(times), 2)
    frozen_objects = gc.get_freeze_count()
    frozen = best()
    gc.unfreeze()
    tracked = len(gc.get_objects())
    unfrozen = best()
    if frozen_objects:
        gc.freeze()
    return {"frozen_objects": frozen_objects, "tracked_objects": tracked,
            "frozen_ms": frozen, "unfrozen_ms": unfrozen}
