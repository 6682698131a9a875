"""Batch.select's host time alone (no GPU work beside it): session 39's host profile of a PPO seed
step charged it 117 ms over 10 calls (~12 ms a call) on an H100 host, against ~0.2 ms on the CPU
machine for the same [256, 256] tensors. Prints ms a call, with torch's default thread count and
with one thread.    python3 bench/probes/batch_select.py"""
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from hybridengine.rl.batch import Batch  # noqa: E402

B, R = 256, 256
KEYS = ("rollout_logprob", "token_level_scores", "old_logprob", "values", "token_level_rewards",
        "advantages", "returns", "response_mask")
batch = Batch([[1] * 90] * B, [[2] * R] * B, list(range(B)), ["x"] * B, [None] * B, [{}] * B, R,
              {k: torch.randn(B, R) for k in KEYS})
rows = list(range(B))
random.Random(0).shuffle(rows)
out = {"python": sys.version.split()[0], "torch": torch.__version__}
for threads in (torch.get_num_threads(), 1):
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    for _ in range(50):
        batch.select(rows[:64])
    out[f"select64_ms_threads{threads}"] = (time.perf_counter() - t0) / 50 * 1e3
print(json.dumps(out))
