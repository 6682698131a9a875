"""Independent one-process launches (python launch/ppo.py, a tools/ script) started together.

Each such launch runs one thread (OMP_NUM_THREADS=1), so while it runs CI's second core idles;
two at a time take about half the wall time of one after the other. A module-scoped fixture
starts a module's launches (in the order its tests read them), and each test waits for its
own result and asserts on it exactly as it did on its own subprocess.run.
"""
from __future__ import annotations

import subprocess
from concurrent.futures import Future, ThreadPoolExecutor


class Launches:
    """name -> subprocess.run(cmd, capture_output=True, text=True, **kw), at most `workers` at
    once, started in the order of start()."""

    def __init__(self, workers: int = 2):
        self._pool = ThreadPoolExecutor(workers)
        self._jobs: dict[str, Future] = {}

    def start(self, name: str, cmd: list[str], **kw) -> None:
        assert name not in self._jobs, name
        self._jobs[name] = self._pool.submit(subprocess.run, cmd, capture_output=True, text=True,
                                             **kw)

    def call(self, name: str, fn, *args) -> None:
        """fn(*args) in the pool (a launch that needs more than subprocess.run)."""
        assert name not in self._jobs, name
        self._jobs[name] = self._pool.submit(fn, *args)

    def result(self, name: str) -> subprocess.CompletedProcess:
        return self._jobs[name].result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
