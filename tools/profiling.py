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
import re
from collections import defaultdict
from collections.abc import Iterable

import torch
from torch.autograd import DeviceType

CATEGORIES = (
    ("comm", re.compile(r"nccl|c10d|all_?gather|reduce_?scatter|all_?reduce|broadcast", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("gemm", re.compile(r"gemm|cutlass|xmma|cublas|nvjet|matmul|\bmm\b|addmm|linear", re.I)),
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


def _work_items(events, ranges: set[str]):
    """(range, kernel name, start_us, end_us, stream) of every device kernel, or of every host op
    (its self time) when the run had no device kernels."""
    device = [e for e in events if e.device_type == DeviceType.CUDA]
    annotations = [e for e in device if e.name in ranges]
    kernels = [e for e in device if e.name not in ranges]
    if annotations:
        starts, owners = timeline((a.time_range.start, a.time_range.end, a.name)
                                  for a in annotations)
        for k in kernels:
            yield (owner_at(starts, owners, k.time_range.start), k.name, k.time_range.start,
                   k.time_range.end, k.device_resource_id)
        return
    if kernels:
        host = {e.id: e for e in events if e.device_type == DeviceType.CPU}
        for k in kernels:
            launcher = host.get(getattr(k, "linked_correlation_id", 0))
            yield (_owner(launcher, ranges), k.name, k.time_range.start, k.time_range.end,
                   k.device_resource_id)
        return
    for e in events:        # host ops by self time (a matmul's work is its own, not its children's)
        if e.device_type == DeviceType.CPU and e.name not in ranges and e.self_cpu_time_total > 0:
            start = e.time_range.start
            yield _owner(e, ranges), e.name, start, start + e.self_cpu_time_total, e.thread


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


def kernel_table(prof, ranges: Iterable[str], top: int = 12) -> dict:
    """{range: {kernel_ms, kernels, span_ms, by_category_ms, streams_busy_ms, top}}; kernels
    outside every named range go to "other" (only when there are some)."""
    names = set(ranges)
    rows = defaultdict(list)
    for owner, kname, start, end, stream in _work_items(prof.events(), names):
        rows[owner or "other"].append((kname, start, end, stream))
    out = {}
    for owner, items in rows.items():
        by_name, by_cat, by_stream = defaultdict(lambda: [0, 0.0]), defaultdict(float), \
            defaultdict(list)
        for kname, start, end, stream in items:
            by_name[kname][0] += 1
            by_name[kname][1] += end - start
            by_cat[category(kname)] += end - start
            by_stream[str(stream)].append((start, end))
        ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
        out[owner] = {
            "kernel_ms": round(sum(e - s for _, s, e, _ in items) / 1e3, 3),
            "kernels": len(items),
            "span_ms": round((max(e for _, _, e, _ in items) - min(s for _, s, _, _ in items))
                             / 1e3, 3),
            "by_category_ms": {c: round(us / 1e3, 3) for c, us in
                               sorted(by_cat.items(), key=lambda kv: -kv[1])},
            "streams_busy_ms": {s: round(_busy_us(iv) / 1e3, 3) for s, iv in by_stream.items()},
            "top": [[n[:120], c, round(us / 1e3, 3)] for n, (c, us) in ranked],
        }
    return out
