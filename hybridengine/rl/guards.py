"""Run-time guards of the trainer loop: failures that speak in one line.

- `Phases` records which phase of which step this rank is in. A collective that times out
  (a hung peer) or loses its peer (a dead one) inside `phases.enter(name)` is re-raised as
  `PeerFailure`: "rank 0 timed out in phase rollout (step 2) after 10.0 s ...". The training
  and generation groups inherit trainer.collective_timeout_s (parallel.mesh), so a hung peer
  ends the job instead of hanging it; gloo raises the timeout as an exception, NCCL's watchdog aborts the process itself.
- `count_skipped_updates` applies trainer.nan_policy to a role's update metrics: the optimizer
  already refuses a step whose gradient norm is not finite (weights and Adam state untouched);
  `abort` turns that into `NonFiniteUpdate`, `skip` returns how many updates were dropped so the
  trainer logs them (training/nan_skipped_updates). Never silent.
- `inject_faults` holds the test hooks that kill or hang a rank at a given step.
- `report_failure` says a failure once for the whole job (`error: <line>` on stderr, one per
  line of the message), and records it where torchrun's summary shows it.

Every error here derives from `RunError`: launch/ppo.py prints its message as one line, exit 1.
"""
from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import math
import os
import signal
import sys
import time
from collections.abc import Iterator

from hybridengine.rl.tracking import timer

# What gloo and NCCL say when a peer is silent past the group timeout or gone.
# trainer.nan_policy: a non-finite update aborts the run, or is dropped and counted
NAN_POLICIES = ("abort", "skip")

_TIMEOUT_SIGNS = ("Timed out waiting", "Watchdog caught collective operation timeout",
                  "Socket Timeout", "wait timeout")
_LOST_PEER_SIGNS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                    "NCCL communicator was aborted")


class RunError(RuntimeError):
    """A failure of the run (not of its input) whose message is one complete line."""


class PeerFailure(RunError):
    """A collective timed out or lost its peer; names this rank, its phase and the wait.
    `kind` is 'timeout' (this rank is the one that knows: the peer hangs) or 'lost' (the peer
    exited, and the peer's own exit is the failure's cause)."""

    def __init__(self, message: str, kind: str = "timeout"):
        super().__init__(message)
        self.kind = kind


class NonFiniteUpdate(RunError):
    """trainer.nan_policy=abort met a non-finite loss or gradient."""


class SaveError(RunError):
    """A checkpoint could not be written; the previous one is intact."""


def peer_failure_kind(error: BaseException) -> str | None:
    """'timeout', 'lost' or None: whether `error` is a collective's failure to hear a peer.

    Only the library's own exception types count: a user's reward function raising
    TimeoutError arrives as a RewardError and stays one.
    """
    import torch.distributed as dist
    if type(error) is not RuntimeError and not isinstance(error, dist.DistError):
        return None
    text = str(error)
    if any(sign in text for sign in _TIMEOUT_SIGNS):
        return "timeout"
    if any(sign in text for sign in _LOST_PEER_SIGNS):
        return "lost"
    return None


class Phases:
    """The phase and step this rank is in, for messages about failures inside collectives."""

    def __init__(self, rank: int, timeout_s: float):
        self.rank, self.timeout_s = rank, timeout_s
        self.step = 0
        self.name = "setup"

    @contextlib.contextmanager
    def enter(self, name: str, timings: dict[str, float] | None = None,
              sync_cuda: bool = False) -> Iterator[None]:
        """Run a block as phase `name` (and add its seconds to timings[name] when given)."""
        outer, self.name = self.name, name
        start = time.monotonic()
        try:
            if timings is None:
                yield
            else:
                with timer(name, timings, sync_cuda):
                    yield
        except PeerFailure:
            raise                     # already named by the innermost phase
        except Exception as e:
            kind = peer_failure_kind(e)
            if kind is None:
                raise
            raise PeerFailure(self.describe(kind, time.monotonic() - start), kind) from e
        finally:
            self.name = outer

    def describe(self, kind: str, seconds: float) -> str:
        what = "timed out" if kind == "timeout" else "lost a peer"
        where = f"rank {self.rank} {what} in phase {self.name} (step {self.step}) after " \
                f"{seconds:.1f} s"
        if kind == "timeout":
            return f"{where} waiting for a peer rank " \
                   f"(trainer.collective_timeout_s={self.timeout_s:g})"
        return f"{where}: another rank exited; its log says why"


def count_skipped_updates(metrics: dict[str, float], role: str, num_updates: int,
                          policy: str, step: int) -> int:
    """Optimizer updates of `role` this step that the non-finite guard dropped.

    metrics: the role's update metrics, averaged over its `num_updates` mini-batch updates
    (`{role}/stepped` is 1 for an applied update, 0 for a dropped one). Raises
    NonFiniteUpdate under policy 'abort' when any update was dropped or a loss is not finite.
    """
    stepped = metrics.get(f"{role}/stepped", 1.0)
    skipped = round((1.0 - stepped) * num_updates) if math.isfinite(stepped) else num_updates
    bad = {k: v for k, v in metrics.items()
           if k.startswith(f"{role}/") and not math.isfinite(v)}
    if policy == "abort" and (skipped or bad):
        shown = ", ".join(f"{k}={v}" for k, v in sorted(bad.items())[:3]) or \
            f"{role}/grad_norm not finite"
        raise NonFiniteUpdate(
            f"step {step}: non-finite {role} update ({shown}; {skipped} of {num_updates} "
            f"updates dropped); trainer.nan_policy=abort stops here (skip: drop and count them)")
    return skipped


def skipped_updates(metrics: dict[str, float], roles: dict, num_sequences: int, n: int,
                    policy: str, step: int, rank: int) -> int:
    """trainer.nan_policy on a step's updates: raises (abort) or counts (skip). roles: name ->
    its rl.roles role (None: absent); n: responses per prompt."""
    total = 0
    for name, role in roles.items():
        if role is None:
            continue
        mini = role.cfg.ppo_mini_batch_size * n      # sequences per optimizer update
        num_updates = math.ceil(num_sequences / mini) * role.cfg.ppo_epochs
        total += count_skipped_updates(metrics, name, num_updates, policy, step)
    if total and rank == 0:
        print(f"warning: step {step}: dropped {total} non-finite update(s) "
              f"(trainer.nan_policy=skip)", flush=True)
    return total


def inject_faults(step: int, rank: int, world_size: int) -> None:
    """Fault injection for the resume and timeout tests, read from the environment.

    HYBRIDENGINE_KILL_AT_STEP=N: rank 0 SIGKILLs itself at the start of step N, in the first
        attempt only (torchrun's TORCHELASTIC_RESTART_COUNT is 0 or unset), so a group that
        torchrun restarts resumes from its checkpoint and runs through.
    HYBRIDENGINE_HANG_AT_STEP=N: the last rank stops responding at the start of step N (it
        sleeps until killed): the others' collectives time out.
    """
    if os.environ.get("HYBRIDENGINE_KILL_AT_STEP") == str(step) and rank == 0 \
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get("HYBRIDENGINE_HANG_AT_STEP") == str(step) and rank == world_size - 1:
        while True:
            time.sleep(3600)


# ----------------------------------------------------------------------------- saying it once

TRACEBACK_ENV = "HYBRIDENGINE_TRACEBACK"
# A rank that leaves the report to another, or that lost a peer which has exited, waits this
# long before it exits, so that under torchrun the rank that spoke (or died) ends first and is
# the root cause of torchrun's summary (torchrun stops the waiting ranks as soon as one exits).
_DEFER_S = 10.0


def defer_exit_under_torchrun() -> None:
    """Wait _DEFER_S when torchrun watches this rank (it then stops it sooner)."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        time.sleep(_DEFER_S)


def traceback_wanted() -> bool:
    """HYBRIDENGINE_TRACEBACK=1, true or yes shows tracebacks; unset, 0 or anything else not."""
    return os.environ.get(TRACEBACK_ENV, "").strip().lower() in ("1", "true", "yes")


def report_failure(message: str, code: int, rank: int, details: str | None = None,
                   own: bool = False) -> bool:
    """Say `message` as `error: <line>` lines on stderr once for the whole job; True when this
    rank said it. Before the process group exists every rank has read the same argv and files,
    so rank 0 speaks; after, the first rank to count the message in the group's store does (a
    failure only one rank met is said by that rank). `own`: a failure of this rank alone
    (PeerFailure names it), always said. `details` (a traceback) goes before the line.

    Under torchrun the speaker also writes the message to TORCHELASTIC_ERROR_FILE, so torchrun's
    summary shows it (and `exitcode: <code>`) instead of "To enable traceback see ..."; a silent
    rank waits a little before it exits, so the speaker is torchrun's first observed failure."""
    if own or _first_to_say(message, rank):
        if details:
            print(details.rstrip("\n"), file=sys.stderr)
        for line in message.splitlines() or [""]:
            print(f"error: {line}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        _record_for_torchrun(message, code, details)
        return True
    defer_exit_under_torchrun()
    _record_for_torchrun(message, code, details)
    return False


def _first_to_say(message: str, rank: int) -> bool:
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return rank == 0
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(datetime.timedelta(seconds=5))    # the store's host may be gone
        key = "hybridengine/said/" + hashlib.sha1(message.encode()).hexdigest()[:16]
        return store.add(key, 1) == 1
    except Exception:  # noqa: BLE001 - no store to ask: better said twice than never
        return True


def _record_for_torchrun(message: str, code: int, details: str | None) -> None:
    """torchrun's error file (torch.distributed.elastic ErrorHandler's JSON layout): its summary
    prints extraInfo.py_callstack as the failure's "traceback"."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    record = {"message": {"message": message, "errorCode": code,
                          "extraInfo": {"py_callstack": details or message,
                                        "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(record, f)
    except OSError:
        pass                                    # the summary then says less; the line was said
