"""Sharded, exact-resume checkpoints: every rank saves its own tensors, meta and RNG states.

Layout under `root` (verl's names):
    global_step_N/state/rank_00000.safetensors   this rank's tensors (params, optimizer state, ...)
    global_step_N/state/rank_00000.json          this rank's meta and RNG states (python `random`,
                                                 numpy, torch CPU and CUDA) as JSON lists
    global_step_N/<anything>                     other writers, e.g. the trainer's HF dirs actor/
    latest_checkpointed_iteration.txt            N; replaced atomically, after the rename

Protocol (collective over `group`, the ranks that save together, None for one process; `root`
must be one directory every rank sees):
    tmp = begin_checkpoint(root, N)    rank 0 deletes the global_step_*.tmp dirs of crashed saves
                                       and creates global_step_N.tmp/state/; barrier
    write_rank_state(tmp, tensors, meta)   every rank; anyone may add files under tmp meanwhile
    commit_checkpoint(root, N)         barrier; rank 0 renames global_step_N.tmp -> global_step_N
                                       (replacing an older one), then rewrites the pointer; barrier
`save_checkpoint` does all three. A crash at any point before the pointer is replaced leaves the
previous checkpoint as the latest one, intact. No pickle anywhere: safetensors and JSON only.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

LATEST = "latest_checkpointed_iteration.txt"
_STEP_DIR = re.compile(r"global_step_(\d+)")
_FORMAT = "hybridengine.checkpoint/1"


class CorruptCheckpoint(ValueError):
    """A checkpoint state file that cannot be read back (truncated, damaged); names the file."""

    def __init__(self, file: Path, reason: str):
        super().__init__(f"corrupt checkpoint file {file}: {reason}")
        self.file = file


def checkpoint_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"global_step_{step}"


def _tmp_dir(root, step: int) -> Path:
    return Path(root) / f"global_step_{step}.tmp"


def _old_dir(root, step: int) -> Path:
    return Path(root) / f"global_step_{step}.old"


def _existing_dir(root, step: int) -> Path:
    """global_step_N, or its .old copy when a re-save of N crashed between its two renames."""
    final = checkpoint_dir(root, step)
    return final if final.is_dir() or not _old_dir(root, step).is_dir() else _old_dir(root, step)


def _rank_world(group) -> tuple[int, int]:
    """This rank and the number of ranks in `group` (the ranks that save together; None: this
    process alone)."""
    if group is None:
        if dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError("checkpoint: a run of several ranks must pass the group of the "
                             "ranks that save together")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _barrier(group) -> None:
    if group is not None:
        dist.barrier(group=group)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- RNG states ---------------------------------------------------------------------------------

def capture_rng() -> dict:
    """RNG states of python `random`, numpy's global generator, torch CPU and (if used) CUDA."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [version, list(internal), gauss],
             "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
             "torch_cpu": torch.get_rng_state().tolist()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def restore_rng(state: dict) -> None:
    """Inverse of capture_rng (the CUDA state goes to the current device)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch_cpu"], dtype=torch.uint8))
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["torch_cuda"], dtype=torch.uint8))


# --- save ---------------------------------------------------------------------------------------

def begin_checkpoint(root: str | os.PathLike, step: int, group=None) -> Path:
    """Start checkpoint `step` (collective): returns the temp dir every rank writes into."""
    root, tmp = Path(root), _tmp_dir(root, step)
    rank, _ = _rank_world(group)
    # Rank 0 deletes leftovers below; no rank may still be reading them (a load in progress, a
    # look at a crashed save) when it does.
    _barrier(group)
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("global_step_*.tmp"):      # left by a crashed save
            shutil.rmtree(stale)
        for old in root.glob("global_step_*.old"):        # a re-save crashed between renames
            final = root / old.name.removesuffix(".old")
            if final.exists():
                shutil.rmtree(old)
            else:
                os.replace(old, final)
        (tmp / "state").mkdir(parents=True)
    _barrier(group)
    return tmp


def _cpu_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out, seen = {}, set()
    for name, t in tensors.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise ValueError(f"checkpoint tensors must map str to Tensor; got {name!r}: "
                             f"{type(t).__name__}")
        t = t.detach().cpu().contiguous()
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        out[name] = t.clone() if key in seen else t    # safetensors refuses aliased tensors
        seen.add(key)
    return out


def write_rank_state(ckpt_dir: str | os.PathLike, tensors: dict[str, torch.Tensor], meta: dict,
                     rng: bool = True, rank: int | None = None, group=None) -> None:
    """Write this rank's state/rank_R.safetensors and state/rank_R.json into `ckpt_dir`."""
    rank_now, world = _rank_world(group)
    rank = rank_now if rank is None else rank
    state = Path(ckpt_dir) / "state"
    record = {"format": _FORMAT, "rank": rank, "world_size": world, "meta": meta,
              "rng": capture_rng() if rng else None}
    try:
        text = json.dumps(record)       # before any file: bad meta leaves nothing half-written
    except (TypeError, ValueError) as e:
        raise ValueError(f"checkpoint meta is not JSON-serialisable: {e}") from e
    tensor_file = state / f"rank_{rank:05d}.safetensors"
    save_file(_cpu_tensors(tensors), str(tensor_file), metadata={"format": _FORMAT})
    with open(tensor_file, "rb") as f:
        os.fsync(f.fileno())
    with open(state / f"rank_{rank:05d}.json", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _write_pointer(root: Path, step: int) -> None:
    tmp = root / f".{LATEST}.tmp"
    with open(tmp, "w") as f:
        f.write(str(step))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    _fsync_dir(root)


def commit_checkpoint(root: str | os.PathLike, step: int, max_to_keep: int | None = None,
                      group=None) -> Path:
    """Publish checkpoint `step` (collective): rename the temp dir into place, then point `latest`
    at it. max_to_keep: delete all but the newest that many global_step_* dirs afterwards."""
    root, tmp, final = Path(root), _tmp_dir(root, step), checkpoint_dir(root, step)
    rank, world = _rank_world(group)
    _barrier(group)
    if rank == 0:
        missing = [r for r in range(world)
                   if not (tmp / "state" / f"rank_{r:05d}.json").is_file()]
        if missing:
            raise FileNotFoundError(f"checkpoint {tmp} lacks the state of ranks {missing}; "
                                    f"every rank must call write_rank_state before the commit")
        old = _old_dir(root, step)
        if final.exists():          # re-saving a step: keep the old copy until the rename
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(root)
        shutil.rmtree(old, ignore_errors=True)
        _write_pointer(root, step)
        if max_to_keep is not None and max_to_keep > 0:
            _prune(root, max_to_keep)
    _barrier(group)
    return final


def _prune(root: Path, max_to_keep: int) -> None:
    steps = sorted(int(m.group(1)) for p in root.iterdir()
                   if p.is_dir() and (m := _STEP_DIR.fullmatch(p.name)))
    for s in steps[:-max_to_keep]:
        shutil.rmtree(checkpoint_dir(root, s), ignore_errors=True)


def save_checkpoint(root: str | os.PathLike, step: int, per_rank_tensors: dict[str, torch.Tensor],
                    meta: dict, rng: bool = True, max_to_keep: int | None = None,
                    group=None) -> Path:
    """begin + write_rank_state + commit in one collective call. Returns global_step_N."""
    tmp = begin_checkpoint(root, step, group)
    write_rank_state(tmp, per_rank_tensors, meta, rng, group=group)
    return commit_checkpoint(root, step, max_to_keep, group)


# --- load ---------------------------------------------------------------------------------------

def earlier_checkpoint(root: str | os.PathLike, step: int) -> int | None:
    """The newest complete checkpoint step under `root` before `step` (None: none)."""
    root = Path(root)
    if not root.is_dir():
        return None
    steps = [int(m.group(1)) for p in root.iterdir()
             if (m := _STEP_DIR.fullmatch(p.name)) and (p / "state").is_dir()]
    return max((s for s in steps if s < step), default=None)


def find_latest(root: str | os.PathLike) -> int | None:
    """The step in root/latest_checkpointed_iteration.txt; None when there is no pointer."""
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    text = pointer.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{pointer} holds {text[:40]!r}, not a step number")
    step = int(text)
    if not (_existing_dir(root, step) / "state").is_dir():
        raise FileNotFoundError(f"{pointer} names step {step} but "
                                f"{checkpoint_dir(root, step) / 'state'} does not exist")
    return step


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint root (follow its pointer) or a global_step_N dir -> the global_step_N dir."""
    path = Path(path)
    if (path / LATEST).is_file():
        return _existing_dir(path, find_latest(path))
    if (path / "state").is_dir():
        return path
    raise FileNotFoundError(f"no checkpoint at {path}: neither {LATEST} nor a state/ directory")


def check_tensors(tensors: dict[str, torch.Tensor], like: dict, where: str) -> None:
    """One-line error on the first name or shape that differs between checkpoint and model.
    `like` maps names to tensors or shapes."""
    for name, ref in like.items():
        shape = tuple(ref.shape) if isinstance(ref, torch.Tensor) else tuple(ref)
        if name not in tensors:
            raise ValueError(f"{where}: tensor {name} {list(shape)} of the model is missing from "
                             f"the checkpoint")
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"{where}: tensor {name} has shape {list(tensors[name].shape)} in "
                             f"the checkpoint, {list(shape)} in the model")
    extra = [n for n in tensors if n not in like]
    if extra:
        raise ValueError(f"{where}: tensor {extra[0]} {list(tensors[extra[0]].shape)} of the "
                         f"checkpoint is not in the model")


def load_checkpoint(path: str | os.PathLike, rank: int | None = None, like: dict | None = None,
                    restore_rng_state: bool = True,
                    group=None) -> tuple[dict[str, torch.Tensor], dict]:
    """This rank's (tensors on CPU, meta) from a checkpoint root or a global_step_N dir.

    like: the model's {name: tensor or shape}; any difference raises one ValueError line.
    restore_rng_state: put the saved RNG states back (python, numpy, torch CPU/CUDA).
    """
    rank_now, world = _rank_world(group)
    rank = rank_now if rank is None else rank
    state = resolve_checkpoint(path) / "state"
    record_file = state / f"rank_{rank:05d}.json"
    tensor_file = state / f"rank_{rank:05d}.safetensors"
    if not record_file.is_file() or not tensor_file.is_file():
        raise FileNotFoundError(f"checkpoint {state} has no state for rank {rank}")
    try:
        record = json.loads(record_file.read_text())
    except ValueError as e:
        raise CorruptCheckpoint(record_file, str(e)) from e
    if record.get("format") != _FORMAT:
        raise ValueError(f"{record_file} has format {record.get('format')!r}, expected {_FORMAT}")
    if record["world_size"] != world:
        raise ValueError(f"checkpoint {state} was saved by {record['world_size']} ranks, this run "
                         f"has {world}: resume needs the same layout")
    try:
        tensors = load_file(str(tensor_file))
    except Exception as e:  # noqa: BLE001 - safetensors' own error type: a truncated file
        raise CorruptCheckpoint(tensor_file, str(e)) from e
    if like is not None:
        check_tensors(tensors, like, str(tensor_file))
    if restore_rng_state and record.get("rng"):
        restore_rng(record["rng"])
    return tensors, record["meta"]
