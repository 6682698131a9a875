"""A run owns its output directory (trainer.default_local_dir): one run at a time, and a fresh
start never mixes with, or silently truncates, an earlier run's metrics and checkpoints.

    claim_run_dir(root, resume_mode, overwrite, resumable, rank) -> RunDirLock | None

- Rank 0 takes an exclusive lock on <root>/.run.lock (fcntl.flock) for the life of the process.
  The kernel drops it when the process ends however it ends, so a crashed run's lock file is
  stale by construction: the next run takes it over (and says so), no pid guessing needed.
  A second run on a locked directory gets a RunDirError naming the owner.
- A fresh start (resume_mode=disable, or nothing to resume) on a directory that holds an earlier
  run's metrics or checkpoints is refused with the three ways out (resume, another directory,
  trainer.overwrite=true); with overwrite the earlier run's files are removed first, so the
  directory then holds one run only.
Every rank calls it; rank 0 decides and broadcasts, so all ranks raise the same error.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import time
from pathlib import Path

import torch.distributed as dist

from hybridengine.train import checkpoint as ckpt
from hybridengine.rl.tracking import METRICS_FILE

LOCK_FILE = ".run.lock"


class RunDirError(ValueError):
    """The output directory cannot be used as asked (bad input: exit 2)."""


class RunDirLock:
    """An exclusive flock on <root>/.run.lock, held until release() or the process ends."""

    def __init__(self, root: str | os.PathLike):
        self.root, self.fd = Path(root), None
        self.previous_owner: dict | None = None      # a run that ended without release()

    def acquire(self) -> "RunDirLock":
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise RunDirError(f"trainer.default_local_dir={self.root} cannot be used: "
                              f"{e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _describe(_read_owner(fd))
            os.close(fd)
            raise RunDirError(f"trainer.default_local_dir={self.root} is in use by another run"
                              f"{owner}; wait for it to end, or give this run another "
                              f"trainer.default_local_dir") from None
        self.previous_owner = _read_owner(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        """Clear the owner (a later run then knows this one ended cleanly) and unlock."""
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            os.close(self.fd)          # closing the descriptor drops the flock
            self.fd = None

    __del__ = release


def _read_owner(fd: int) -> dict | None:
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"null")
    except (OSError, ValueError):
        return None


def _describe(owner: dict | None) -> str:
    if not isinstance(owner, dict):
        return ""
    return f" (pid {owner.get('pid')} on {owner.get('host')}, started {owner.get('started')})"


def earlier_run_files(root: str | os.PathLike) -> list[Path]:
    """What an earlier run left in root: metrics.jsonl (non-empty), tensorboard/, checkpoints."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in sorted(root.iterdir())
             if p.name.startswith(("global_step_", ckpt.LATEST))
             or (p.name == "tensorboard" and p.is_dir())]
    metrics = root / METRICS_FILE
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.insert(0, metrics)
    return found


def _decide(root: Path, resume_mode: str, overwrite: bool, resumable: bool) -> str | None:
    """On rank 0: the error message, or None when the run may start (after clearing, if asked)."""
    fresh = resume_mode == "disable" or (resume_mode == "auto" and not resumable)
    if not fresh:
        return None
    earlier = earlier_run_files(root)
    if not earlier:
        return None
    if overwrite:
        for p in earlier:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        print(f"trainer.overwrite=true: removed the earlier run in {root} "
              f"({', '.join(p.name for p in earlier)})", flush=True)
        return None
    how = "trainer.resume_mode=disable" if resume_mode == "disable" else \
        "no checkpoint to resume (trainer.resume_mode=auto)"
    return (f"trainer.default_local_dir={root} holds an earlier run "
            f"({', '.join(p.name for p in earlier[:4])}{', …' if len(earlier) > 4 else ''}) and "
            f"this one would start fresh ({how}); resume it (trainer.resume_mode=auto), give this "
            f"run another trainer.default_local_dir, or set trainer.overwrite=true to replace it")


def claim_run_dir(root: str | os.PathLike, resume_mode: str, overwrite: bool, resumable: bool,
                  rank: int = 0, group=None) -> RunDirLock | None:
    """Lock root on rank 0 and check a fresh start against what is there (module doc). Returns
    rank 0's lock (hold it for the run), None on other ranks; raises RunDirError everywhere.
    `group`: all ranks of the run (rank 0 tells them its verdict); None for one process."""
    root, lock, error = Path(root), None, None
    if rank == 0:
        try:
            lock = RunDirLock(root).acquire()
            error = _decide(root, resume_mode, overwrite, resumable)
        except RunDirError as e:
            error = str(e)
        if lock is not None and lock.previous_owner and error is None:
            print(f"note: took over the lock of an earlier run that ended without releasing it"
                  f"{_describe(lock.previous_owner)}", flush=True)
    if group is not None:
        box = [error]
        dist.broadcast_object_list(box, src=0, group=group)
        error = box[0]
    if error is not None:
        if lock is not None:
            lock.release()
        raise RunDirError(error)
    return lock

