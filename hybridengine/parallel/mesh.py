"""Process groups of the layouts in parallel.layout, built once per run.

`build_meshes(run_layout)` builds every group a run needs, on every rank in the same order (group
creation is collective): each role's tp/cp/dp/dp-cp/pp/mp/ep/expert-dp groups (roles of one shape share
them), the tied-embedding groups of a pipeline, and the generation layout's gen-TP and micro-DP
groups. The launcher builds the bundle and hands it down; the library never builds groups of its
own and never calls a collective on the default group (STYLE rule 1: groups are objects passed
down explicitly, nothing here is a module-level global). `Meshes.world` is the group of all ranks
that the run's own collectives (run-directory checks, checkpoint barriers, gathering rollouts)
use.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import re
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hybridengine.parallel.layout import GenLayout, Layout, RunLayout


@dataclass
class ParallelMesh:
    """One process's view of a layout: its coordinates and its process groups.

    Built collectively by `build_mesh` (every rank must build every mesh in the same order). On a
    single process all groups are None and every collective in the package is skipped.
    """

    layout: Layout
    rank: int
    tp_group: object = None
    pp_group: object = None
    dp_group: object = None               # different micro-batches: metrics, rollouts
    cp_group: object = None               # the tokens of the same micro-batches
    dp_cp_group: object = None            # every replica of this shard: gradients, ZeRO
    ep_group: object = None               # replicas sharing out the experts: token all-to-all
    edp_group: object = None              # every replica of this expert shard: its gradients
    mp_group: object = None
    embedding_group: object = None        # first + last stage (pp > 1): a tied embedding's copies
    world_group: object = None            # every rank of the layout: barriers, whole-run gathers
    pp_ranks: list[int] = field(default_factory=list)
    dp_ranks: list[int] = field(default_factory=list)
    tp_ranks: list[int] = field(default_factory=list)

    @property
    def coords(self) -> tuple[int, int, int]:
        return self.layout.coords(self.rank)

    @property
    def pp_rank(self) -> int:
        return self.coords[0]

    @property
    def dp_rank(self) -> int:
        return self.coords[1]

    @property
    def tp_rank(self) -> int:
        return self.coords[2]

    @property
    def cp_rank(self) -> int:
        return self.layout.cp_rank(self.rank)

    @property
    def ep_rank(self) -> int:
        return self.layout.ep_rank(self.rank)

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def ep(self) -> int:
        return self.layout.ep

    @property
    def cp(self) -> int:
        return self.layout.cp

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1


def _my_group(groups: list[list[int]], rank: int, timeout) -> tuple[object, list[int]]:
    """Create every group (collective call on all ranks) and return the one holding `rank`."""
    mine, mine_ranks = None, [rank]
    for ranks in groups:
        g = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
        if rank in ranks:
            mine, mine_ranks = g, ranks
    return mine, mine_ranks


def _whole_world(world_size: int):
    """The group of every rank: a layout covers the whole world (check_world_size), so that is
    the default group, named here once and passed down from here as an object."""
    return dist.group.WORLD if world_size > 1 else None


def group_timeout(timeout_s: float | None) -> datetime.timedelta | None:
    """timeout_s, else the default group's timeout (init_distributed's timeout_s).

    torch gives a new group 30 minutes whatever the default group has; inheriting keeps
    trainer.collective_timeout_s the bound on every collective, so a hung peer surfaces as a
    timeout in minutes rather than half an hour. (Read through the backend's options: torch has
    no public getter; None, i.e. torch's default, if that ever moves.)
    """
    if timeout_s:
        return datetime.timedelta(seconds=timeout_s)
    world = dist.group.WORLD
    for device in getattr(world, "_device_types", ()):
        try:
            return world._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return None


def build_mesh(layout: Layout, timeout_s: float | None = None) -> ParallelMesh:
    """Build the process groups of a training layout on the initialised default process group."""
    if not dist.is_initialized():
        layout.check_world_size(1)
        return ParallelMesh(layout, 0)
    world, rank = dist.get_world_size(), dist.get_rank()
    layout.check_world_size(world)
    timeout = group_timeout(timeout_s)
    mesh = ParallelMesh(layout, rank, world_group=_whole_world(world))
    mesh.tp_group, mesh.tp_ranks = _my_group(layout.tp_groups(), rank, timeout)
    mesh.dp_group, mesh.dp_ranks = _my_group(layout.dp_groups(), rank, timeout)
    mesh.cp_group, _ = _my_group(layout.cp_groups(), rank, timeout)
    mesh.dp_cp_group = mesh.dp_group if layout.cp == 1 else \
        _my_group(layout.dp_cp_groups(), rank, timeout)[0]
    if layout.ep > 1:       # else experts are replicated like every other weight
        mesh.ep_group, _ = _my_group(layout.ep_groups(), rank, timeout)
        mesh.edp_group, _ = _my_group(layout.edp_groups(), rank, timeout)
    mesh.pp_group, mesh.pp_ranks = _my_group(layout.pp_groups(), rank, timeout)
    mesh.mp_group, _ = _my_group(layout.mp_groups(), rank, timeout)
    mesh.embedding_group, _ = _my_group(layout.embedding_groups(), rank, timeout)
    return mesh


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def _first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list: 'gpu[03-05,7],cpu1' -> 'gpu03'."""
    m = re.match(r"([^\[,]+)(\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise ValueError(f"cannot parse SLURM_JOB_NODELIST={nodelist!r}")
    prefix, ranges = m.group(1), m.group(3)
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def read_dist_env(env: dict | None = None) -> DistEnv:
    """Rank facts from torchrun's variables, else SLURM's (srun one task per device), else 1 rank."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                       env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", 29500)))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "127.0.0.1"
        addr = env.get("MASTER_ADDR") or _first_slurm_host(nodelist)
        job = int(env.get("SLURM_JOB_ID", "0"))
        port = int(env.get("MASTER_PORT", 20000 + job % 10000))
        return DistEnv(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]),
                       int(env.get("SLURM_LOCALID", 0)), addr, port)
    return DistEnv(0, 1, 0, "127.0.0.1", 29500)


def init_distributed(timeout_s: float = 1800.0, env: dict | None = None) -> DistEnv:
    """Initialise the default process group: nccl with CUDA (one device per local rank), else gloo.

    Returns the DistEnv. A single process without launcher variables runs without a process group.
    """
    de = read_dist_env(env)
    if de.world_size == 1 and "RANK" not in (env or os.environ):
        return de
    if dist.is_initialized():
        return de
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(de.local_rank % torch.cuda.device_count())
    dist.init_process_group(
        backend="nccl" if use_cuda else "gloo",
        init_method=f"tcp://{de.master_addr}:{de.master_port}",
        rank=de.rank, world_size=de.world_size,
        timeout=datetime.timedelta(seconds=timeout_s))
    return de


@dataclass
class GenMesh:
    """One process's view of the generation layout (t_g, p_g = 1): its gen-TP and micro-DP groups.

    `micro_dp_ranks` is sorted by global rank because torch.distributed numbers a group's members
    that way: it is the chunk order of an all-gather in `micro_dp_group`. With pp > 1 this differs
    from GenLayout's micro_dp_rank (m mod s), which only enumerates the generation replicas.
    `gen_tp_ranks` is in gen-TP rank order (which is also global-rank order).
    """

    gen_layout: GenLayout
    rank: int
    gen_tp_group: object = None
    micro_dp_group: object = None
    world_group: object = None
    gen_tp_ranks: list[int] = field(default_factory=list)
    micro_dp_ranks: list[int] = field(default_factory=list)

    @property
    def coords(self) -> tuple[int, int, int]:
        return self.gen_layout.coords(self.rank)

    @property
    def gen_dp_rank(self) -> int:
        return self.coords[0]

    @property
    def gen_tp_rank(self) -> int:
        return self.coords[1]

    @property
    def micro_dp_rank(self) -> int:
        return self.coords[2]

    @property
    def gen_tp(self) -> int:
        return self.gen_layout.tp

    @property
    def gen_dp(self) -> int:
        return self.gen_layout.dp


def build_gen_mesh(gen: GenLayout, timeout_s: float | None = None) -> GenMesh:
    """Build the generation-layout groups (collective on every rank)."""
    layout = gen.train
    if not dist.is_initialized():
        layout.check_world_size(1)
        return GenMesh(gen, 0, gen_tp_ranks=[0], micro_dp_ranks=[0])
    world, rank = dist.get_world_size(), dist.get_rank()
    layout.check_world_size(world)
    timeout = group_timeout(timeout_s)
    mesh = GenMesh(gen, rank, world_group=_whole_world(world))
    mesh.gen_tp_group, mesh.gen_tp_ranks = _my_group(gen.gen_tp_groups(), rank, timeout)
    mesh.micro_dp_group, ranks = _my_group(gen.micro_dp_groups(), rank, timeout)
    mesh.micro_dp_ranks = sorted(ranks)
    return mesh


@dataclass
class Meshes:
    """Every process group of a run, built once by `build_meshes` (the launcher's job)."""

    layout: RunLayout
    actor: ParallelMesh
    gen: GenMesh
    ref: ParallelMesh | None = None
    critic: ParallelMesh | None = None

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def rank(self) -> int:
        return self.actor.rank

    @property
    def world(self):
        """The group of all ranks (None on one process)."""
        return self.actor.world_group


def build_meshes(layout: RunLayout, timeout_s: float | None = None) -> Meshes:
    """Build the groups of every role's layout and of the generation layout (collective: every
    rank calls it, with the same layout). Roles of one (tp, pp, dp, cp, ep) shape share their
    groups."""
    by_shape: dict[tuple[int, ...], ParallelMesh] = {}
    roles = {}
    for name, lay in layout.roles().items():
        if lay.shape not in by_shape:
            by_shape[lay.shape] = build_mesh(lay, timeout_s)
        shared = by_shape[lay.shape]
        roles[name] = shared if shared.layout == lay else \
            dataclasses.replace(shared, layout=lay)   # same groups, its own sp / CP attention
    gen = build_gen_mesh(layout.rollout, timeout_s)
    return Meshes(layout, roles["actor"], gen, roles.get("ref"), roles.get("critic"))
