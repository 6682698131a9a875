"""Process layouts and their groups.

A training layout is (tp, pp, dp) on N = tp·pp·dp ranks in Megatron order: tensor-parallel rank
fastest, then data-parallel, then pipeline-parallel,

    rank = pp_rank · (dp·tp) + dp_rank · tp + tp_rank.

The generation layout of the HybridEngine (HybridFlow §5, arXiv 2409.19256) is derived from the
training layout and a generation TP degree t_g (p_g = 1): d_g = t·p / t_g generation replicas per
model replica. Inside one model replica (the t·p ranks sharing a dp_rank), generation-TP groups
take ranks at stride t/t_g (within a pipeline stage) and p (across stages), and micro-DP groups are
runs of consecutive ranks. Each micro-DP group all-gathers exactly the shard its generation-TP rank
needs (see hybridengine.hybrid.reshard).

Groups are objects passed down explicitly (STYLE rule 1): nothing here is a module-level global,
and no collective in the package uses the default group.
"""
from __future__ import annotations

import datetime
import os
import re
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Layout:
    """A (tp, pp, dp) training layout and its rank arithmetic."""

    tp: int = 1
    pp: int = 1
    dp: int = 1

    def __post_init__(self):
        for name in ("tp", "pp", "dp"):
            if getattr(self, name) < 1:
                raise ValueError(f"layout {name}={getattr(self, name)} must be >= 1")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def rank(self, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
        return (pp_rank * self.dp + dp_rank) * self.tp + tp_rank

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_rank, dp_rank, tp_rank) of a global rank."""
        return rank // (self.dp * self.tp), (rank // self.tp) % self.dp, rank % self.tp

    def tp_groups(self) -> list[list[int]]:
        return [[self.rank(p, d, t) for t in range(self.tp)]
                for p in range(self.pp) for d in range(self.dp)]

    def dp_groups(self) -> list[list[int]]:
        return [[self.rank(p, d, t) for d in range(self.dp)]
                for p in range(self.pp) for t in range(self.tp)]

    def pp_groups(self) -> list[list[int]]:
        return [[self.rank(p, d, t) for p in range(self.pp)]
                for d in range(self.dp) for t in range(self.tp)]

    def mp_groups(self) -> list[list[int]]:
        """Model-parallel groups (all tp·pp ranks of one replica): grad-norm reductions."""
        return [[self.rank(p, d, t) for p in range(self.pp) for t in range(self.tp)]
                for d in range(self.dp)]

    def check_world_size(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise ValueError(
                f"world size {world_size} != tp*pp*dp = {self.tp}*{self.pp}*{self.dp} = "
                f"{self.world_size}; change the parallel sizes or the number of processes")


@dataclass(frozen=True)
class GenLayout:
    """The generation layout (t_g, p_g = 1, d_g = t·p/t_g per training replica) of a Layout.

    Ranks of one training replica are indexed by m = tp_rank·p + pp_rank (pipeline fastest). A
    generation-TP group holds t_g ranks at stride s = t·p/t_g in m (HybridFlow Fig. 8), so one
    micro-DP group is the s consecutive m sharing m // s: training TP shards
    [j·t/t_g, (j+1)·t/t_g) of every pipeline stage, which together are exactly generation shard j.
    The generation-TP rank of m is m // s and its micro-DP rank m % s. With p = 1 this is the
    paper's "stride t/t_g, consecutive micro-DP ranks".
    """

    train: Layout
    tp: int

    def __post_init__(self):
        mp = self.train.tp * self.train.pp
        if self.tp < 1 or mp % self.tp != 0:
            raise ValueError(
                f"rollout tensor_model_parallel_size={self.tp} must divide actor tp*pp = {mp}")
        if self.train.tp % self.tp != 0:
            raise ValueError(f"rollout tensor_model_parallel_size={self.tp} must divide actor "
                             f"tensor_model_parallel_size={self.train.tp}")

    @property
    def micro_dp(self) -> int:
        return self.train.tp * self.train.pp // self.tp

    @property
    def dp(self) -> int:
        """Generation data-parallel degree over the whole world."""
        return self.train.dp * self.micro_dp

    def _replica_ranks(self, dp_rank: int) -> list[int]:
        t, p = self.train.tp, self.train.pp
        return [self.train.rank(m % p, dp_rank, m // p) for m in range(t * p)]

    def gen_tp_groups(self) -> list[list[int]]:
        s, groups = self.micro_dp, []
        for d in range(self.train.dp):
            ranks = self._replica_ranks(d)
            groups += [[ranks[j * s + i] for j in range(self.tp)] for i in range(s)]
        return groups

    def micro_dp_groups(self) -> list[list[int]]:
        s, groups = self.micro_dp, []
        for d in range(self.train.dp):
            ranks = self._replica_ranks(d)
            groups += [ranks[j * s:(j + 1) * s] for j in range(self.tp)]
        return groups

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(gen_dp_rank, gen_tp_rank, micro_dp_rank) of a global rank."""
        pp_rank, dp_rank, tp_rank = self.train.coords(rank)
        m = tp_rank * self.train.pp + pp_rank
        s = self.micro_dp
        return dp_rank * s + m % s, m // s, m % s


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
    dp_group: object = None
    mp_group: object = None
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
    def tp(self) -> int:
        return self.layout.tp

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
    mesh = ParallelMesh(layout, rank)
    mesh.tp_group, mesh.tp_ranks = _my_group(layout.tp_groups(), rank, timeout)
    mesh.dp_group, mesh.dp_ranks = _my_group(layout.dp_groups(), rank, timeout)
    mesh.pp_group, mesh.pp_ranks = _my_group(layout.pp_groups(), rank, timeout)
    mesh.mp_group, _ = _my_group(layout.mp_groups(), rank, timeout)
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


def build_gen_mesh(layout: Layout, gen_tp: int, timeout_s: float | None = None) -> GenMesh:
    """Build the generation-layout groups of a training layout (collective on every rank)."""
    gen = GenLayout(layout, gen_tp)
    if not dist.is_initialized():
        layout.check_world_size(1)
        return GenMesh(gen, 0, gen_tp_ranks=[0], micro_dp_ranks=[0])
    world, rank = dist.get_world_size(), dist.get_rank()
    layout.check_world_size(world)
    timeout = group_timeout(timeout_s)
    mesh = GenMesh(gen, rank)
    mesh.gen_tp_group, mesh.gen_tp_ranks = _my_group(gen.gen_tp_groups(), rank, timeout)
    mesh.micro_dp_group, ranks = _my_group(gen.micro_dp_groups(), rank, timeout)
    mesh.micro_dp_ranks = sorted(ranks)
    return mesh
