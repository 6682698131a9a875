"""Python's full garbage collections kept out of training steps (trainer.gc_freeze_freq).

A compiled run holds millions of Python objects that live as long as the process: dynamo's
guards and graphs, inductor's modules, Triton's kernels. Python's automatic collector scans all
of them at each full (generation-2) collection: on an H100 one took 0.73 s inside a timed PPO
step (3.40 s against a median of 2.70; bench/RESULTS.md, session 38), and step 1 ran seven.
In a multi-rank run such a pause on one rank stalls the others at the next collective, which is
why Megatron has --manual-gc and torchtitan gc_freq.

Here the collector stays on (per-step garbage in reference cycles is still collected, with no
interval to tune), but what is alive after a full collection is frozen (gc.freeze: moved to a
generation the collector never scans), so later full collections scan only what was made since.
That happens after the first step, after any step that compiled (new long-lived objects), and
every `freq` steps, where the frozen set is unfrozen and collected too: an object frozen while
alive that later becomes garbage in a cycle waits at most `freq` steps. Every rank does it at the
same steps, so no rank waits on another's collection.
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
                "host/gc_frozen_objects": float(gc.get_freeze_count())}

    def close(self) -> None:
        """Objects go back to the collector (a process that goes on after the run)."""
        if self.done_once:
            gc.unfreeze()
            self.done_once = False
