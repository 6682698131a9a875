"""The fastest token-major launch setting of the Triton decode attention in decode_step.py's JSON
lines (argv[1]), as BLOCK_N,WARPS,STAGES for bench_rollout.py --decode-launch; the default
64,4,3 when none ran. Used by gpu_session.sh's `tuned` part."""
import json
import sys

best = None
for line in open(sys.argv[1]):
    d = json.loads(line)
    if d.get("probe") == "attention_layout":
        rows = [r for r in d["rows"] if r["layout"] == "token_major" and "error" not in r
                and r["err"] < 0.01]
        best = min(rows, key=lambda r: r["ms"], default=None)
print(f'{best["block_n"]},{best["warps"]},{best["stages"]}' if best else "64,4,3")
