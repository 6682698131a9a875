"""Device probe of session 5 (bench/RESULTS.md): where the rollout benchmark's device time
between kernels goes. One generate of tools/bench_rollout.py's workload (--compile
--compile-prefill) under torch.profiler; from its trace, per phase (prefill, decode): steps,
device time of the steps, kernel time, idle time inside steps and between steps, the host time
of each step's call, and the largest idle gaps with the kernels around them. One JSON line.

    python3 bench/probes/timeline.py [--batch 256] [--prompt-len 512] [--new-tokens 256]
"""
import json
import os
import sys
import tempfile
from collections import defaultdict

import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "tools"))
from bench_rollout import build_engine, parse_args, random_prompts  # noqa: E402
from hybridengine.models.decoder import Decoder  # noqa: E402
from hybridengine.models.shapes import QWEN2_5_0_5B  # noqa: E402

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def runtime_calls(calls: list[tuple], ranges: list[tuple]) -> dict:
    """CUDA runtime calls made inside the host ranges of a phase: per name the count, total and
    longest µs (a synchronising call or a blocked launch shows up as a long one)."""
    ranges = sorted(ranges)
    per = defaultdict(lambda: [0, 0.0, 0.0])
    i = 0
    for start, end, name in sorted(calls):
        while i < len(ranges) and ranges[i][1] < start:
            i += 1
        if i < len(ranges) and ranges[i][0] <= start and end <= ranges[i][1]:
            row = per[name]
            row[0] += 1
            row[1] += end - start
            row[2] = max(row[2], end - start)
    return {name: {"n": n, "total_us": round(t, 1), "max_us": round(m, 1)}
            for name, (n, t, m) in sorted(per.items(), key=lambda kv: -kv[1][1])[:10]}


def phase_gaps(events: list[dict]) -> dict:
    """Per phase: the device annotations' spans, the device ops inside them, the host ranges
    and the runtime calls made in them."""
    spans = defaultdict(list)          # phase -> [(start, end)] on the device
    host = defaultdict(list)           # phase -> [duration] of the host call
    host_ranges = defaultdict(list)    # phase -> [(start, end)] of the host call
    ops, calls = [], []
    for e in events:
        cat, name = e.get("cat"), e.get("name")
        if cat == "gpu_user_annotation" and name in ("prefill", "decode"):
            spans[name].append((e["ts"], e["ts"] + e["dur"]))
        elif cat == "user_annotation" and name in ("prefill", "decode"):
            host[name].append(e["dur"])
            host_ranges[name].append((e["ts"], e["ts"] + e["dur"]))
        elif cat in DEVICE_CATS:
            ops.append((e["ts"], e["ts"] + e.get("dur", 0), name))
        elif cat in ("cuda_runtime", "cuda_driver"):
            calls.append((e["ts"], e["ts"] + e.get("dur", 0), name))
    ops.sort()
    out = {}
    for phase, ranges in spans.items():
        ranges.sort()
        inside = busy = idle = 0.0
        gaps = []
        for start, end in ranges:
            mine = [o for o in ops if o[0] >= start and o[1] <= end]
            inside += end - start
            busy += sum(o[1] - o[0] for o in mine)
            for a, b in zip(mine, mine[1:]):
                if b[0] > a[1]:
                    idle += b[0] - a[1]
                    gaps.append((b[0] - a[1], a[2][:60], b[2][:60]))
        between = sum(b[0] - a[1] for a, b in zip(ranges, ranges[1:]) if b[0] > a[1])
        gaps.sort(reverse=True)
        h = host.get(phase, [])
        out[phase] = {"steps": len(ranges), "span_ms": inside / 1e3, "kernel_ms": busy / 1e3,
                      "idle_inside_ms": idle / 1e3, "gaps_inside": len(gaps),
                      "idle_between_steps_ms": between / 1e3,
                      "host_ms_per_step_mean": sum(h) / max(len(h), 1) / 1e3,
                      "host_ms_per_step_max": max(h, default=0) / 1e3,
                      "largest_gaps_us": [(round(g, 1), a, b) for g, a, b in gaps[:12]],
                      "runtime_calls": runtime_calls(calls, host_ranges.get(phase, []))}
        # the runtime calls the host makes between the phase's calls (the engine's loop:
        # retiring finished rows waits on an event there)
        between = [(a[1], b[0]) for a, b in zip(sorted(host_ranges.get(phase, [])),
                                                 sorted(host_ranges.get(phase, []))[1:])]
        out[phase]["runtime_calls_between"] = runtime_calls(calls, between)
    return out


def main():
    args = parse_args(sys.argv[1:] + ["--compile", "--compile-prefill"])
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = Decoder(QWEN2_5_0_5B, dtype=torch.bfloat16, device=dev).eval()
    prompts = random_prompts(args.batch, args.prompt_len, QWEN2_5_0_5B.vocab_size)
    engine, params = build_engine(model, args)
    engine.generate(prompts, params)                       # warm-up: compile, capture
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        engine.generate(prompts, params)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    print(json.dumps({"probe": "timeline", "stats": engine.stats, **phase_gaps(events)}))


if __name__ == "__main__":
    main()
