"""The model runner: the only rollout code that touches device tensors and CUDA graphs.

Per-slot state lives on the device (index = cache slot; the last one is scratch):

    tokens, positions   the last sampled token and its position (the next decode's input)
    counts, max_gen     tokens generated so far / allowed
    keys, active        random key of the occupant; still generating
    out_tok/lp/slp      [slots + 1, max_model_len + 1] the occupant's outputs so far

A decode step reads its rows' state, runs the decoder over the cache, samples, and writes the
state back (`_commit`), all on the device: under a CUDA graph the host launches one replay and
uploads the row->slot list only when it changed. The host learns which rows finished from a
[B] bool copied into pinned memory and read one step later (`Pending`), so it never waits for
the step it just launched; a finished row stays in the next step, inactive (nothing it
computes is kept). When the host frees a finished slot, `collect` copies the slot's outputs
to the result buffers (in stream order, before any prefill reuses the slot); `results` moves
them to the host once per generate call.

Compiled steps (compile / compile_prefill) compile a bounded set of graphs, all in the first
generate call, whatever the prompt lengths, batch sizes, sampler modes, max_tokens or slot
counts that follow (tests/test_compile_bound.py):

    decode forward          1   rows marked dynamic: every graph bucket; slot count dynamic
    random-stream hashing   1   dynamic=True (prefill and decode rows alike)
    commit                  1   dynamic=True
    prefill forward         1   per attention form: varlen, and dense when prefill_attention
                                is dense (the other form is compiled at the first prefill)

so at most MAX_COMPILED_GRAPHS; without CUDA graphs (enforce_eager) the decode forward adds one
at its second step, when its key bound max_k turns dynamic. What keeps the set bounded: no
duck sizing (compiling.compile_fn); no dimension of size 1 (decode buckets start at 2; a
one-prompt prefill gets a 1-token dummy prompt and row in the scratch slot); one form of every
input (a pad index even where no prompt is padded; sampler outputs are never views; a
prefill's slots sit at offset 0 of its index buffer, as the decode step's rows do).
"""
from __future__ import annotations

import logging

import numpy as np
import torch
from torch.profiler import record_function

from hybridengine.compiling import compile_fn
from hybridengine.kernels.decode_attention import pdl_supported
from hybridengine.models.attention import PackedInput
from hybridengine.parallel.tensor import all_gather_dim0, group_size
from hybridengine.rollout.attention import (DecodeContext, PrefillContext, resolve_backend,
                                            resolve_prefill_attention)
from hybridengine.rollout.kv_cache import KVCache, kv_bytes_per_token, plan_num_slots
from hybridengine.rollout.prefill_plan import add_pad_index, dense_pays, prefill_plan
from hybridengine.rollout.sampling import MAX_STOP_TOKENS, SamplingParams, sample, uniforms
from hybridengine.rollout.scheduler import Sequence

logger = logging.getLogger(__name__)

# Programmatic dependent launch (Hopper and later): inductor's Triton kernels in the compiled
# steps are launched so that each may be scheduled while the kernel before it drains, and wait
# on the device (griddepcontrol) before touching its output. Measured on an H200: decode 1.828
# -> 1.771 ms/step (bench/RESULTS.md 2026-11-30 session 7). A module switch for benchmarks; read
# when a runner is built.
PDL = True
# graphs the compiled steps compile in a process (module docstring)
MAX_COMPILED_GRAPHS = 5


def _inductor_options(device: torch.device, decode: bool) -> dict:
    """Inductor options of the rollout's compiled steps: PDL where torch has it (2.11+) and the
    GPU supports it. The decode step's pointwise kernels take inductor's first launch setting
    instead of the fastest of those it times once at compile time: for the SwiGLU kernel that
    timing picked either of two, and in the captured step one took 15 and the other 19 ms per
    generate (23 under PDL; H200, bench/RESULTS.md 2026-11-30 session 8), so the rollout's
    speed changed from one process to the next."""
    from torch._inductor import config
    options = {"triton.autotune_pointwise": False} if decode else {}
    if PDL and hasattr(config.triton, "enable_pdl") and pdl_supported(device):
        options["triton.enable_pdl"] = True
    return options


def graph_buckets(max_rows: int) -> list[int]:
    """Decode batch sizes with a captured graph: 1, 2, 4, 8, 16, 24, 32, 48, 64, 96, ... (powers
    of two and their midpoints: at most 1/3 padding rows), and max_rows. Few buckets: each is
    captured again after free_cache()."""
    sizes, b = [1, 2, 4], 4
    while b < max_rows:
        sizes += [b + b // 2, 2 * b] if b >= 16 else [2 * b]
        b *= 2
    return sorted({s for s in sizes if s < max_rows} | {max_rows})


class Pending:
    """The finished flags of one step, readable without stalling the device queue."""

    def __init__(self, slots: list[int], fin: torch.Tensor):
        self.slots = slots
        self.event = None
        if fin.is_cuda:
            self.host = torch.empty(fin.shape, dtype=torch.bool, pin_memory=True)
            self.host.copy_(fin, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = fin.clone()

    def finished_slots(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return [s for s, f in zip(self.slots, self.host.tolist()) if f]


class ModelRunner:
    def __init__(self, model, max_num_seqs: int, max_model_len: int, max_prefill_tokens: int,
                 kv_cache_tokens: int | None, gpu_memory_utilization: float | None,
                 enforce_eager: bool, attn_backend: str, compile: bool | str = False,
                 compile_prefill: bool | str = False, prefill_attention: str = "varlen"):
        self.model = model
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.vocab_size = model.cfg.vocab_size
        self.tp_group, self.tp = model.tp_group, group_size(model.tp_group)
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.max_prefill_tokens = max_prefill_tokens
        self.kv_cache_tokens, self.gpu_memory_utilization = kv_cache_tokens, gpu_memory_utilization
        self.use_graphs = self.device.type == "cuda" and not enforce_eager
        # graph-shaped decode (bucket padding with scratch rows, all max_model_len keys);
        # tests set it on the CPU to run that path without capture
        self.static_shapes = self.use_graphs
        # Optionally fuse the decode step's small ops (norms, RoPE, SwiGLU) with torch.compile;
        # the batch dimension is marked dynamic, so one compile serves every graph bucket. The
        # bookkeeping around the sampler (the random stream's integer hashing, result and state
        # updates: ~45 tiny kernels per decode step) is compiled the same way; the torch
        # sampler is not: its vocabulary-wide sort/cumsum gains nothing from fusion and trips
        # Inductor on torch 2.11 (bench/RESULTS.md). A string names the compile backend (tests
        # use "aot_eager"); "max-autotune": inductor benchmarks its GEMM templates against
        # cuBLAS for the decode step's small-M matmuls, a benchmark variant: slower on an H200
        # (78.9k against 82.4k generated tok/s, 93 s of warm-up against 55 s).
        self._decode_body, self.compiled = self._decode_hidden, bool(compile)
        self._uniforms, self._commit_rows = uniforms, self._commit
        if compile:
            how = {"mode": "max-autotune-no-cudagraphs"} if compile == "max-autotune" else \
                {"backend": compile if isinstance(compile, str) else "inductor"}
            if how.get("backend") == "inductor":
                how["options"] = _inductor_options(self.device, decode=True)
            self._decode_body = compile_fn(self._decode_hidden, **how)
            self._uniforms = compile_fn(uniforms, dynamic=True, **how)
            self._commit_rows = compile_fn(self._commit, dynamic=True, **how)
        # Optionally the prefill forward too (dynamic shapes: every prefill packs a different
        # number of tokens and prompts). A failure to compile falls back to eager, once.
        # "cpp-wrapper": inductor launches the kernels from C++ instead of Python (a benchmark
        # variant; on an H200 it gained nothing measurable: prefill 0.241 against 0.243 s, with
        # 110 against 60 s of warm-up; bench/RESULTS.md 2026-11-30 session 6, call 1).
        self._prefill_body, self.prefill_compiled = self._prefill_hidden, bool(compile_prefill)
        self._prefill_forms_compiled = False
        options = _inductor_options(self.device, decode=False)
        if compile_prefill == "cpp-wrapper":
            self._prefill_body = compile_fn(self._prefill_hidden, dynamic=True,
                                            options={"cpp_wrapper": True, **options})
        elif compile_prefill:
            backend = compile_prefill if isinstance(compile_prefill, str) else "inductor"
            self._prefill_body = compile_fn(
                self._prefill_hidden, backend=backend, dynamic=True,
                **({"options": options} if backend == "inductor" and options else {}))
        c = model.cfg
        heads = (c.num_heads // self.tp, c.num_kv_heads // self.tp, c.head_dim)
        self.backend = resolve_backend(attn_backend, self.device, self.dtype, heads)
        # "varlen" (flash varlen over the packed prompts) or "dense" (cuDNN on CUDA over the
        # prompts right-padded to the longest one: rollout.attention.padded_causal_attention)
        self.prefill_attention = resolve_prefill_attention(prefill_attention, self.device,
                                                           self.dtype, heads)
        # the fused Triton temperature sampler where it runs, and RoPE + cache write inside
        # the Triton decode attention (benchmarks turn them off to compare; set before the
        # first decode graph is captured)
        self.fused_sampler = self.fused_rope = True
        self.cache: KVCache | None = None
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
        ptrs = tuple(p.data_ptr() for p in self.model.parameters())
        if self.cache is not None:
            if ptrs != self._param_ptrs:
                self.graphs.clear()
            self._param_ptrs = ptrs
            return
        self._param_ptrs = ptrs
        attn = self.model.layers[0].self_attn
        num_layers = len(self.model.layers)
        bpt = kv_bytes_per_token(num_layers, attn.num_kv_heads, attn.head_dim, self.dtype)
        budget = None
        if self.kv_cache_tokens is None and self.device.type == "cuda":
            budget = self._free_bytes_for_cache()
        S = plan_num_slots(self.max_num_seqs, self.max_model_len, bpt, self.kv_cache_tokens,
                           budget)
        L, dev = self.max_model_len, self.device
        self.cache = KVCache(num_layers, S, L, attn.num_kv_heads, attn.head_dim, self.dtype, dev)
        long = dict(dtype=torch.long, device=dev)
        for name in ("tokens", "positions", "counts", "max_gen", "keys"):
            setattr(self, name, torch.zeros(S + 1, **long))
        self.active = torch.zeros(S + 1, dtype=torch.bool, device=dev)
        self.out_tok = torch.zeros(S + 1, L + 1, **long)
        self.out_lp = torch.zeros(S + 1, L + 1, dtype=torch.float32, device=dev)
        self.out_slp = torch.zeros_like(self.out_lp)
        # static decode inputs and outputs (CUDA graphs read / write these addresses)
        self.row_slots = torch.full((S,), S, **long)
        self.step_fin = torch.zeros(S, dtype=torch.bool, device=dev)
        self.cu_k_tail = torch.tensor([(S + 1) * L], **long)
        self.buckets = graph_buckets(S)
        if self.compiled and S > 1:       # torch.compile specialises size 1: pad it to 2
            self.buckets = self.buckets[1:]
        if self.compiled or self.prefill_compiled:
            # the slot count follows the memory free at each allocation (after free()): the
            # compiled steps take any, instead of compiling again for a new one
            for t in (*self.cache.k, *self.cache.v, *self._slot_state()):
                torch._dynamo.maybe_mark_dynamic(t, 0)
        self.graphs: dict = {}
        self._graph_pool = None
        self._uploaded_rows: list[int] | None = None

    def _slot_state(self) -> list[torch.Tensor]:
        return [self.tokens, self.positions, self.counts, self.max_gen, self.keys, self.active,
                self.out_tok, self.out_lp, self.out_slp]

    def free(self) -> None:
        """Release the cache, the state and the graphs (they point into the cache)."""
        if self.cache is None:
            return
        self.cache = self.graphs = self._graph_pool = None
        for name in ("tokens", "positions", "counts", "max_gen", "keys", "active", "out_tok",
                     "out_lp", "out_slp", "row_slots", "step_fin", "res_tok", "res_lp",
                     "res_slp", "res_len"):
            self.__dict__.pop(name, None)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _free_bytes_for_cache(self) -> int:
        """gpu_memory_utilization · device memory, minus what is allocated now and the peak of a
        full prefill step plus sampling max_num_seqs rows (measured)."""
        total = torch.cuda.get_device_properties(self.device).total_memory
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        with torch.no_grad():
            T, L = self.max_prefill_tokens, self.max_model_len
            lens = [L] * (T // L) + ([T % L] if T % L else [])
            ids = torch.zeros(T, dtype=torch.long, device=self.device)
            packed = PackedInput.from_lengths(ids, lens)
            h = self.model(packed, attn_ctx=PrefillContext(None, 0, packed))
            rows = h[:1].expand(self.max_num_seqs, -1)
            worst = SamplingParams(temperature=0.5, top_p=0.5).mode(self.vocab_size)
            u = torch.full((self.max_num_seqs,), 0.5, device=self.device)
            sample(self._logits(rows), worst, self.temperature, self.top_p, u)
            del h, rows
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        # 5% of the device for the graphs' pool, the allocator's fragmentation and NCCL
        return int(self.gpu_memory_utilization * total - base - peak - 0.05 * total)

    # --- per generate call ------------------------------------------------------------------
    def begin(self, params: SamplingParams, num_seqs: int, max_gen: int) -> None:
        """Set the sampler's device parameters and size the result buffers."""
        self.mode = params.mode(self.vocab_size)
        self.temperature.fill_(params.temperature if params.temperature > 0 else 1.0)
        self.top_p.fill_(params.top_p)
        stop = list(params.stop_ids()) + [-1] * (MAX_STOP_TOKENS - len(params.stop_ids()))
        self.stop_ids.copy_(self._h2d(stop), non_blocking=True)
        self.active.zero_()
        self.res_width = max_gen
        dev = self.device
        self.res_tok = torch.zeros(num_seqs, max_gen, dtype=torch.long, device=dev)
        self.res_lp = torch.zeros(num_seqs, max_gen, dtype=torch.float32, device=dev)
        self.res_slp = torch.zeros_like(self.res_lp)
        self.res_len = torch.zeros(num_seqs, dtype=torch.long, device=dev)

    def results(self):
        """(tokens, logprobs, sampled_logprobs [N, max_gen], lengths [N]) on the host."""
        return tuple(t.cpu() for t in (self.res_tok, self.res_lp, self.res_slp, self.res_len))

    def collect(self, slots: list[int], seq_ids: list[int]) -> None:
        """Copy finished slots' outputs to their result rows (before the slots are reused)."""
        s, r = self._h2d(slots), self._h2d(seq_ids)
        W = self.res_width
        self.res_tok.index_copy_(0, r, self.out_tok.index_select(0, s)[:, :W])
        self.res_lp.index_copy_(0, r, self.out_lp.index_select(0, s)[:, :W])
        self.res_slp.index_copy_(0, r, self.out_slp.index_select(0, s)[:, :W])
        self.res_len.index_copy_(0, r, self.counts.index_select(0, s))

    def _h2d(self, values) -> torch.Tensor:
        """Host int64 values (a list or a numpy array) on the device without synchronising
        (pinned, non-blocking: the pinned allocator keeps the buffer until the copy has run)."""
        t = torch.as_tensor(values, dtype=torch.long)
        if self.device.type != "cuda":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

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
        """Record one sampled token per row [B] and return the rows that finished [B] bool.
        Inactive rows (padding, or finished one step ago) change nothing that is kept: their
        outputs land past their length, their counters do not move."""
        # (index_put_ on whole state tensors: in place under torch.compile too; duplicate
        # indices occur only for the scratch slot)
        act = self.active[slots]
        cnt, pos = self.counts[slots], self.positions[slots]
        col = cnt.clamp(max=self.out_tok.shape[1] - 1)
        self.out_tok[slots, col] = tok
        self.out_lp[slots, col] = logprob
        self.out_slp[slots, col] = sampled
        stop = (tok.unsqueeze(1) == self.stop_ids).any(-1)
        fin = act & (stop | (cnt + 1 >= self.max_gen[slots]))
        inc = act.long()
        self.counts[slots] = cnt + inc
        self.positions[slots] = pos + inc
        self.tokens[slots] = torch.where(act, tok, self.tokens[slots])
        self.active[slots] = act & ~fin
        return fin

    def _sample_and_commit(self, slots, positions, h) -> torch.Tensor:
        logits = self._logits(h)
        u = self._uniforms(self.keys[slots], positions + 1)
        tok, lp, slp = sample(logits, self.mode, self.temperature, self.top_p, u,
                              self.fused_sampler)
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
        self.positions[slots] = t["last_pos"]
        self.keys[slots] = t["keys"]
        self.max_gen[slots] = t["max_gen"]
        # index_fill_, not `state[slots] = 0`: a Python scalar assigned through a CUDA index
        # tensor is copied from pageable host memory, a blocking copy that drained the device
        # queue at every prefill (2 stream synchronisations per prefill on an H200 trace,
        # bench/RESULTS.md 2026-11-30 session 6)
        self.counts.index_fill_(0, slots, 0)
        self.active.index_fill_(0, slots[:real], True)         # (not the dummy's scratch row)
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
        if dense is None:
            dense = self.prefill_attention == "dense" and dense_pays(plan, max_len)
        if dense:    # (compiled: a pad index even where no prompt is padded: one dense graph)
            add_pad_index(plan, max_len, always=self.prefill_compiled)
        num_prompts = len(plan["cu"]) - 1
        t = self._h2d_arrays(plan)             # one host-to-device copy for every index list
        packed = PackedInput(t["ids"], t["positions"], t["cu"].to(torch.int32), max_len)
        ctx = PrefillContext(self.cache, self.model.layer_start, packed, t["src"],
                             t["dst_slot"], t["dst_pos"],
                             (num_prompts, max_len, t.get("pad_index")) if dense else None)
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
        self.step_fin[:B] = self._sample_and_commit(slots, self.positions[slots], h)

    def _decode_hidden(self, slots: torch.Tensor, max_k: int) -> torch.Tensor:
        """slots [B] -> last hidden states [B, H] of the rows' current tokens (writes K/V)."""
        tok, pos = self.tokens[slots], self.positions[slots]
        cu_q = torch.arange(slots.shape[0] + 1, dtype=torch.int32, device=slots.device)
        ctx = DecodeContext(self.cache, self.model.layer_start, slots, pos, self.backend, max_k,
                            cu_q, self.cu_k_tail, self.positions if self.fused_rope else None)
        return self.model(PackedInput(tok, pos, cu_q, 1), attn_ctx=ctx)

    def _graph(self, bucket: int):
        """The decode graph of (sampler mode, bucket), captured on first use. Its warm-up and
        capture run on scratch rows only, so they can happen in the middle of a generation."""
        key = (self.mode, bucket)
        if key in self.graphs:
            return self.graphs[key]
        self.row_slots[:bucket].fill_(self.cache.scratch_slot)
        self._uploaded_rows = None
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):       # warm-up: cuBLAS / NCCL / allocator state
            self._decode_step(bucket, self.max_model_len)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        # torch.cuda.graph() without its gc.collect() and empty_cache(): captures happen again
        # after each free_cache(), inside a trainer with a large Python heap
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=self._graph_pool)
            try:
                self._decode_step(bucket, self.max_model_len)
            finally:
                graph.capture_end()
        if self._graph_pool is None:
            self._graph_pool = graph.pool()
        self.graphs[key] = graph
        return graph
