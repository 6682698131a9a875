"""The 3D-HybridEngine: switch the actor between its training shard and its generation shard.

    engine = HybridEngine(cfg, train_mesh, build_gen_mesh(GenLayout(layout, t_g)), bucket_mb=256)
    gen = engine.to_generation(actor)     # a Decoder: gen-TP group, pp = 1, no sequence parallel
    ... rollout on `gen` (the caller frees its KV cache) ...
    engine.to_training()                  # generation-only memory released; `gen` is emptied
    metrics.update(engine.pop_metrics())  # timing_s/reshard, reshard/bytes_per_rank, ...

to_generation executes this rank's compiled plan (hybrid.plan, hybrid.program): a generation
weight equal to a training parameter is that parameter (zero-copy: nothing else happens when
t_g = t and p = 1); the others live in one flat arena, filled by local copies of intervals every
group member holds and by all-gathers inside the micro-DP group (the model-parallel group in
naive mode), one per bucket. A direct bucket (a section the members hold as consecutive whole
rows: q, k, v, gate, up, the vocabulary, when p = 1) gathers from the training parameters
straight into the arena, no copy on either side; their gathers go in coalesced groups of about
a bucket's size (one NCCL launch per group: tens of 4-70 MB gathers one by one ran at 70% of
the bandwidth of one large gather on two H200s). The other
buckets are flat, in the rollout dtype, packed and unpacked by copies; two rotate: bucket b+1 is
packed and its all-gather issued before bucket b is unpacked, so on GPU the copies run under
the communication, and at most two buffers exist at a time.

The training model is never written: the switch cannot disturb training. The generation Decoder
is the same object at every switch; its weights are valid until to_training(), which points
them at empty meta tensors and frees the arena (anything holding device pointers into them,
e.g. a captured CUDA graph, must be rebuilt after the next to_generation), unless
keep_weights=True: then the arena and buckets stay allocated and every switch refills them at
the same addresses. A zero-copy generation model (t_g = t, p = 1: training parameters only)
frees nothing by releasing, so it keeps its weights either way.

A LoRA actor moves merged weights W + s·B·A (models.lora.base_weights), except with t_g < t
and p = 1: then the base's generation shard moves once and only adapters after it
(hybrid.lora_switch).

Optional hooks: `offload()` runs first in to_generation (e.g. move optimizer state and gradients
to CPU, making room for buckets and KV cache; it must leave the training parameters in place, as
the gather reads them and a zero-copy generation model uses them); `reload()` runs last in
to_training.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.profiler import record_function

from hybridengine.models.lora import adapted_layers, base_weights
from hybridengine.hybrid.experts import ExpertGather
from hybridengine.hybrid.gen_model import assign_weights, build_gen_decoder, release_weights
from hybridengine.hybrid.lora_switch import frozen_base, gather_adapters, \
    merge_generation_weight
from hybridengine.hybrid.plan import MODES, ReshardPlan, max_received_numel, plan_reshard
from hybridengine.hybrid.program import ALIGN_BYTES, Copies, Program, compile_program, \
    new_arena, rect, weight_views
from hybridengine.hybrid.report import Stats, SwitchReport, peak_memory_gb, start_clock, \
    switch_metrics, timed
from hybridengine.models.decoder import Decoder, ModelConfig
from hybridengine.models.moe import expert_views
from hybridengine.parallel import tensor as ptensor
from hybridengine.parallel.mesh import GenMesh, ParallelMesh


@dataclass
class _Store:
    """Memory of the generation side: the arena of generation weights, two rotating gathered
    buckets, naive mode's second arena, and the copies bound to them (`key`: the training
    parameters' addresses they were bound with), all for one Program. Dropped by to_training
    unless kept."""

    program: Program | None = None
    arena: torch.Tensor | None = None
    gen_arena: torch.Tensor | None = None
    buffers: list[torch.Tensor] = field(default_factory=list)
    key: tuple | None = None
    bound: tuple | None = None


class HybridEngine:
    """Reshards one actor between its training layout and its generation layout.

    keep_weights=True keeps the generation weights (and two buckets) allocated between switches,
    M/t_g of memory during training: each switch refills them in place, so their addresses never
    change (a rollout engine's CUDA graphs stay valid), and the copies stay bound, so a switch
    costs a few kernel launches per bucket. direct_min_mb: sections of at least this many MB per
    member (rollout dtype) become direct buckets; None turns them off (only flat buckets).
    """

    def __init__(self, cfg: ModelConfig, train_mesh: ParallelMesh, gen_mesh: GenMesh, *,
                 mode: str = "zero_redundancy", bucket_mb: float = 256.0,
                 dtype: torch.dtype | None = None, keep_weights: bool = False,
                 direct_min_mb: float | None = 4.0,
                 offload: Callable[[], None] | None = None,
                 reload: Callable[[], None] | None = None):
        if mode not in MODES:
            raise ValueError(f"trainer.hybrid_engine.reshard_mode={mode!r} is not one of {MODES}")
        if not bucket_mb > 0:
            raise ValueError(f"trainer.hybrid_engine.reshard_bucket_mb={bucket_mb} must be > 0")
        if gen_mesh.gen_layout.train.shape != train_mesh.layout.shape or gen_mesh.rank != train_mesh.rank:
            raise ValueError(f"generation mesh of {gen_mesh.gen_layout.train} (rank "
                             f"{gen_mesh.rank}) does not belong to the training mesh of "
                             f"{train_mesh.layout} (rank {train_mesh.rank})")
        self.cfg, self.train_mesh, self.gen_mesh = cfg, train_mesh, gen_mesh
        self.mode, self.bucket_mb, self.dtype = mode, bucket_mb, dtype
        self.direct_min_mb = direct_min_mb
        self.keep_weights, self.offload, self.reload = keep_weights, offload, reload
        # Naive mode gathers the full model over the model-parallel group (DS-Chat / verl).
        self.group = gen_mesh.micro_dp_group if mode == "zero_redundancy" else train_mesh.mp_group
        self.model: Decoder | None = None
        self.reports: list[SwitchReport] = []
        self._plans: dict[torch.dtype, tuple] = {}
        self._programs: dict[tuple, Program] = {}
        self._store = _Store()
        self._active = False
        # LoRA with t_g < t, p = 1 (hybrid.lora_switch): the base's generation shard, gathered
        # once per program, and the merged weights of the last switch (kept with keep_weights)
        self._lora_base: tuple[Program, dict[str, torch.Tensor]] | None = None
        self._lora_merged: dict[str, torch.Tensor] = {}
        self._lora_names: list[str] = []
        # expert parallelism: every expert of the EP group first (hybrid.experts)
        self._experts = ExpertGather(train_mesh.ep_group) if train_mesh.ep > 1 else None

    def plan(self, dtype: torch.dtype) -> tuple[ReshardPlan, int]:
        """(plan of this rank's group, this rank's member index) for a rollout dtype (cached)."""
        if dtype not in self._plans:
            elsize = torch.empty((), dtype=dtype).element_size()
            direct = None if self.direct_min_mb is None else \
                int(self.direct_min_mb * 2**20) // elsize
            kw = dict(mode=self.mode, max_bucket_numel=int(self.bucket_mb * 2**20) // elsize,
                      direct_min_numel=direct)
            gm = self.gen_mesh
            plan = plan_reshard(self.cfg, gm.gen_layout, gm.gen_tp_rank, **kw)
            me = plan.member_index(self.train_mesh.pp_rank, self.train_mesh.tp_rank)
            busiest = max_received_numel(self.cfg, gm.gen_layout, **kw) * elsize
            self._plans[dtype] = (plan, me, busiest)
        return self._plans[dtype][:2]

    def _program(self, params: dict[str, torch.Tensor], dtype: torch.dtype) -> Program:
        """The plan compiled for these training dtypes (checked against the shard first)."""
        plan, me = self.plan(dtype)
        _check_shard(params, plan.members[me].params)
        key = (dtype, tuple(p.dtype for p in params.values()))
        if key not in self._programs:
            align = max(1, ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())
            dtypes = {n: p.dtype for n, p in params.items()}
            self._programs[key] = compile_program(plan, me, dtypes, dtype, align,
                                                  self._plans[dtype][2])
        return self._programs[key]

    # --- switches ------------------------------------------------------------------------------
    def to_generation(self, train_model: Decoder) -> Decoder:
        """This rank's generation shard (t_g, gen_tp_rank; all layers) as a Decoder."""
        if self._active:
            raise RuntimeError("to_generation() called twice without to_training()")
        adapted = self._adapter_switches(train_model)
        params = frozen_base(train_model) if adapted else \
            {n: p for n, p in base_weights(train_model)    # LoRA: merged (models.lora)
             if not n.startswith("value_head.")}
        first = next(iter(params.values()))
        device, dtype = first.device, self.dtype or first.dtype
        t0, peak0 = start_clock(device)
        offload_s = timed(self.offload)
        stats = Stats()
        if self._experts is not None:
            params, stats.bytes, stats.collectives = self._experts(params)
        # the plan moves experts one by one: views of the stacked parameters (models.moe)
        params = dict(expert_views(params.items()))
        prog = self._program(params, dtype)          # checks the shard before anything moves
        if self.model is None:
            self.model = build_gen_decoder(self.cfg, self.gen_mesh, prog.plan.gen_params,
                                           train_model)
        busiest = prog.busiest_bytes + stats.bytes   # EP: every rank gathers the same
        if adapted:
            with torch.no_grad(), record_function("reshard"):
                busiest = self._lora_to_generation(prog, params, adapted, dtype, device, stats)
        else:
            if self._store.program is not prog:          # a new rollout / training dtype
                self._store = _Store(prog)
            store = self._store
            with torch.no_grad(), record_function("reshard"):
                rebound = _bind(prog, params, store, dtype, device)
                _run(prog, store, self.group, stats, self._group_numel(store.arena))
            if rebound:
                assign_weights(self.model, store.bound[0])
        self._active = True
        self._report("to_generation", t0, peak0, device, offload_s, stats, busiest)
        return self.model

    def _group_numel(self, arena: torch.Tensor) -> int:
        return int(self.bucket_mb * 2**20) // arena.element_size()

    def _adapter_switches(self, train_model: Decoder) -> dict | None:
        """The adapted layers when switches move adapters only (hybrid.lora_switch): a LoRA
        actor in zero-redundancy mode with p = 1 and t_g < t. Otherwise None: merged weights
        move (and none at all when t_g = t, p = 1: they are the generation weights)."""
        lay = self.train_mesh.layout
        if self.mode != "zero_redundancy" or lay.pp != 1 or self.gen_mesh.gen_tp == lay.tp:
            return None
        return adapted_layers(train_model) or None

    def _lora_to_generation(self, prog: Program, params: dict, adapted: dict, dtype, device,
                            stats: Stats) -> int:
        """The base's generation shard at the first switch (the program, then only its arena
        is kept: M/t_g between switches), the adapters' gather and the merge at every switch.
        Returns the bytes the busiest rank receives."""
        busiest = 0
        if self._lora_base is None or self._lora_base[0] is not prog:
            store = _Store(prog)
            _bind(prog, params, store, dtype, device)
            _run(prog, store, self.group, stats, self._group_numel(store.arena))
            self._lora_base, self._lora_merged = (prog, dict(store.bound[0])), {}
            busiest = prog.busiest_bytes
        k = self.train_mesh.layout.tp // self.gen_mesh.gen_tp
        adapters, nbytes, calls = gather_adapters(adapted, self.group, k)
        stats.bytes, stats.collectives = stats.bytes + nbytes, stats.collectives + calls
        base, kept = self._lora_base[1], self._lora_merged
        merged = {name: merge_generation_weight(base[name], layer.lora, adapters[name], k,
                                                kept.get(name))
                  for name, layer in adapted.items()}
        if self.keep_weights:                # the same addresses at every switch
            self._lora_merged = merged
        self._lora_names = list(merged)
        assign_weights(self.model, {**base, **merged})
        return busiest + nbytes

    def to_training(self) -> SwitchReport:
        """Release the generation weights (unless keep_weights) and run the reload hook."""
        if not self._active:
            raise RuntimeError("to_training() called without a preceding to_generation()")
        device = next(self.model.parameters()).device
        t0, peak0 = start_clock(device)
        if self._lora_base is not None:      # adapter-only switches: the base shard stays
            if not self.keep_weights:        # the merged weights go; the base views stay
                release_weights(self.model, self._lora_names)
        elif not self.keep_weights and (_holds_memory(self._store) or self._experts):
            release_weights(self.model)
            self._store = _Store()
            if self._experts is not None:
                self._experts.release()
        self._active = False
        offload_s = timed(self.reload)
        return self._report("to_training", t0, peak0, device, offload_s, Stats(), 0)

    def pop_metrics(self) -> dict[str, float]:
        """Metrics of the switches since the last call (timing_s/reshard, reshard/*)."""
        out, self.reports = switch_metrics(self.reports), []
        return out

    def _report(self, direction, t0, peak0, device, offload_s, stats, busiest) -> SwitchReport:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        rep = SwitchReport(direction, self.mode, time.perf_counter() - t0, stats.bytes,
                           stats.bytes, busiest, stats.collectives, peak0,
                           peak_memory_gb(device), offload_s)
        self.reports.append(rep)
        return rep


def _holds_memory(store: _Store) -> bool:
    """Whether releasing the generation weights frees anything: not when every one of them is a
    training parameter (t_g = t, p = 1), where keeping them saves re-pointing every parameter
    at the next switch."""
    prog = store.program
    return prog is None or bool(prog.arena_numel or prog.gen_arena_numel
                                or prog.plan.chunk_numels)


def _check_shard(params: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]]) -> None:
    got = {n: tuple(p.shape) for n, p in params.items()}
    if got != expected:
        missing = sorted(set(expected) - set(got))
        wrong = sorted(n for n in set(got) & set(expected) if got[n] != expected[n])
        extra = sorted(set(got) - set(expected))
        raise ValueError(f"training model does not match its layout's shard: missing {missing[:3]}"
                         f", extra {extra[:3]}, wrong shapes {wrong[:3]} (to_generation needs the "
                         f"actor with its language-model head)")


def _bind(prog: Program, params: dict, store: _Store, dtype, device) -> bool:
    """Allocate the store if needed and bind every copy of the switch to tensors. Returns False
    when the store's bound copies are still valid (same training parameter addresses)."""
    key = tuple(p.data_ptr() for p in params.values())
    if store.bound is not None and store.key == key:
        return False
    plan, s = prog.plan, prog.plan.num_members
    flat = prog.flat_buckets
    if store.arena is None:
        store.arena = new_arena(prog.arena_numel, plan.target_params, prog.place, dtype, device)
        # Two rotating buffers: bucket b+1 is gathered while bucket b is unpacked (direct
        # buckets need none: they gather straight into the arena).
        size = s * max((plan.chunk_numels[b] for b in flat), default=0)
        store.buffers = [torch.empty(size, dtype=dtype, device=device)
                         for _ in range(min(2, len(flat)))]
    detached = {n: p.detach() for n, p in params.items()}
    out = weight_views(prog.place, plan.target_params, store.arena, detached)
    local = Copies([rect(out[b.dst], b.dst_row, b.dst_col, b.rows, b.cols) for b in prog.local],
                   [rect(detached[b.src], b.src_row, b.src_col, b.rows, b.cols)
                    for b in prog.local])
    steps: list[_Step] = []
    rotation = {b: i for i, b in enumerate(flat)}       # flat bucket -> its position
    for b, n in enumerate(plan.chunk_numels):
        if b in (prog.direct or {}):
            steps.append(_direct_step(prog, b, n, detached, out, dtype))
            continue
        buf = store.buffers[rotation[b] % 2][:s * n].view(s, n)
        runs = prog.pack[b]
        pack = Copies([buf[prog.me, o:o + r * c].view(r, c) for *_, r, c, o in runs],
                      [rect(detached[src], row, col, r, c) for src, row, col, r, c, _ in runs])
        dsts, srcs = [], []
        for m, k, off, blk in prog.unpack[b]:
            src = buf[m:m + k, off:off + blk.numel].view(k, blk.rows, blk.cols)
            dst = rect(out[blk.dst], blk.dst_row, blk.dst_col, blk.rows, k * blk.cols)
            dsts.append(dst.view(blk.rows, k, blk.cols).permute(1, 0, 2) if k > 1 else dst)
            srcs.append(src if k > 1 else src[0])
        # In place: this rank's chunk already sits at its slot of the output (NCCL/gloo allow it).
        flat_buf = buf.view(-1)
        steps.append(_Step(False, pack, flat_buf[prog.me * n:(prog.me + 1) * n], flat_buf,
                           Copies(dsts, srcs)))
    gen, slices = out, None
    if plan.mode == "naive":
        if store.gen_arena is None:
            store.gen_arena = new_arena(prog.gen_arena_numel, plan.gen_params, prog.gen_place,
                                        dtype, device)
        gen = weight_views(prog.gen_place, plan.gen_params, store.gen_arena, out)
        todo = [b for b in plan.slices if prog.gen_place[b.dst][0] == "arena"]
        slices = Copies([rect(gen[b.dst], b.dst_row, b.dst_col, b.rows, b.cols) for b in todo],
                        [rect(out[b.src], b.src_row, b.src_col, b.rows, b.cols) for b in todo])
    store.key, store.bound = key, (gen, local, steps, slices)
    return True


@dataclass
class _Step:
    """One bucket's all-gather: `pack` fills `chunk` (this rank's input), the gather writes
    `output`, `unpack` (flat buckets) spreads it into the generation weights."""

    direct: bool
    pack: Copies | None
    chunk: torch.Tensor
    output: torch.Tensor
    unpack: Copies | None = None


def _direct_step(prog: Program, b: int, n: int, detached: dict, out: dict, dtype) -> _Step:
    """A direct bucket: the gather's output is the section of the arena the members fill; its
    input is this member's training rows, or (another dtype) their cast copy at its own slot."""
    src, src_row, rows, cols, dst, dst_row = prog.direct[b]
    s, me = prog.plan.num_members, prog.me
    output = rect(out[dst], dst_row, 0, s * rows, cols).reshape(-1)
    mine = rect(detached[src], src_row, 0, rows, cols)
    if mine.dtype == dtype and mine.is_contiguous():
        return _Step(True, None, mine.reshape(-1), output)
    slot = output[me * n:(me + 1) * n]
    return _Step(True, Copies([slot.view(rows, cols)], [mine]), slot, output)


def _run(prog: Program, store: _Store, group, stats: Stats, group_numel: int) -> None:
    """Local copies; the direct buckets' gathers, coalesced into groups of about `group_numel`
    gathered elements; then per flat bucket: pack, all-gather (async), unpack the previous flat
    bucket. The direct gathers keep the network busy while the first flat buckets are packed."""
    s = prog.plan.num_members
    _, local, steps, slices = store.bound
    local.run()
    elsize, pending, direct, batch, batch_numel = store.arena.element_size(), None, [], [], 0
    for step, n in zip(steps, prog.plan.chunk_numels):
        stats.bytes += (s - 1) * n * elsize
        stats.collectives += 1
        if step.pack is not None:
            step.pack.run()
        if step.direct:
            batch.append((step.output, step.chunk))
            batch_numel += s * n
            if batch_numel >= group_numel:
                direct.append(ptensor.all_gather_flat_group(batch, group))
                batch, batch_numel = [], 0
            continue
        work = ptensor.all_gather_flat(step.output, step.chunk, group, async_op=True)
        if pending is not None:
            pending[0].wait()    # on GPU: the current stream waits for the gather, not the host
            pending[1].run()
        pending = (work, step.unpack)
    if batch:
        direct.append(ptensor.all_gather_flat_group(batch, group))
    if pending is not None:
        pending[0].wait()
        pending[1].run()
    for work in direct:
        work.wait()
    if slices is not None:
        slices.run()
