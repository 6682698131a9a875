"""The generation phase: switch the actor to its generation layout, generate, switch back.

Prompts are dealt to generation replicas round-robin (prompt i to replica i mod d_g); every rank
of a replica generates the same prompts. Results are all-gathered over the world as padded id /
log-prob tensors (no pickling) so every rank ends with the whole batch, in prompt order, exactly
as one process would produce it.

The rollout backend is actor_rollout_ref.rollout.name: `builtin` (rollout.Engine, running on the
generation Decoder itself; replicas are the gen-DP groups of the HybridFlow layout) or `vllm`
(rollout.vllm.VllmRollout, a vLLM engine loaded from the generation Decoder every step; replicas
are blocks of t_g consecutive ranks, vLLM's layout).

Generated.slots says how the built-in engine's KV-cache slots held the batch (SlotUse: the
trainer's rollout/num_slots, rollout/max_concurrent and rollout/preemptions, and a warning when
it ran in waves), exchanged in the all-gather of the response widths.

pop_metrics() also reports the process's torch.compile time since its last call (rollout and
training layers alike: hybridengine.compiling.CompileWatch; 0 when nothing compiled, a vLLM
engine's own compilations included) as timing_s/compile, and prints one
warning line (rank 0) per compilation after the first step, with the guard that failed.
"""
from __future__ import annotations

import functools
import time
from dataclasses import astuple, dataclass
from itertools import chain

import numpy as np
import torch

from hybridengine.compiling import CompileWatch
from hybridengine.hybrid.hf_stream import hf_weight_stream
from hybridengine.hybrid.reshard import HybridEngine
from hybridengine.parallel.mesh import GenMesh
from hybridengine.parallel.tensor import all_gather_dim0
from hybridengine.rollout.engine import Engine
from hybridengine.rollout.rollout_config import CompileMode, RolloutConfig
from hybridengine.rollout.sampling import SamplingParams
from hybridengine.rollout.vllm import (VllmRollout, check_model as check_vllm_model,
                                       vllm_available, vllm_replica)

BACKENDS = ("builtin", "vllm")


def max_prefill_tokens(max_model_len: int) -> int:
    """Tokens of one prefill step of the built-in engine: a whole prompt in one step, and 16k at
    least so that many prompts share a step."""
    return max(16384, max_model_len)


def _engine_kv_layout(kv_layout: str) -> str:
    """The engine's layout for the run's rollout.kv_layout: `auto` is resolved by preflight from
    the memory plan (rl.memory.resolve_kv_layout); a generator built without it (no plan: tests,
    scripts) keeps the static rows."""
    return "static" if kv_layout == "auto" else kv_layout


@dataclass(frozen=True)
class SlotUse:
    """The built-in engine's KV-cache slots in one generation of one replica (Engine.stats):
    num_slots, the sequences its cache holds at once; max_concurrent, the most that ran at
    once; num_seqs, the replica's batch; num_waited, those that found every slot taken;
    num_preemptions, sequences whose KV blocks were taken back and recomputed (the paged
    layout, RolloutConfig.kv_layout; always 0 with static rows)."""

    num_slots: int
    max_concurrent: int
    num_seqs: int
    num_waited: int
    num_preemptions: int = 0

    def metrics(self) -> dict:
        return {"rollout/num_slots": self.num_slots,
                "rollout/max_concurrent": self.max_concurrent,
                "rollout/preemptions": self.num_preemptions}

    def warning(self, max_num_seqs: int) -> str | None:
        """One line when the batch ran in waves (the slots ran out), naming what capped them;
        None when it fit at once."""
        if not self.num_waited:
            return None
        key = "actor_rollout_ref.rollout"
        cap = f"{key}.max_num_seqs={max_num_seqs} caps the slots" \
            if self.num_slots >= max_num_seqs else (
                f"the memory left for the cache caps the slots: more with a higher {key}."
                f"gpu_memory_utilization or tensor_model_parallel_size, the actor's "
                f"megatron.optimizer_offload or param_offload, or a shorter "
                f"data.max_prompt_length + max_response_length")
        return (f"the rollout ran in waves: a generation replica got {self.num_seqs} sequences "
                f"but its KV cache holds {self.num_slots} (rollout/num_slots): at most "
                f"{self.max_concurrent} ran at once, {self.num_waited} waited for a free slot; "
                f"{cap}")


@dataclass
class Generated:
    response_ids: list[list[int]]      # prompt-major: prompt i, sample j at i*n + j
    # log-prob of each sampled token under the distribution it was drawn from (logits / T,
    # top-k / top-p applied), what the trainer recomputes at T; greedy: T = 1
    logprobs: list[list[float]]
    finish_reasons: list[str]
    num_generated_tokens: int
    seconds: float
    # the replica whose sequences waited most for a slot (the largest batch among equals);
    # None: the vLLM backend, which does not report its slots
    slots: SlotUse | None = None


def padded_rows(rows: list, width: int, dtype=np.float64) -> np.ndarray:
    """[len(rows), width] array of the rows (lists of numbers, each at most `width` long), zeros
    past each row's end."""
    lens = np.fromiter(map(len, rows), np.int64, len(rows))
    out = np.zeros((len(rows), width), dtype)
    out[np.arange(width)[None, :] < lens[:, None]] = np.fromiter(
        chain.from_iterable(rows), dtype, int(lens.sum()))
    return out


class Generator:
    """Owns the HybridEngine and the rollout engine of the actor; `gen_mesh` holds the groups of
    the actor's generation layout (parallel.mesh.build_meshes)."""

    def __init__(self, actor_engine, gen_mesh: GenMesh, rollout_cfg, reshard_mode: str,
                 bucket_mb: float, dtype: torch.dtype, max_model_len: int,
                 residency=None, direct_min_mb: float | None = 4.0):
        self.actor, self.mesh, self.gen_mesh = actor_engine, actor_engine.mesh, gen_mesh
        # (HybridEngine refuses a gen_mesh that is not of the actor's layout)
        self.hybrid = HybridEngine(actor_engine.cfg, self.mesh, self.gen_mesh, mode=reshard_mode,
                                   bucket_mb=bucket_mb, dtype=dtype,
                                   direct_min_mb=direct_min_mb)
        self.cfg, self.dtype, self.max_model_len = rollout_cfg, dtype, max_model_len
        self.backend = rollout_cfg.name
        if self.backend not in BACKENDS:
            raise ValueError(f"actor_rollout_ref.rollout.name={self.backend!r} is not one of "
                             f"{BACKENDS}")
        if self.backend == "vllm":
            ok, why = vllm_available()
            if not ok:
                raise ValueError(f"actor_rollout_ref.rollout.name=vllm: {why}")
            check_vllm_model(actor_engine.cfg)
        self.bucket_mb = bucket_mb
        self.residency = residency          # rl.residency.Residency: actor param_offload
        self.engine: Engine | VllmRollout | None = None
        self.compile_watch = CompileWatch(warmup_polls=1)   # the first step compiles

    def _replica(self, rank: int) -> tuple[int, int]:
        """(replica index, TP rank inside it) of a global rank, for this backend. Both backends
        have gen_dp = world / t_g replicas; only which ranks form one differs."""
        if self.backend == "vllm":
            return vllm_replica(rank, self.gen_mesh.gen_tp)
        dp_rank, tp_rank, _ = self.gen_mesh.gen_layout.coords(rank)
        return dp_rank, tp_rank

    def _rollout_engine(self, model) -> Engine | VllmRollout:
        c, dev = self.cfg, self.actor.device
        if self.backend == "vllm":
            if self.engine is None:
                self.engine = VllmRollout(
                    self.actor.model_dir, self.actor.cfg, self.gen_mesh.gen_tp, dtype=self.dtype,
                    max_model_len=self.max_model_len, max_num_seqs=c.max_num_seqs,
                    gpu_memory_utilization=c.gpu_memory_utilization,
                    enforce_eager=c.enforce_eager)
            group = self.gen_mesh.gen_tp_group
            self.engine.update_weights(
                functools.partial(hf_weight_stream, model, group, self.bucket_mb), group)
        elif self.engine is None:
            cuda = dev.type == "cuda"
            # the run config's compile switches are booleans: inductor, on CUDA only
            compile_decode, compile_prefill = (
                CompileMode.INDUCTOR if on and cuda else CompileMode.EAGER
                for on in (c.compile, c.compile_prefill))
            config = RolloutConfig(max_num_seqs=c.max_num_seqs, max_model_len=self.max_model_len,
                                   gpu_memory_utilization=c.gpu_memory_utilization,
                                   max_prefill_tokens=max_prefill_tokens(self.max_model_len),
                                   enforce_eager=c.enforce_eager or not cuda,
                                   compile=compile_decode, compile_prefill=compile_prefill,
                                   attn_backend=c.attn_backend,
                                   prefill_attention=c.prefill_attention,
                                   kv_layout=_engine_kv_layout(c.kv_layout),
                                   block_size=c.block_size)
            self.engine = Engine(model, config, device=dev, dtype=self.dtype)
        return self.engine

    def close(self) -> None:
        """Release the rollout engine (vLLM: shut it down while the process group is alive)."""
        if isinstance(self.engine, VllmRollout):
            self.engine.close()
        self.engine = None

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> Generated:
        t0 = time.perf_counter()
        if self.residency is not None:
            self.residency.before_gather()
        model = self.hybrid.to_generation(self.actor.model)
        if self.residency is not None:
            self.residency.after_gather(model)
        try:
            engine = self._rollout_engine(model)
            replica = self._replica(self.gen_mesh.rank)[0]
            mine = list(range(replica, len(prompts), self.gen_mesh.gen_dp))
            # one seed everywhere, each sequence keyed by its prompt's global index: replicas
            # draw distinct streams, and a run samples the same tokens at any layout
            results = engine.generate([prompts[i] for i in mine], params, prompt_indices=mine)
            slots = self._slot_use(engine, len(mine))
            if self.cfg.free_cache_engine:
                engine.free_cache()
        finally:
            self.hybrid.to_training()
        out = self._gather(results, len(prompts), params.n, not params.greedy, slots)
        if self.actor.device.type == "cuda":
            torch.cuda.synchronize()
        out.seconds = time.perf_counter() - t0
        return out

    def _slot_use(self, engine, num_prompts: int) -> SlotUse | None:
        """This replica's SlotUse of the generation just run (None: vLLM). A replica without
        prompts ran nothing (Engine.stats are then the previous call's)."""
        if self.backend != "builtin":
            return None
        if not num_prompts:
            return SlotUse(0, 0, 0, 0)
        s = engine.stats
        return SlotUse(s["num_slots"], s["max_concurrent"], s["num_seqs"], s["num_waited"],
                       s["num_preemptions"])

    def _exchange(self, width: int, slots: SlotUse | None) -> tuple[int, SlotUse | None]:
        """One all-gather over the world: the longest response of any rank, and the SlotUse of
        the rank whose sequences waited most (Generated.slots)."""
        row = [width, *(astuple(slots) if slots is not None else astuple(SlotUse(0, 0, 0, 0)))]
        world = self.gen_mesh.world_group
        rows = [row]
        if world is not None:
            mine = torch.tensor([row], dtype=torch.long, device=self.actor.device)
            rows = all_gather_dim0(mine, world).tolist()
        # max keeps the first of equals: the lowest rank
        worst = max(rows, key=lambda r: (r[4], r[3]))
        return max(r[0] for r in rows), SlotUse(*worst[1:]) if slots is not None else None

    def _gather(self, results, num_prompts, n, sampled: bool,
                slots: SlotUse | None = None) -> Generated:
        """All-gather every replica's results; keep TP rank 0's copy of each replica's.
        sampled: report the sampling distribution's log-probs (else the T = 1 ones); slots:
        this rank's SlotUse (None: vLLM), exchanged with the response widths."""
        width, slots = self._exchange(max([len(r.token_ids) for r in results] + [1]), slots)
        world = self.gen_mesh.world_group
        rows = (num_prompts + self.gen_mesh.gen_dp - 1) // self.gen_mesh.gen_dp * n
        # [len, finish, ids..., log-probs...] a row, float64 (ids exact below 2^53), built and
        # read whole: per-row tensors took ~25 ms of host time for 256 x 256 tokens while the
        # device idled between generation and scoring
        flat = np.zeros((rows, 2 + 2 * width))
        flat[:len(results), 0] = [len(r.token_ids) for r in results]
        flat[:len(results), 1] = [r.finish_reason == "stop" for r in results]
        flat[:len(results), 2:2 + width] = padded_rows([r.token_ids for r in results], width)
        flat[:len(results), 2 + width:] = padded_rows(
            [r.sampled_logprobs if sampled else r.logprobs for r in results], width)
        if world is not None:
            flat = all_gather_dim0(torch.from_numpy(flat).to(self.actor.device), world).cpu()
            flat = flat.numpy()
        per_rank = flat.reshape(-1, rows, flat.shape[1])
        out_ids: list = [None] * (num_prompts * n)
        out_lp: list = [None] * (num_prompts * n)
        out_fin: list = [None] * (num_prompts * n)
        for rank in range(per_rank.shape[0]):
            dp_rank, tp_rank = self._replica(rank)
            if tp_rank != 0:
                continue
            mine = per_rank[rank]
            ids, lps = mine[:, 2:2 + width].astype(np.int64), mine[:, 2 + width:].astype(np.float32)
            for k, p in enumerate(range(dp_rank, num_prompts, self.gen_mesh.gen_dp)):
                for j in range(n):
                    row, length = k * n + j, int(mine[k * n + j, 0])
                    out_ids[p * n + j] = ids[row, :length].tolist()
                    out_lp[p * n + j] = lps[row, :length].tolist()
                    out_fin[p * n + j] = "stop" if mine[row, 1] > 0 else "length"
        total = sum(len(x) for x in out_ids)
        return Generated(out_ids, out_lp, out_fin, total, 0.0, slots)

    def pop_metrics(self) -> dict:
        out = self.hybrid.pop_metrics()
        compiled = self.compile_watch.poll()
        out["timing_s/compile"] = compiled.seconds    # every step: the same keys, run to run
        if self.mesh.rank == 0:
            for line in compiled.late:
                print(f"warning: torch.compile compiled again after the first step: {line}",
                      flush=True)
        return out
