"""The model runner: the only rollout code that touches device tensors and CUDA graphs.

It holds the KV cache (rollout/kv_cache.py), the per-slot state on the device
(rollout/slot_state.py: each slot's last token, position, counters, random key and outputs
so far), the decode step's CUDA graphs (rollout/decode_graphs.py) and the compiled steps
(rollout/compile_steps.py: which graphs compile, and what keeps their number bounded).

A decode step reads its rows' state, runs the decoder over the cache, samples, and writes the
state back (`_commit`), all on the device: under a CUDA graph the host launches one replay and
uploads the row->slot list only when it changed. The host learns which rows finished from a
[B] bool copied into pinned memory and read one step later (`Pending`), so it never waits for
the step it just launched; a finished row stays in the next step, inactive (nothing it
computes is kept). When the host frees a finished slot, `collect` copies the slot's outputs
to the result buffers (in stream order, before any prefill reuses the slot); `results` moves
them to the host once per generate call.

The engine's RolloutConfig (rollout/rollout_config.py) is read here; its kernel settings
(config.kernels) reach the attention contexts, the sampler and the compile options from here.
"""
from __future__ import annotations

import logging

import numpy as np
import torch
import torch.distributed as dist
from torch.profiler import record_function

from hybridengine.device_memory import reset_peak
from hybridengine.models.attention import PackedInput
from hybridengine.parallel.tensor import all_gather_dim0, all_reduce, group_size
from hybridengine.rollout.attention import (DecodeContext, PrefillContext, resolve_backend,
                                            resolve_prefill_attention)
# MAX_COMPILED_GRAPHS, graph_buckets, Pending: also importable from here (tests, the engine)
from hybridengine.rollout.compile_steps import (MAX_COMPILED_GRAPHS,  # noqa: F401
                                                compile_decode_steps, compile_prefill_step)
from hybridengine.rollout.decode_graphs import DecodeGraphs, graph_buckets
from hybridengine.rollout.kv_cache import (DEVICE_RESERVE, KVCache, check_fits_device,
                                          kv_bytes_per_token, plan_num_slots)
from hybridengine.rollout.prefill_plan import plan_dense, prefill_plan
from hybridengine.rollout.rollout_config import CompileMode, RolloutConfig
from hybridengine.rollout.sampling import MAX_STOP_TOKENS, SamplingParams, sample
from hybridengine.rollout.scheduler import Sequence
from hybridengine.rollout.slot_state import Pending, SlotState, h2d

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model, config: RolloutConfig, max_model_len: int):
        """config: the engine's; max_model_len: config.max_model_len resolved against the
        model (the Engine's check). allocate() reads the config's cache budget at each
        allocation, so a config swapped in after free() sizes the next cache."""
        self.model, self.config, self.max_model_len = model, config, max_model_len
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.vocab_size = model.cfg.vocab_size
        self.tp_group, self.tp = model.tp_group, group_size(model.tp_group)
        # the kernel settings as an attribute of their own: the compiled steps read (and guard on)
        # it, not the config, which a test replaces after free() to size the next cache
        self.kernel_settings = kernels = config.kernels
        self.use_graphs = self.device.type == "cuda" and not config.enforce_eager
        # graph-shaped decode (bucket padding with scratch rows, all max_model_len keys);
        # tests set it on the CPU to run that path without capture
        self.static_shapes = self.use_graphs
        # Optionally the decode step and its sampler bookkeeping, and the prefill forward,
        # through torch.compile (rollout/compile_steps.py); a prefill that fails to compile
        # falls back to eager, once.
        self.compiled = config.compile is not CompileMode.EAGER
        self.prefill_compiled = config.compile_prefill is not CompileMode.EAGER
        self._decode_body, self._uniforms, self._commit_rows = compile_decode_steps(
            self._decode_hidden, self._commit, config.compile, self.device, kernels.pdl)
        self._prefill_body = compile_prefill_step(self._prefill_hidden, config.compile_prefill,
                                                  self.device, kernels.pdl)
        self._prefill_forms_compiled = False
        for layer in model.layers:      # MoE: no host sync inside captured or compiled steps
            if hasattr(layer.mlp, "sync_free"):
                layer.mlp.sync_free = self.use_graphs or self.compiled
        c = model.cfg
        heads = (c.num_heads // self.tp, c.num_kv_heads // self.tp, c.head_dim)
        self.backend = resolve_backend(config.attn_backend, self.device, self.dtype, heads,
                                       kernels)
        # "varlen" (flash varlen over the packed prompts) or "dense" (cuDNN on CUDA over the
        # prompts right-padded to the longest one: rollout.attention.padded_causal_attention)
        self.prefill_attention = resolve_prefill_attention(config.prefill_attention,
                                                           self.device, self.dtype, heads)
        self.cache: KVCache | None = None
        self.state: SlotState | None = None
        self._prefill_peak: tuple | None = None       # (config key, bytes): _free_bytes_for_cache
        # sampler parameters: device tensors, so that one graph serves every value
        self.temperature = torch.ones(1, dtype=torch.float32, device=self.device)
        self.top_p = torch.ones(1, dtype=torch.float32, device=self.device)
        self.stop_ids = torch.full((MAX_STOP_TOKENS,), -1, dtype=torch.long, device=self.device)

    # --- allocation --------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return self.cache.num_slots

    def allocate(self) -> None:
        """Allocate the cache and the per-slot state (when not allocated); drop the graphs
        when the parameters moved (they were captured with the old addresses)."""
        if self._allocated():
            return
        attn = self.model.layers[0].self_attn
        num_layers = len(self.model.layers)
        bpt = kv_bytes_per_token(num_layers, attn.num_kv_heads, attn.head_dim, self.dtype)
        c = self.config
        S = plan_num_slots(c.max_num_seqs, self.max_model_len, bpt, c.kv_cache_tokens,
                           self._cache_budget())
        L, dev = self.max_model_len, self.device
        check_fits_device((S + 1) * L * bpt, c.kv_cache_tokens, dev)
        self.cache = KVCache(num_layers, S, L, attn.num_kv_heads, attn.head_dim, self.dtype, dev)
        self.state = SlotState(S, L, dev)
        long = dict(dtype=torch.long, device=dev)
        # static decode inputs and outputs (CUDA graphs read / write these addresses)
        self.row_slots = torch.full((S,), S, **long)
        self.step_fin = torch.zeros(S, dtype=torch.bool, device=dev)
        self.cu_k_tail = torch.tensor([(S + 1) * L], **long)
        self.buckets = self._graph_buckets(S)
        if self.compiled or self.prefill_compiled:
            # the slot count follows the memory free at each allocation (after free()): the
            # compiled steps take any, instead of compiling again for a new one
            for t in (*self.cache.k, *self.cache.v, *self.state.tensors()):
                torch._dynamo.maybe_mark_dynamic(t, 0)
        self.graphs = DecodeGraphs(dev)
        self._uploaded_rows: list[int] | None = None

    def _allocated(self) -> bool:
        """Whether the cache is allocated; the graphs dropped if the parameters moved since
        the last call (they were captured with the old addresses)."""
        ptrs = tuple(p.data_ptr() for p in self.model.parameters())
        allocated = self.cache is not None
        if allocated and ptrs != self._param_ptrs:
            self.graphs.clear()
        self._param_ptrs = ptrs
        return allocated

    def _graph_buckets(self, rows: int) -> list[int]:
        """The decode graphs' batch sizes for `rows` rows; compiled, none of size 1 (torch.compile
        specialises a dimension of size 1: such a batch pads to 2)."""
        buckets = graph_buckets(rows)
        return buckets[1:] if self.compiled and rows > 1 else buckets

    def free(self) -> None:
        """Release the cache, the state and the graphs (they point into the cache)."""
        if self.cache is None:
            return
        self.cache = self.graphs = self.state = None
        for name in ("row_slots", "step_fin"):
            self.__dict__.pop(name, None)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _cache_budget(self) -> int | None:
        """Bytes for the KV cache on CUDA without kv_cache_tokens (the same on every rank of
        the replica), else None."""
        if self.config.kv_cache_tokens is not None or self.device.type != "cuda":
            return None
        budget = self._free_bytes_for_cache()
        if self.tp > 1:
            # the ranks of a replica schedule in lockstep (the logits' all-gather, the same
            # slots every step): the smallest rank's room sizes everyone's cache
            room = torch.tensor([budget], dtype=torch.long, device=self.device)
            budget = int(all_reduce(room, self.tp_group, op=dist.ReduceOp.MIN).item())
        return budget

    def _free_bytes_for_cache(self) -> int:
        """gpu_memory_utilization · device memory, minus what is allocated now and the peak of a
        full prefill step plus sampling max_num_seqs rows (measured once: see _prefill_peak)."""
        total = torch.cuda.get_device_properties(self.device).total_memory
        # the allocator's count is the host's own: exact without waiting for the device
        base = torch.cuda.memory_allocated(self.device)
        c = self.config
        key = (c.max_prefill_tokens, self.max_model_len, c.max_num_seqs)
        if self._prefill_peak is None or self._prefill_peak[0] != key:
            self._prefill_peak = (key, self._measure_prefill_peak())
        return int((c.gpu_memory_utilization - DEVICE_RESERVE) * total - base
                   - self._prefill_peak[1])

    def _measure_prefill_peak(self) -> int:
        """Bytes a prefill of max_prefill_tokens plus sampling max_num_seqs rows allocate above
        what is allocated before it. It depends on the model's shapes and the config only, so
        one measurement serves every later allocation: measured at every one (free_cache_engine
        frees the cache each step), it was an eager 16k-token forward and two device waits
        inside each step's rollout: 49 ms of the PPO seed step's generation on an H100
        (bench/RESULTS.md session 37)."""
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        reset_peak(self.device)            # (the run's peak is carried: device_memory)
        c = self.config
        with torch.no_grad():
            T, L = c.max_prefill_tokens, self.max_model_len
            lens = [L] * (T // L) + ([T % L] if T % L else [])
            ids = torch.zeros(T, dtype=torch.long, device=self.device)
            packed = PackedInput.from_lengths(ids, lens)
            h = self.model(packed, attn_ctx=PrefillContext(None, 0, packed))
            rows = h[:1].expand(c.max_num_seqs, -1)
            worst = SamplingParams(temperature=0.5, top_p=0.5).mode(self.vocab_size)
            u = torch.full((c.max_num_seqs,), 0.5, device=self.device)
            sample(self._logits(rows), worst, self.temperature, self.top_p, u,
                   self.kernel_settings)
            del h, rows
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - base

    # --- per generate call ------------------------------------------------------------------
    def begin(self, params: SamplingParams, num_seqs: int, max_gen: int) -> None:
        """Set the sampler's device parameters and size the result buffers."""
        self.mode = params.mode(self.vocab_size)
        self.temperature.fill_(params.temperature if params.temperature > 0 else 1.0)
        self.top_p.fill_(params.top_p)
        stop = list(params.stop_ids()) + [-1] * (MAX_STOP_TOKENS - len(params.stop_ids()))
        self.stop_ids.copy_(self._h2d(stop), non_blocking=True)
        self.state.begin(num_seqs, max_gen)

    def results(self):
        """(tokens, logprobs, sampled_logprobs [N, max_gen], lengths [N]) on the host."""
        return self.state.results()

    def collect(self, slots: list[int], seq_ids: list[int]) -> None:
        """Copy finished slots' outputs to their result rows (before the slots are reused)."""
        self.state.collect(self._h2d(slots), self._h2d(seq_ids))

    def _h2d(self, values) -> torch.Tensor:
        return h2d(values, self.device)

    # --- steps ------------------------------------------------------------------------------
    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """[B, H] -> full-vocabulary logits [B, V] (gathered over the generation-TP group)."""
        local = self.model.logits_local(h)                                    # [B, Vp/tp]
        if self.tp > 1:
            B, v_local = local.shape
            full = all_gather_dim0(local.contiguous(), self.tp_group)          # [tp·B, Vp/tp]
            local = full.view(self.tp, B, v_local).permute(1, 0, 2).reshape(B, -1)
        return local[:, : self.vocab_size]

    def _commit(self, slots, tok, logprob, sampled) -> torch.Tensor:
        """SlotState.commit of one sampled token per row: the rows that finished [B] bool."""
        return self.state.commit(slots, tok, logprob, sampled, self.stop_ids)

    def _sample_and_commit(self, slots, positions, h) -> torch.Tensor:
        logits = self._logits(h)
        u = self._uniforms(self.state.keys[slots], positions + 1)
        tok, lp, slp = sample(logits, self.mode, self.temperature, self.top_p, u,
                              self.kernel_settings)
        return self._commit_rows(slots, tok, lp, slp)

    def prefill(self, seqs: list[Sequence]) -> Pending:
        """Prefill each distinct prompt once, write its K/V into every sample's row, sample
        each sequence's first token."""
        real = len(seqs)
        if (self.compiled or self.prefill_compiled) and \
                len({s.prompt_index for s in seqs}) == 1:
            # a compiled step specialises a dimension of size 1 (one prompt, one row, one
            # token) and compiles again for it: a 1-token dummy prompt with one row in the
            # scratch slot keeps every size >= 2
            seqs = seqs + [Sequence(-1, -1, [0], 0, 0, self.cache.scratch_slot)]
        t, packed, ctx = self._prefill_inputs(seqs)
        if self.prefill_compiled and self.prefill_attention == "dense" and \
                not self._prefill_forms_compiled:
            self._compile_other_form(seqs, dense=ctx.dense is None)
        slots = t["slots"]
        # the last prompt token is the "current" one: the commit moves each row to the first
        # generated token's position, len(prompt)
        state = self.state
        state.positions[slots] = t["last_pos"]
        state.keys[slots] = t["keys"]
        state.max_gen[slots] = t["max_gen"]
        # index_fill_, not `state[slots] = 0`: a Python scalar assigned through a CUDA index
        # tensor is copied from pageable host memory, a blocking copy that drained the device
        # queue at every prefill (2 stream synchronisations per prefill on an H200 trace,
        # bench/RESULTS.md 2026-11-30 session 6)
        state.counts.index_fill_(0, slots, 0)
        state.active.index_fill_(0, slots[:real], True)         # (not the dummy's scratch row)
        with torch.no_grad(), record_function("prefill"):
            h = self._prefill_forward(packed, ctx)                             # [T, H]
            h = h.index_select(0, t["last"])                                   # [prompts, H]
            h = h.index_select(0, t["row_prompt"])                             # [seqs, H]
            fin = self._sample_and_commit(slots, t["last_pos"], h)   # = positions[slots]
        return Pending([s.slot for s in seqs[:real]], fin[:real])

    def _prefill_inputs(self, seqs: list[Sequence], dense: bool | None = None):
        """(device index arrays, PackedInput, PrefillContext) of a prefill. dense: the dense
        attention; None: when prefill_attention is dense and the padding pays (dense_pays)."""
        plan, max_len = prefill_plan(seqs, self.vocab_size)
        width = plan_dense(plan, max_len, self.prefill_attention, self.prefill_compiled, dense)
        num_prompts = len(plan["cu"]) - 1
        t = self._h2d_arrays(plan)             # one host-to-device copy for every index list
        packed = PackedInput(t["ids"], t["positions"], t["cu"].to(torch.int32), max_len)
        ctx = PrefillContext(self.cache, self.model.layer_start, packed, t["src"],
                             t["dst_slot"], t["dst_pos"],
                             (num_prompts, width, t.get("pad_index")) if width else None,
                             self.kernel_settings)
        return t, packed, ctx

    def _compile_other_form(self, seqs: list[Sequence], dense: bool) -> None:
        """Compile the prefill form (dense or varlen attention) this prefill does not take, at
        the first prefill, on the sequences of its first two prompts: which form a prefill
        takes depends on its prompts' lengths, and a form first met mid-run would stall that
        step for a whole compilation. Runs before the prefill itself, which then writes the
        same K/V rows again."""
        self._prefill_forms_compiled = True
        first = set(list(dict.fromkeys(s.prompt_index for s in seqs))[:2])
        _, packed, ctx = self._prefill_inputs([s for s in seqs if s.prompt_index in first],
                                              dense)
        with torch.no_grad():
            self._prefill_forward(packed, ctx)

    def _h2d_arrays(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """int64 host arrays on the device through one pinned, non-blocking copy (views)."""
        sizes = [a.size for a in arrays.values()]
        flat = self._h2d(np.concatenate(list(arrays.values())))
        return dict(zip(arrays, flat.split(sizes)))

    def _prefill_hidden(self, packed: PackedInput, ctx: PrefillContext) -> torch.Tensor:
        return self.model(packed, attn_ctx=ctx)

    def _prefill_forward(self, packed: PackedInput, ctx: PrefillContext) -> torch.Tensor:
        if self.prefill_compiled:
            try:
                return self._prefill_body(packed, ctx)
            except Exception as e:  # noqa: BLE001 - any compile failure: eager from now on
                logger.warning("compiled prefill failed (%s: %s); prefill runs eagerly",
                               type(e).__name__, str(e).splitlines()[0] if str(e) else "")
                self.prefill_compiled = False
        return self._prefill_hidden(packed, ctx)

    def decode(self, slots: list[int], max_k: int) -> Pending:
        """One token for each running slot (sorted). max_k bounds the keys read (eager only)."""
        B = len(slots)
        with torch.no_grad(), record_function("decode"):
            if self.static_shapes:
                bucket = next(b for b in self.buckets if b >= B)
                graph = self._graph(bucket) if self.use_graphs else None
                rows = slots + [self.cache.scratch_slot] * (bucket - B)
                if rows != self._uploaded_rows:
                    self.row_slots[:bucket].copy_(self._h2d(rows), non_blocking=True)
                    self._uploaded_rows = rows
                if graph is not None:
                    graph.replay()
                else:
                    self._decode_step(bucket, self.max_model_len)
            else:
                # compiled: one scratch row with a lone sequence (size 1 would compile again)
                pad = self.compiled and B == 1 < self.num_slots
                rows = slots + [self.cache.scratch_slot] * pad
                self.row_slots[:len(rows)].copy_(self._h2d(rows))
                self._decode_step(len(rows), max_k)
        return Pending(slots, self.step_fin[:B])

    def _decode_step(self, B: int, max_k: int) -> None:
        slots, body_slots = self.row_slots[:B], self.row_slots[:B]
        if self.compiled and B > 1:
            # the decode body's own view: the sampler's compiled steps (dynamic=True) see an
            # unmarked one, as from the prefill, so they compile once for both callers
            torch._dynamo.mark_dynamic(body_slots, 0)
        h = self._decode_body(body_slots, max_k)
        # the forward only writes the cache: positions still hold this step's values
        self.step_fin[:B] = self._sample_and_commit(slots, self.state.positions[slots], h)

    def _decode_hidden(self, slots: torch.Tensor, max_k: int) -> torch.Tensor:
        """slots [B] -> last hidden states [B, H] of the rows' current tokens (writes K/V)."""
        state, settings = self.state, self.kernel_settings
        tok, pos = state.tokens[slots], state.positions[slots]
        cu_q = torch.arange(slots.shape[0] + 1, dtype=torch.int32, device=slots.device)
        ctx = DecodeContext(self.cache, self.model.layer_start, slots, pos, self.backend, max_k,
                            cu_q, self.cu_k_tail,
                            state.positions if settings.fused_rope else None, settings)
        return self.model(PackedInput(tok, pos, cu_q, 1), attn_ctx=ctx)

    def _graph(self, bucket: int):
        """The decode graph of (sampler mode, bucket), captured on first use. Its warm-up and
        capture run on scratch rows only, so they can happen in the middle of a generation."""
        key = (self.mode, bucket)
        graph = self.graphs.get(key)
        if graph is None:
            self.row_slots[:bucket].fill_(self.cache.scratch_slot)
            self._uploaded_rows = None
            graph = self.graphs.capture(key,
                                        lambda: self._decode_step(bucket, self.max_model_len))
        return graph
