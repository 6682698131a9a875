"""Experiment tracking: metrics to console / JSONL / TensorBoard / wandb, a progress bar,
step timers.

Contract:
- `Tracker(backends, log_dir, ...)` is built on every rank with the same arguments (so a bad
  backend fails everywhere), but only rank 0 prints or writes. `log(metrics, step)` takes flat
  `{name: number}`; validation metrics are keys starting with "val/" in the same call.
- <log_dir>/metrics.jsonl is always written when log_dir is set: one strict-JSON object per
  `log` call, {"step": N, ...sorted keys}, flushed at once (non-finite values become null).
- A fresh run (resume_step=None) starts an empty metrics.jsonl and hides earlier TensorBoard
  events; resume_step=k keeps what was logged at steps <= k and drops the rest, so a run killed
  after its checkpoint at step k and resumed from it logs every step exactly once.
- `read_metrics` is the one parser of metrics.jsonl (tools/plot.py uses it too).
- The console backend prints one short line per step (rl.console.step_line: step/total, score,
  length, KL, throughput, step time, ETA, validation), or verl's full line with
  HYBRIDENGINE_CONSOLE=verl; a tqdm bar on stderr only when it is a terminal (the short lines
  carry the progress and ETA in a log file). `summary()` is the run's closing line.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import tqdm

from hybridengine.rl.console import FULL_LINE_ENV, StepClock, step_line, summary_line, val_score

KNOWN_BACKENDS = ("console", "jsonl", "tensorboard", "wandb")
# verl backends we do not carry: named in the error with what to use instead
VERL_ONLY_BACKENDS = ("mlflow", "swanlab", "vemlp_wandb", "clearml", "trackio")
METRICS_FILE = "metrics.jsonl"
NO_PROGRESS_ENV = "HYBRIDENGINE_NO_PROGRESS"


def format_console(metrics: Mapping[str, float], step: int) -> str:
    """verl's console line: `step:N - key:value - ...`, keys sorted, 4 significant digits."""
    parts = [f"step:{step}"] + [f"{key}:{metrics[key]:.4g}" for key in sorted(metrics)]
    return " - ".join(parts)


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Records of a metrics.jsonl, in file order.

    A malformed last line is dropped: it is what a run killed mid-write leaves behind. A
    malformed line elsewhere, or a record without an integer "step", is an error.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"metrics file not found: {path}")
    lines = path.read_text().splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise ValueError(f"{path}:{number}: not a JSON object") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ValueError(f"{path}:{number}: expected a JSON object with an integer 'step'")
        records.append(record)
    return records


def progress_enabled(rank: int, stream=sys.stderr) -> bool:
    """Bar only on rank 0, only on an interactive terminal, and not when opted out by env."""
    return rank == 0 and not os.environ.get(NO_PROGRESS_ENV) and stream.isatty()


def _normalize_backends(backends: str | Iterable[str]) -> list[str]:
    # verl configs accept trainer.logger=console as well as a list.
    names = [backends] if isinstance(backends, str) else list(backends)
    unknown = [name for name in names if name not in KNOWN_BACKENDS]
    if unknown and unknown[0] in VERL_ONLY_BACKENDS:
        raise ValueError(f"trainer.logger backend {unknown[0]!r} is verl's but not supported here; "
                         f"use wandb or tensorboard (known backends: {', '.join(KNOWN_BACKENDS)})")
    if unknown:
        raise ValueError(f"unknown trainer.logger backend {unknown[0]!r}; known backends: "
                         f"{', '.join(KNOWN_BACKENDS)}")
    if "wandb" in names:
        try:
            import wandb  # noqa: F401 - only whether it is there
        except ImportError:
            raise ValueError("trainer.logger=wandb needs the wandb package: pip install wandb "
                             "(it logs offline unless WANDB_MODE says otherwise), or log to "
                             "tensorboard (trainer.logger=[console,tensorboard])") from None
    return names


def check_backends(backends: str | Iterable[str]) -> list[str]:
    """trainer.logger's names, checked before a run builds anything (one-line ValueError)."""
    return _normalize_backends(backends)


def _to_float(key: str, value) -> float:
    try:
        return float(value)  # plain numbers, numpy scalars and 0-d tensors alike
    except (TypeError, ValueError):
        raise ValueError(f"metric {key!r} is not a number: {value!r}") from None


class Tracker:
    """Logs a step's metrics to the configured backends; see the module docstring."""

    def __init__(self, backends: str | Sequence[str], log_dir: str | os.PathLike | None = None,
                 project: str = "hybridengine", experiment: str = "run", rank: int = 0,
                 resume_step: int | None = None, total_steps: int | None = None):
        """backends: trainer.logger (a name or a list of names from KNOWN_BACKENDS).
        log_dir: trainer.default_local_dir; enables metrics.jsonl (and TensorBoard's folder).
        project, experiment: the progress bar's label. resume_step: the checkpoint step a
        resumed run starts after (None: a fresh run). total_steps: the progress bar's length.
        """
        names = _normalize_backends(backends)
        if log_dir is None and ("jsonl" in names or "tensorboard" in names):
            raise ValueError(f"trainer.logger {names} needs a log directory "
                             "(trainer.default_local_dir)")
        self.rank = rank
        self.console = rank == 0 and "console" in names
        self.full_line = os.environ.get(FULL_LINE_ENV) == "verl"
        self.total_steps = total_steps
        self._first_step = (resume_step or 0) + 1
        self._clock = StepClock(total_steps, resume_step or 0)
        self._last_step = None
        self._vals: list[float] = []
        self._jsonl = None
        self._tensorboard = None
        self._wandb = None
        self._bar = None
        if rank != 0:
            return
        if log_dir is not None:
            log_dir = Path(log_dir)
            log_dir.mkdir(parents=True, exist_ok=True)
            self._jsonl = _open_jsonl(log_dir / METRICS_FILE, resume_step)
        if "tensorboard" in names:
            from torch.utils.tensorboard import SummaryWriter  # heavy import, only when asked
            # A purge event hides everything at or after purge_step from earlier runs in the
            # same directory: steps > resume_step on resume, all of them on a fresh run.
            purge_step = 0 if resume_step is None else resume_step + 1
            self._tensorboard = SummaryWriter(str(log_dir / "tensorboard"),
                                              purge_step=purge_step)
        if "wandb" in names:
            self._wandb = WandbBackend(project, experiment, log_dir)
        if progress_enabled(rank):
            self._bar = tqdm.tqdm(total=total_steps, initial=resume_step or 0, unit="step",
                                  desc=f"{project}/{experiment}", file=sys.stderr,
                                  dynamic_ncols=True)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Write one step's metrics to every backend (rank 0 only)."""
        if self.rank != 0:
            return
        values = {key: _to_float(key, value) for key, value in metrics.items()}
        if self.console:
            # tqdm.write clears the bar first, so lines never interleave with it.
            tqdm.tqdm.write(self._console_line(values, step), file=sys.stdout)
            sys.stdout.flush()
        if self._jsonl is not None:
            record = {"step": step}
            for key in sorted(values):
                record[key] = values[key] if math.isfinite(values[key]) else None
            self._jsonl.write(json.dumps(record, allow_nan=False) + "\n")
            self._jsonl.flush()
        if self._tensorboard is not None:
            for key, value in values.items():
                self._tensorboard.add_scalar(key, value, global_step=step)
            self._tensorboard.flush()
        if self._wandb is not None:
            self._wandb.log(values, step)
        if self._bar is not None and step > self._bar.n:
            self._bar.update(step - self._bar.n)

    def _console_line(self, values: dict[str, float], step: int) -> str:
        if step < self._first_step:     # validation before training: time steps from here
            self._clock.start(step)
        else:
            self._last_step = step
        val = val_score(values)
        if val is not None:
            self._vals.append(val)
        if self.full_line:
            return format_console(values, step)
        return step_line(values, step, self.total_steps, self._clock.eta_s(step))

    def summary(self) -> str | None:
        """`done: steps 1-20 in 0:52 (2.60 s/step), val 0.034 -> 0.961`; None when the console
        is off or no training step was logged."""
        if not self.console or self._last_step is None:
            return None
        return summary_line(self._first_step, self._last_step, self._clock.elapsed_s(),
                            self._vals)

    def close(self) -> None:
        """Flush and close every backend."""
        if self._bar is not None:
            self._bar.close()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.close()

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class WandbBackend:
    """trainer.logger=wandb (verl's): each step's metrics under the names and step of
    metrics.jsonl. Offline unless WANDB_MODE says otherwise (files under <log_dir>/wandb;
    `wandb sync` uploads them), so a run needs neither network nor account."""

    def __init__(self, project: str, experiment: str, log_dir: Path | None):
        import wandb
        self._run = wandb.init(project=project, name=experiment,
                               mode=os.environ.get("WANDB_MODE") or "offline",
                               dir=str(log_dir) if log_dir is not None else None)

    def log(self, values: Mapping[str, float], step: int) -> None:
        self._run.log(dict(values), step=step)

    def close(self) -> None:
        self._run.finish()


def _open_jsonl(path: Path, resume_step: int | None):
    """Open metrics.jsonl for appending after keeping only records with step <= resume_step."""
    kept = []
    if resume_step is not None and path.exists():
        kept = [r for r in read_metrics(path) if r["step"] <= resume_step]
    # Write-then-rename: a crash here leaves either the old file or the new one, never half.
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.writelines(json.dumps(record) + "\n" for record in kept)
    os.replace(tmp, path)
    return open(path, "a")


@contextlib.contextmanager
def timer(name: str, timings: dict[str, float], sync_cuda: bool = False) -> Iterator[None]:
    """Add the seconds spent in the block to timings[name] (accumulating over uses).

    With sync_cuda, the device is synchronized before (work queued earlier is not charged to
    this block) and after (work this block queued is); without it, only host time is measured.
    """
    sync = False
    if sync_cuda:
        import torch  # deferred: tools that only read metrics (tools/plot.py) skip torch
        sync = torch.cuda.is_available()
    if sync:
        torch.cuda.synchronize()
    start = time.perf_counter()
    try:
        yield
    finally:
        if sync:
            torch.cuda.synchronize()
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - start


def reduce_metrics(metrics: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Mean per key over a list of metric dicts (e.g. one per micro-batch); a key missing from
    some dicts is averaged over the dicts that have it."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for entry in metrics:
        for key, value in entry.items():
            sums[key] = sums.get(key, 0.0) + _to_float(key, value)
            counts[key] = counts.get(key, 0) + 1
    return {key: sums[key] / counts[key] for key in sums}
