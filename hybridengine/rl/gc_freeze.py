"""Python's full garbage collections kept out of training steps (trainer.gc_freeze_freq).

A compiled run holds close to a million Python objects that live as long as the process (829,677
in the PPO seed run: dynamo's guards and graphs, inductor's modules, Triton's kernels), and
Python's automatic collector walks all of them at each full (generation-2) collection: 0.46 s on
an H100 host, and one such collection landed inside a timed PPO step's actor update there
(0.73 s of a 3.40 s step against a median of 2.70; bench/RESULTS.md, session 38). In a
multi-rank run the pause of one rank stalls the others at the next collective, which is why
Megatron has --manual-gc and torchtitan gc_freq.

Here the collector stays on (per-step garbage in reference cycles is still collected, with no
interval to tune), but what is alive after a full collection between steps is frozen (gc.freeze:
moved to a generation the collector never walks), so later full collections walk only what was made
since (in that run, one right after: 0.01 ms frozen against 459 ms not). That happens after the
first step, after any step that compiled (new long-lived objects), and every `freq` steps, where
the frozen set is unfrozen and collected too: an object frozen while alive that later becomes
garbage in a cycle waits at most `freq` steps. The first and every freq-th step are the same on
every rank; a step that compiled on one rank alone was already that rank's slow step. Its seconds
are `timing_s/gc_freeze`, not part of `timing_s/step`.
"""
from __future__ import annotations

import atexit
import gc
import time

# A process that ends frozen (a benchmark or test calling train_step without fit) would skip its
# frozen objects' finalisation at exit; extension modules then report them as leaked.
atexit.register(gc.unfreeze)


class GcFreeze:
    """after_step(step, compile_s) once per training step, on every rank alike."""

    def __init__(self, freq: int):
        self.freq = freq
        self.done_once = False

    def due(self, step: int, compile_s: float) -> bool:
        if self.freq <= 0:
            return False
        return not self.done_once or compile_s > 0 or step % self.freq == 0

    def after_step(self, step: int, compile_s: float) -> dict:
        """Collect everything and freeze what is alive when due; its seconds and the frozen
        count as metrics (only on the steps where it ran)."""
        if not self.due(step, compile_s):
            return {}
        t0 = time.perf_counter()
        gc.unfreeze()
        gc.collect()
        gc.freeze()
        self.done_once = True
        return {"timing_s/gc_freeze": time.perf_counter() - t0,
                "perf/gc_frozen_objects": float(gc.get_freeze_count())}

    def close(self) -> None:
        """Objects go back to the collector (a process that goes on after the run)."""
        if self.done_once:
            gc.unfreeze()
            self.done_once = False
