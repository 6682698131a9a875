"""Process layouts: which rank holds which shard, in training and in generation. Torch-free.

A training layout is (tp, cp, dp, pp) on N = tp·cp·dp·pp ranks in Megatron order: tensor-parallel
rank fastest, then context-parallel, then data-parallel, then pipeline-parallel,

    rank = ((pp_rank · dp + dp_rank) · cp + cp_rank) · tp + tp_rank.

Context-parallel (CP) ranks split the tokens of the same micro-batches and hold the same weights:
for gradients, the optimizer and the generation layout they are data-parallel ranks, so a model
replica is a (dp_rank, cp_rank) pair, `replica = dp_rank · cp + cp_rank`, and the rank formula is
the cp = 1 formula over dp·cp replicas.

Expert parallelism (EP, Megatron-core's) is carved out of those replicas: runs of `ep`
consecutive replicas form an EP group, `ep_rank = replica mod ep`, and EP rank r holds experts
[r·E/ep, (r+1)·E/ep) of every MoE layer (models.moe); everything else stays replicated over the
EP group (plain data parallelism there). An expert's replicas are the dp·cp/ep replicas of one
ep_rank: its expert-data-parallel group, over which its gradients are reduced.

The generation layout of the HybridEngine (HybridFlow §5, arXiv 2409.19256) is derived from the
actor's training layout and a generation TP degree t_g (p_g = 1): d_g = t·p / t_g generation
replicas per model replica. Inside one model replica (the t·p ranks sharing a dp_rank),
generation-TP groups take ranks at stride t/t_g (within a pipeline stage) and p (across stages),
and micro-DP groups are runs of consecutive ranks. Each micro-DP group all-gathers exactly the
shard its generation-TP rank needs (see hybridengine.hybrid.reshard).

`RunLayout` is the whole run's: one training layout per role the algorithm uses and the
generation layout. The config layer builds it once (config.checks.derive_layout) and every other
module reads it; the checks of a layout live here, in the constructors, and nowhere else. Their
errors name the config keys, since the user wrote those. parallel.mesh builds the process groups
of a layout.
"""
from __future__ import annotations

from dataclasses import dataclass

_ROLLOUT_TP = "actor_rollout_ref.rollout.tensor_model_parallel_size"
# how attention spans a CP group (parallel.context): the key that asked for CP chooses it
CP_ATTENTION = ("ulysses", "allgather", "ring")
# megatron.cp_comm_type (Megatron's name and values) -> the attention of context_parallel_size
CP_COMM_TYPES = {"all_gather": "allgather", "p2p": "ring"}


@dataclass(frozen=True)
class Layout:
    """A (tp, pp, dp, cp) training layout and its rank arithmetic. `sequence_parallel` is the
    effective switch: asked for and tp > 1 (Megatron's sequence parallelism splits the TP
    region's activations, so it means nothing at tp = 1). `cp_attention` (CP_ATTENTION) is how
    attention spans the CP group; it means nothing at cp = 1."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    cp: int = 1
    cp_attention: str = "allgather"
    ep: int = 1

    def __post_init__(self):
        for name in ("tp", "pp", "dp", "cp", "ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"layout {name}={getattr(self, name)} must be >= 1")
        if self.cp_attention not in CP_ATTENTION:
            raise ValueError(f"context-parallel attention {self.cp_attention!r} is not one of "
                             f"{CP_ATTENTION}")
        if self.num_replicas % self.ep:
            raise ValueError(f"expert_model_parallel_size={self.ep} must divide the data-"
                             f"parallel x context-parallel size {self.dp}*{self.cp}: EP groups "
                             f"are carved out of the model replicas")
        if self.sequence_parallel and self.tp == 1:
            object.__setattr__(self, "sequence_parallel", False)

    @classmethod
    def of_world(cls, tp: int, pp: int, world_size: int, sequence_parallel: bool = False,
                 section: str = "layout", cp: int = 1, cp_attention: str = "allgather",
                 cp_key: str = "context_parallel_size", ep: int = 1) -> "Layout":
        """The layout whose dp fills `world_size`; `section` and `cp_key` name the config keys
        in the error."""
        if tp < 1 or pp < 1 or cp < 1 or world_size % (tp * pp * cp):
            with_cp = (f" * {cp_key}", f"*{cp}") if cp != 1 else ("", "")
            raise ValueError(
                f"{section}.tensor_model_parallel_size * pipeline_model_parallel_size"
                f"{with_cp[0]} = {tp}*{pp}{with_cp[1]} must be positive and divide the world "
                f"size {world_size}")
        dp = world_size // (tp * pp * cp)
        if ep < 1 or (dp * cp) % ep:
            raise ValueError(f"{section}.expert_model_parallel_size={ep} must be positive and "
                             f"divide the data-parallel x context-parallel size {dp}*{cp} (EP "
                             f"ranks are carved out of the data-parallel ranks)")
        return cls(tp, pp, dp, sequence_parallel, cp, cp_attention, ep)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def num_replicas(self) -> int:
        """Model replicas (every rank of one holds a different shard): dp·cp."""
        return self.dp * self.cp

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """(tp, pp, dp, cp, ep): layouts of one shape share their process groups."""
        return self.tp, self.pp, self.dp, self.cp, self.ep

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: the replicas of one expert, dp·cp/ep."""
        return self.num_replicas // self.ep

    def rank(self, pp_rank: int, dp_rank: int, tp_rank: int, cp_rank: int = 0) -> int:
        return ((pp_rank * self.dp + dp_rank) * self.cp + cp_rank) * self.tp + tp_rank

    def replica_rank(self, pp_rank: int, replica: int, tp_rank: int) -> int:
        """The rank of (pp_rank, tp_rank) in model replica `replica` = dp_rank·cp + cp_rank."""
        return (pp_rank * self.num_replicas + replica) * self.tp + tp_rank

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_rank, dp_rank, tp_rank) of a global rank (its cp_rank: `cp_rank`)."""
        replica = (rank // self.tp) % self.num_replicas
        return rank // (self.num_replicas * self.tp), replica // self.cp, rank % self.tp

    def cp_rank(self, rank: int) -> int:
        return (rank // self.tp) % self.cp

    def ep_rank(self, rank: int) -> int:
        """The rank in its EP group: its replica (dp_rank·cp + cp_rank) mod ep."""
        return (rank // self.tp) % self.num_replicas % self.ep

    def _groups(self, inner: str) -> list[list[int]]:
        """The ranks that differ only in the coordinates named in `inner` (of "pdctex":
        pipeline, data, context, tensor; or, in place of d and c, the replica's EP rank e and
        expert-data-parallel rank x), a group per value of the other coordinates, in rank
        order."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            pp_rank, dp_rank, tp_rank = self.coords(rank)
            replica = dp_rank * self.cp + self.cp_rank(rank)
            at = {"p": pp_rank, "t": tp_rank}
            at.update({"e": replica % self.ep, "x": replica // self.ep} if set(inner) & set("ex")
                      else {"d": dp_rank, "c": self.cp_rank(rank)})
            groups.setdefault(tuple(v for k, v in at.items() if k not in inner), []).append(rank)
        return list(groups.values())

    def tp_groups(self) -> list[list[int]]:
        return self._groups("t")

    def cp_groups(self) -> list[list[int]]:
        """The ranks splitting the tokens of the same micro-batches."""
        return self._groups("c")

    def dp_groups(self) -> list[list[int]]:
        """The ranks given different micro-batches (metrics and rollouts are shared over it)."""
        return self._groups("d")

    def dp_cp_groups(self) -> list[list[int]]:
        """Every replica of one shard: gradients are reduced and ZeRO shards spread over it."""
        return self._groups("dc")

    def ep_groups(self) -> list[list[int]]:
        """The replicas sharing out the experts (token all-to-all inside)."""
        return self._groups("e")

    def edp_groups(self) -> list[list[int]]:
        """Every replica of one expert shard: expert gradients are reduced over it."""
        return self._groups("x")

    def pp_groups(self) -> list[list[int]]:
        return self._groups("p")

    def mp_groups(self) -> list[list[int]]:
        """Model-parallel groups (all tp·pp ranks of one replica): grad-norm reductions."""
        return self._groups("pt")

    def embedding_groups(self) -> list[list[int]]:
        """The first and last stage of each (dp, cp, tp) pipeline: where the two copies of a
        tied embedding live (their gradients are summed). Empty without pipeline parallelism."""
        if self.pp == 1:
            return []
        return [[g[0], g[-1]] for g in self.pp_groups()]

    def check_world_size(self, world_size: int) -> None:
        if world_size != self.world_size:
            names, sizes = ("tp*pp*dp*cp", (self.tp, self.pp, self.dp, self.cp)) if self.cp > 1 \
                else ("tp*pp*dp", (self.tp, self.pp, self.dp))
            raise ValueError(
                f"world size {world_size} != {names} = {'*'.join(map(str, sizes))} = "
                f"{self.world_size}; change the parallel sizes or the number of processes")


@dataclass(frozen=True)
class GenLayout:
    """The generation layout (t_g, p_g = 1, d_g = t·p/t_g per training replica) of a Layout.
    A training replica is a (dp_rank, cp_rank) pair: CP ranks hold whole replicas of the weights.

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
        t, p = self.train.tp, self.train.pp
        if self.tp < 1 or (t * p) % self.tp:
            raise ValueError(f"{_ROLLOUT_TP}={self.tp} must divide actor tp*pp = {t}*{p}: the "
                             f"generation layout has d_g = tp*pp/t_g replicas per training replica")
        if t % self.tp:
            # HybridFlow allows t_g <= t·p (micro-DP t·p/t_g); the reshard plan builds a
            # generation shard from whole training TP shards of every stage, so t_g | t
            raise ValueError(f"{_ROLLOUT_TP}={self.tp} must divide actor "
                             f"tensor_model_parallel_size={t} (a generation TP shard is made of "
                             f"whole training TP shards; pipeline stages are not split across it)")

    @property
    def micro_dp(self) -> int:
        """d_g = t·p / t_g: generation replicas inside one training replica."""
        return self.train.tp * self.train.pp // self.tp

    @property
    def dp(self) -> int:
        """Generation data-parallel degree over the whole world."""
        return self.train.num_replicas * self.micro_dp

    @property
    def world_size(self) -> int:
        return self.train.world_size

    def _replica_ranks(self, replica: int) -> list[int]:
        t, p = self.train.tp, self.train.pp
        return [self.train.replica_rank(m % p, replica, m // p) for m in range(t * p)]

    def gen_tp_groups(self) -> list[list[int]]:
        s, groups = self.micro_dp, []
        for d in range(self.train.num_replicas):
            ranks = self._replica_ranks(d)
            groups += [[ranks[j * s + i] for j in range(self.tp)] for i in range(s)]
        return groups

    def micro_dp_groups(self) -> list[list[int]]:
        s, groups = self.micro_dp, []
        for d in range(self.train.num_replicas):
            ranks = self._replica_ranks(d)
            groups += [ranks[j * s:(j + 1) * s] for j in range(self.tp)]
        return groups

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(gen_dp_rank, gen_tp_rank, micro_dp_rank) of a global rank."""
        pp_rank, dp_rank, tp_rank = self.train.coords(rank)
        replica = dp_rank * self.train.cp + self.train.cp_rank(rank)
        m = tp_rank * self.train.pp + pp_rank
        s = self.micro_dp
        return replica * s + m % s, m // s, m % s


@dataclass(frozen=True)
class RunLayout:
    """The layouts of a run: the actor's, the reference's and the critic's (None for a role the
    algorithm does not use), and the generation layout derived from the actor's."""

    actor: Layout
    rollout: GenLayout
    ref: Layout | None = None
    critic: Layout | None = None

    def __post_init__(self):
        if self.rollout.train != self.actor:
            raise ValueError("the generation layout must derive from the actor's layout")
        for role in (self.ref, self.critic):
            if role is not None and role.world_size != self.actor.world_size:
                raise ValueError(f"every role's layout must cover the world of "
                                 f"{self.actor.world_size} ranks, not {role.world_size}")

    @property
    def world_size(self) -> int:
        return self.actor.world_size

    def roles(self) -> dict[str, Layout]:
        """The training layouts in use, by role name, in the order their groups are built."""
        return {name: lay for name, lay in (("actor", self.actor), ("ref", self.ref),
                                            ("critic", self.critic)) if lay is not None}
