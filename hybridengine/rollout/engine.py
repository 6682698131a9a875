"""The built-in rollout engine: generate token ids for prompts with a KV cache, continuous
batching, batched sampling, per-token log-probs and, on CUDA, graph-captured decode steps.

The engine knows nothing about text: prompts are token-id lists; results are token ids, the
log-prob of each sampled token under the model's unmodified distribution at temperature 1
(`logprobs`, what the trainer recomputes) and under the processed sampling distribution
(`sampled_logprobs`; 0 for greedy), and a finish reason: 'stop' (a stop token, included in
token_ids) or 'length' (max_tokens, or the cache row of max_model_len tokens is full).

It runs on one generation-TP shard of the decoder (model.tp_group is the gen-TP group; build it
with sequence_parallel=False, one pipeline stage): every rank of the group calls generate with
the same prompts and parameters and gets the same tokens (see rollout.sampling). Roles, as in
nano-vllm: Scheduler (which sequences step next, pure Python), SlotAllocator / KVCache (cache
rows), ModelRunner (the only one touching device tensors and CUDA graphs).

Graphs and cache read parameters by address: update weights in place (copy_), or call
free_cache() after replacing parameter tensors; the engine also drops its graphs when it sees
new parameter addresses. free_cache() releases the KV cache between phases; the next generate
allocates it again.
"""
from __future__ import annotations

import math
import os
import time
from collections import deque
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from hybridengine.parallel.tensor import all_reduce
from hybridengine.rollout.kv_cache import SlotAllocator
from hybridengine.rollout.model_runner import ModelRunner, Pending
from hybridengine.rollout.paged_runner import PagedModelRunner
from hybridengine.rollout.paged_scheduler import PagedScheduler
from hybridengine.rollout.rollout_config import RolloutConfig
from hybridengine.rollout.sampling import SamplingParams, sequence_key
from hybridengine.rollout.scheduler import Scheduler, Sequence


@dataclass
class GenerationResult:
    prompt_index: int
    sample_index: int
    token_ids: list[int]
    logprobs: list[float]
    sampled_logprobs: list[float]
    finish_reason: str          # 'stop' | 'length'


def check_prompts(prompts: list[list[int]], max_model_len: int, vocab_size: int | None) -> None:
    """One-line errors for prompts a rollout engine cannot take; vocab_size=None leaves the
    token ids to the caller (the built-in engine checks them per prefill, vectorised)."""
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")
        if len(p) >= max_model_len:
            raise ValueError(f"prompt {i} has {len(p)} tokens; max_model_len={max_model_len} "
                             f"leaves no room for a response")
        if vocab_size is None:
            continue
        lo, hi = min(p), max(p)
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"prompt {i} has token id {lo if lo < 0 else hi} outside the "
                             f"vocabulary [0, {vocab_size})")


def max_logprob_gap(model, prompts: list[list[int]], results) -> float:
    """Max |engine log-prob - training-forward log-prob| over the sampled tokens of `results`
    (the forward of the same model on prompt + response, packed): the rollout's numerics check."""
    from hybridengine.models.attention import PackedInput
    seqs = [prompts[r.prompt_index] + r.token_ids for r in results]
    device = next(model.parameters()).device
    with torch.no_grad():
        packed = PackedInput.from_lengths(torch.tensor(sum(seqs, []), device=device),
                                          [len(s) for s in seqs])
        logp, _ = model.logprob_entropy(model(packed), torch.roll(packed.input_ids, -1))
    worst, start = 0.0, 0
    for r, s in zip(results, seqs):
        ref = logp[start + len(s) - len(r.token_ids) - 1: start + len(s) - 1].float().cpu()
        worst = max(worst, (torch.tensor(r.logprobs) - ref).abs().max().item())
        start += len(s)
    return worst


class Engine:
    """Engine(model, RolloutConfig(...)).generate(prompts, params) -> results ordered
    prompt-major (prompt i, sample j at i·n + j).

    The settings (KV budget, CUDA graphs, attention backends, compile modes, kernel settings)
    are one RolloutConfig (rollout/rollout_config.py), which checks what it can on its own;
    here the checks that need the model: max_model_len (None: the model's
    max_position_embeddings) and max_prefill_tokens against it. self.config holds the resolved
    max_model_len. device / dtype, if given, must be the model's (a caller's expectation,
    checked: the engine never moves the model).

    After generate, self.stats: seconds and steps per phase, num_seqs, num_slots (sequences the
    KV cache holds at once), max_concurrent (the most that ran at once) and num_waited (those
    that found every slot taken: the batch ran in waves), num_preemptions (0 with static rows).
    With kv_layout="paged" (rollout/paged_runner.py: blocks, prefix sharing, preemption by
    recompute; CUDA graphs, compiled steps and the Triton paged decode as the static layout's),
    num_slots counts rows (max_num_seqs), and num_blocks, num_prefix_cached_tokens (prompt
    tokens whose prefill a cached prefix skipped), kv_blocks_peak and kv_tokens_at_peak (the
    most blocks held at once, and the distinct tokens in them then: BlockTables) join.
    """

    def __init__(self, model, config: RolloutConfig = RolloutConfig(), *, device=None,
                 dtype: torch.dtype | None = None):
        max_model_len = config.max_model_len or model.cfg.max_position_embeddings
        _check_model(model, device, dtype)
        if max_model_len < 2:
            raise ValueError(f"max_model_len={max_model_len} must be >= 2")
        if config.max_prefill_tokens < max_model_len:
            raise ValueError(f"max_prefill_tokens={config.max_prefill_tokens} must be >= "
                             f"max_model_len={max_model_len} (a prompt is prefilled in one step)")
        self.model, self.max_model_len = model, max_model_len
        self.config = replace(config, max_model_len=max_model_len)
        self.paged = config.kv_layout == "paged"
        self.runner = (PagedModelRunner if self.paged else ModelRunner)(model, self.config,
                                                                         max_model_len)
        # Steps whose finished flags are read only after the next step is queued: 1 on CUDA
        # (the host never waits for the step it just launched); tests set 1 on CPU too.
        self.steps_in_flight = 1 if self.runner.device.type == "cuda" else 0
        self.stats: dict = {}

    def free_cache(self) -> None:
        """Release the KV cache, the decode graphs and the per-slot state."""
        self.runner.free()

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 prompt_indices: list[int] | None = None,
                 max_tokens: list[int] | None = None) -> list[GenerationResult]:
        """Results ordered prompt-major (prompt i, sample j at i·n + j). Sample j of prompt i
        draws from the random stream of (seed, prompt_indices[i]·n + j), so a caller that hands
        each replica a share of one global batch (the prompts' global indices, one seed for all)
        samples the same tokens at any number of replicas (default: 0, 1, 2, ...). max_tokens:
        a budget per prompt instead of params.max_tokens (a benchmark's response lengths)."""
        t_start = time.perf_counter()
        # token ids: checked by each prefill's plan (numpy) rather than here in Python, where
        # min/max over every prompt cost ~2-3 ms before the first step could start
        check_prompts(prompts, self.max_model_len, None)
        if not prompts:
            return []
        seed = params.seed if params.seed is not None else self._shared_seed()
        # prompts as given (lists of ints, numpy or tensor ids alike: the prefill plan reads
        # them through numpy); a copy per token cost ~15 ms per 131k prompt tokens
        index = prompt_indices if prompt_indices is not None else range(len(prompts))
        budget = max_tokens if max_tokens is not None else [params.max_tokens] * len(prompts)
        if len(budget) != len(prompts) or min(budget) < 1:
            raise ValueError(f"max_tokens: one budget >= 1 per prompt ({len(prompts)} prompts)")
        seqs = [Sequence(i * params.n + j, i, p if isinstance(p, list) else list(p),
                         min(budget[i], self.max_model_len - len(p)),
                         sequence_key(seed, index[i] * params.n + j))
                for i, p in enumerate(prompts) for j in range(params.n)]
        runner = self.runner
        runner.allocate()
        runner.begin(params, len(seqs), max(s.max_gen for s in seqs))
        if self.paged:
            sched = PagedScheduler(runner.block_tables(), runner.num_slots,
                                   self.config.max_prefill_tokens)
        else:
            sched = Scheduler(SlotAllocator(runner.num_slots), self.config.max_prefill_tokens)
        # longest prompts first for the dense prefill (stable: a prompt's samples stay together);
        # the order of admission changes no sequence's tokens (each has its own random key)
        for s in sorted(seqs, key=lambda s: -len(s.prompt)) \
                if runner.prefill_attention == "dense" else seqs:
            sched.add(s)
        timer = _StepTimer(runner.device)
        (self._run_paged if self.paged else self._run)(sched, timer)
        t_run = time.perf_counter()
        out = self._results(seqs, params)
        # host seconds before the first step and after the last one was retired (wall clock)
        host = dict(host_setup_s=timer.t0 - t_start, host_results_s=time.perf_counter() - t_run)
        self.stats = dict(timer.totals(), **host, num_seqs=len(seqs), num_slots=runner.num_slots,
                          max_concurrent=sched.max_running, num_waited=sched.num_waited,
                          num_generated_tokens=sum(len(r.token_ids) for r in out),
                          attn_backend=runner.backend, prefill_attention=runner.prefill_attention,
                          cuda_graphs=runner.use_graphs, kv_layout=self.config.kv_layout,
                          num_preemptions=sched.num_preemptions if self.paged else 0)
        if self.paged:
            self.stats.update(num_blocks=runner.num_blocks,
                              num_prefix_cached_tokens=sched.num_prefix_cached_tokens,
                              kv_blocks_peak=sched.tables.peak_blocks,
                              kv_tokens_at_peak=sched.tables.tokens_at_peak)
        return out

    def _run(self, sched: Scheduler, timer: "_StepTimer") -> None:
        """Prefill whenever a waiting sequence fits, else decode every running one; retire
        finished sequences `steps_in_flight` launches late."""
        pending: deque[Pending] = deque()
        while sched.has_unfinished:
            batch = sched.schedule_prefill()
            if batch:
                with timer("prefill"):
                    pending.append(self.runner.prefill(batch))
            else:
                rows = sched.decode_rows()
                if pending and _out_of_tokens(rows):   # all finished on the device already
                    self._retire(pending.popleft(), sched)
                    continue
                max_k = min(self.max_model_len, max(s.num_cached for s in rows) + 1)
                with timer("decode"):
                    pending.append(self.runner.decode([s.slot for s in rows], max_k))
                for s in rows:
                    s.num_cached += 1
            while len(pending) > self.steps_in_flight:
                self._retire(pending.popleft(), sched)
        while pending:
            self._retire(pending.popleft(), sched)

    def _run_paged(self, sched: PagedScheduler, timer: "_StepTimer") -> None:
        """_run over blocks: before a decode step that lacks blocks, retire every step in
        flight (the host must know which rows still run and how many tokens each has), then
        preempt the youngest and requeue them with their generated tokens."""
        pending: deque[Pending] = deque()
        while sched.has_unfinished:
            groups = sched.schedule_prefill()
            if groups:
                with timer("prefill"):
                    pending.append(self.runner.prefill(groups, sched.tables))
            else:
                rows = sched.decode_rows()
                if pending and (not rows or _out_of_tokens(rows)):
                    self._retire(pending.popleft(), sched)
                    continue
                if not rows:
                    raise RuntimeError("paged scheduler: sequences wait but none runs or fits")
                if sched.must_preempt():
                    while pending:
                        self._retire(pending.popleft(), sched)
                    out = sched.preempt()
                    sched.requeue(out, [self.runner.generated(s.slot, s.num_cached -
                                                              len(s.prompt) + 1) for s in out])
                    continue
                max_k = min(self.max_model_len, max(s.num_cached for s in rows) + 1)
                slots = sched.append_slots(rows)
                ids = [s.seq_id for s in rows]
                width = max(math.ceil(max_k / sched.tables.block_size),
                            max(len(sched.tables.tables[i]) for i in ids))
                with timer("decode"):
                    pending.append(self.runner.decode([s.slot for s in rows], slots, width,
                                                      max_k))
                for s in rows:
                    s.num_cached += 1
            while len(pending) > self.steps_in_flight:
                self._retire(pending.popleft(), sched)
        while pending:
            self._retire(pending.popleft(), sched)

    def _retire(self, pending: Pending, sched: Scheduler) -> None:
        slots = pending.finished_slots()
        if slots:
            done = [sched.finish(s) for s in slots]
            self.runner.collect(slots, [s.seq_id for s in done])

    def _results(self, seqs: list[Sequence], params: SamplingParams) -> list[GenerationResult]:
        tok, lp, slp, lens = (t.numpy() for t in self.runner.results())
        stop = set(params.stop_ids())
        lens = lens.tolist()
        out = []
        for s in seqs:          # numpy rows to lists: ~1/3 faster than torch's (CPU machine)
            n = lens[s.seq_id]
            ids = tok[s.seq_id, :n].tolist()
            reason = "stop" if ids and ids[-1] in stop else "length"
            out.append(GenerationResult(s.prompt_index, s.seq_id - s.prompt_index * params.n, ids,
                                        lp[s.seq_id, :n].tolist(), slp[s.seq_id, :n].tolist(),
                                        reason))
        return out

    def _shared_seed(self) -> int:
        """A fresh random seed, the same on every rank of the generation-TP group."""
        seed = torch.tensor([int.from_bytes(os.urandom(7), "little")], device=self.runner.device)
        return int(all_reduce(seed, self.model.tp_group, dist.ReduceOp.MAX).item())


def _out_of_tokens(rows: list[Sequence]) -> bool:
    """Whether every row has generated its max_gen tokens in the steps launched so far (the
    prefill's token + one per decode step counted in num_cached): then each has finished on the
    device and a further step would compute nothing that is kept."""
    return all(s.num_cached - len(s.prompt) + 1 >= s.max_gen for s in rows)


def _check_model(model, device, dtype) -> None:
    if getattr(model, "sp", False):
        raise ValueError("the generation model must be built with sequence_parallel=False")
    if model.pp_size != 1:
        raise ValueError(f"the rollout engine runs one pipeline stage; got pp_size={model.pp_size}")
    param = next(model.parameters())
    dev = torch.device(device) if device is not None else param.device
    if dev.type != param.device.type or (dev.index is not None and dev != param.device):
        raise ValueError(f"device={device} but the model's parameters are on {param.device}")
    if dtype is not None and dtype != param.dtype:
        raise ValueError(f"dtype={dtype} but the model's parameters are {param.dtype}")


class _StepTimer:
    """Time spent per phase: CUDA events around each step (summed after the final sync), or
    wall clock on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.spans: list[tuple[str, object, object]] = []
        self.t0 = time.perf_counter()

    def __call__(self, phase: str):
        return _Span(self, phase)

    def totals(self) -> dict:
        out = {"prefill_s": 0.0, "decode_s": 0.0, "num_prefill_steps": 0, "num_decode_steps": 0}
        if self.cuda:
            torch.cuda.synchronize()
        for phase, a, b in self.spans:
            out[f"{phase}_s"] += a.elapsed_time(b) / 1e3 if self.cuda else b - a
            out[f"num_{phase}_steps"] += 1
        out["total_s"] = time.perf_counter() - self.t0
        return out


class _Span:
    def __init__(self, timer: _StepTimer, phase: str):
        self.timer, self.phase = timer, phase

    def _mark(self):
        if self.timer.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def __enter__(self):
        self.start = self._mark()

    def __exit__(self, *exc):
        self.timer.spans.append((self.phase, self.start, self._mark()))
