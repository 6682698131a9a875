"""Full RL steps on the seed's configuration: PPO (critic, GAE) or GRPO (n=8, no critic).

Every phase of the real trainer runs: rollout (built-in engine), reshard, reward, old/ref
log-probs, values, critic and actor updates. Model: a Qwen2.5 shape (--model 0.5b, the default,
1.5b, 3b or 7b: QWEN25) or another family's (qwen3-0.6b, qwen3-1.7b, gemma2-2b: models/shapes.py)
with random bf16 weights, saved once as an HF directory with the Qwen2.5 tokenizer (Qwen3's but
for its thinking tokens; Gemma 2 reads only the first 151,665 of its 256,000 embedding rows).
Workloads:
  seed   GSM8K train prompts with the seed's instruction and chat template (max 512 tokens),
         responses forced to 256 tokens (random weights rarely stop)
  fixed  512-token prompts + 256-token responses
Batch: 256 sequences per step (PPO: 256 prompts; GRPO: 32 prompts x n=8), micro-batches packed
to a token budget. JSON to stdout (per-step metrics of the timed steps, and their means; the
steady state: median and slowest timed step, with its number; compile seconds per step,
timing_s/compile; the memory plan's peak per rank (rl.memory, "plan") beside the measured one,
the largest perf/max_memory_allocated_gb of any step (CUDA only), and their ratio; per phase,
"phases": the plan's total beside the largest perf/max_memory_allocated_gb/<phase>, the trainer's
rollout phase against the plan's reshard and rollout, whichever is larger); progress to stderr.

    python tools/bench_ppo.py --workload seed --algo ppo [--model 0.5b] [--steps 10 --warmup 3]
        [--tokenizer DIR] [--gsm8k FILE] [--rollout-compile] [--train-compile] [--defaults]
        [--val-every K] [--offload grads,optimizer] [--lora RANK [--lora-alpha A]] [--profile]
        [--host-profile]
        [--set KEY=VALUE ...]
--rollout-compile compiles the rollout's decode step and prefill (rollout.compile{,_prefill}).
--defaults leaves CUDA graphs, compilation and micro-batching to the config's defaults (on CUDA
configs/cuda_defaults.yaml) instead of setting them from the flags above and --max-tokens.
--val-every K validates (greedy, n = 1) on GSM8K test prompts after every K-th step, as the
trainer's test_freq does (its seconds: "val_s").
--response-lengths lognormal:MEAN:SIGMA stops each prompt's responses at a length drawn every step
(mean MEAN, capped at data.max_response_length, e.g. --set data.max_response_length=4096).
--offload moves those parts of the actor and critic to the host outside the phases that use
them (megatron.*_offload, rl.residency); --profile runs one more step under torch.profiler and
adds its kernel table per phase (tools/profiling.py) as "profile"; --host-profile one more under
cProfile and CUDA's sync debug mode ("host_profile": functions by host time, synchronising lines).
    python tools/bench_ppo.py --tiny          # CPU smoke run (stories260k, keyword prompts)
    python tools/bench_ppo.py --prepare DIR [--workload ...]   # model + prompts in DIR, and
        # DIR/overrides.txt: launch/ppo.py's arguments for the same run (torchrun, several GPUs)
    python tools/bench_ppo.py --summarize DIR/metrics.jsonl [--warmup 3]   # its steady state
    python tools/bench_ppo.py --plan-for 139.8 [--host-gib 108] --model 7b --algo grpo --defaults
        # no GPU, no weights: what offload=auto picks and the plan's table for a CUDA device of
        # that many GiB (and a host with that much for offloaded state), as JSON
A run logs its setup's seconds, the memory plan's table, and each phase's seconds and the device
memory allocated after it to stderr as they happen.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
from hybridengine.compiling import compile_breakdown, compile_timers  # noqa: E402
from hybridengine.config import load_config  # noqa: E402
from hybridengine.kernels.logprob import cuda_extension  # noqa: E402
from hybridengine.models.hf_config import hf_config  # noqa: E402
from hybridengine.models.shapes import SHAPES  # noqa: E402
from hybridengine.rl.data import to_verl_row  # noqa: E402
from hybridengine.rl.memory import (device_budget, memory_report, plan_run_memory,  # noqa: E402
                                    resolve_and_check)
from hybridengine.rl.residency import OFFLOAD_FLAGS  # noqa: E402
from hybridengine.rl.trainer import Trainer  # noqa: E402
from hybridengine.train.compile_layers import layer_group_size  # noqa: E402
from bench_memory import memory_check, phase_peaks  # noqa: E402
from profiling import GcPauses, full_collection_ms, host_diagnosis, profile_ranges  # noqa: E402

SHARED = ROOT.parent / "shared"
KEYS = ["perf/throughput", "perf/time_per_step", "perf/mfu", "perf/mfu/update_actor",
        "perf/mfu/update_critic", "perf/mfu/update_critic_actor", "perf/mfu/old_log_prob",
        "perf/mfu/ref", "perf/mfu/values",
        "perf/gen_tokens_per_s", "perf/max_memory_allocated_gb", "perf/max_memory_reserved_gb",
        "perf/total_num_tokens",
        "timing_s/step", "timing_s/gen", "timing_s/reshard", "timing_s/reward",
        "timing_s/old_log_prob", "timing_s/ref", "timing_s/values", "timing_s/adv",
        "timing_s/update_critic", "timing_s/update_actor", "timing_s/update_critic_actor",
        "timing_s/offload", "timing_s/compile",
        "reshard/bytes_per_rank", "rollout/num_slots", "rollout/max_concurrent",
        "response_length/mean", "prompt_length/mean",
        # per step: a drift here is memory that one step leaves to the next
        "perf/max_memory_allocated_gb/rollout", "perf/max_memory_allocated_gb/update_actor"]
# Qwen2.5 base models (their config.json): hidden, intermediate, layers, heads, KV heads,
# vocabulary, tied embeddings; all: rope_theta 1e6, rms_norm_eps 1e-6, 32768 positions
QWEN25 = {"0.5b": (896, 4864, 24, 14, 2, 151936, True),
          "1.5b": (1536, 8960, 28, 12, 2, 151936, True),
          "3b": (2048, 11008, 36, 16, 2, 151936, True),
          "7b": (3584, 18944, 28, 28, 4, 152064, False)}
FAMILIES = ("qwen3-0.6b", "qwen3-1.7b", "gemma2-2b", "qwen3-moe-1b",   # models.shapes.SHAPES
            "qwen3-dense-active")


def log(msg: str) -> None:
    print(f"[bench_ppo] {msg}", file=sys.stderr, flush=True)


def qwen25_config(size: str):
    """The transformers Qwen2Config of Qwen2.5-<size> (a key of QWEN25)."""
    from transformers import Qwen2Config
    hidden, intermediate, layers, heads, kv_heads, vocab, tied = QWEN25[size]
    return Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, tie_word_embeddings=tied,
                       max_position_embeddings=32768, rms_norm_eps=1e-6,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def model_config(size: str):
    """The transformers config of --model `size`: a key of QWEN25 or one of FAMILIES."""
    return qwen25_config(size) if size in QWEN25 else hf_config(SHAPES[size][0])


def model_name(size: str) -> str:
    return f"qwen2.5-{size}" if size in QWEN25 else size


def make_model(out: Path, tokenizer_dir: Path, size: str = "0.5b") -> Path:
    """A random HF directory (bf16) of --model `size`'s shape with the Qwen2.5 tokenizer."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    cuda = torch.cuda.is_available()
    # initialised in bf16: an fp32 model cast afterwards would hold 30 GB more at 7B
    with torch.device("cuda" if cuda else "cpu"):
        model = AutoModelForCausalLM.from_config(model_config(size), dtype=torch.bfloat16)
    model.save_pretrained(str(out))
    del model
    if cuda:        # the writer's weights are no part of the run's measured peak
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    for f in tokenizer_dir.iterdir():
        if f.is_file() and f.suffix in (".json", ".txt", ".model", ".jinja"):
            shutil.copy2(f, out / f.name)
    return out


def make_data(out: Path, workload: str, gsm8k: Path, num_rows: int) -> Path:
    rows = []
    if workload == "seed":
        for i, line in enumerate(gsm8k.read_text().splitlines()[:num_rows]):
            r = json.loads(line)
            rows.append(to_verl_row(r["question"], r["answer"], "train", i))
    else:       # long text truncated on the left to exactly max_prompt_length tokens
        words = "the cat sat on a mat and then it ran to see how many numbers add up".split()
        for i in range(num_rows):
            text = " ".join(words[(i + k) % len(words)] for k in range(700))
            rows.append({"data_source": "openai/gsm8k", "prompt": [{"role": "user",
                         "content": text}], "reward_model": {"style": "rule",
                                                             "ground_truth": "1"},
                         "extra_info": {"index": i}})
    path = out / f"{workload}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def overrides(args, model_dir: Path, data: Path, out: Path, val: Path | None = None) -> list[str]:
    ppo = args.algo == "ppo"
    prompts = 256 if ppo else 32
    ov = [f"data.train_files={data}", f"data.val_files={val or 'null'}",
          f"data.train_batch_size={prompts}", "data.max_prompt_length=512",
          "data.max_response_length=256",
          f"data.truncation={'left' if args.workload == 'fixed' else 'error'}",
          f"actor_rollout_ref.model.path={model_dir}",
          f"actor_rollout_ref.rollout.n={1 if ppo else 8}",
          "actor_rollout_ref.rollout.ignore_eos=true",
          "actor_rollout_ref.rollout.max_num_seqs=256",
          "actor_rollout_ref.rollout.gpu_memory_utilization=0.5",
          f"actor_rollout_ref.actor.ppo_mini_batch_size={64 if ppo else 32}",
          "trainer.val_before_train=false", f"trainer.test_freq={args.val_every or -1}",
          "trainer.save_freq=-1",
          f"trainer.total_training_steps={total_steps(args)}",
          f"trainer.default_local_dir={out}", "trainer.logger=['console']"]
    if not args.defaults:
        ov += ["actor_rollout_ref.rollout.enforce_eager=false",
               f"actor_rollout_ref.rollout.compile={str(args.rollout_compile).lower()}",
               f"actor_rollout_ref.rollout.compile_prefill={str(args.rollout_compile).lower()}",
               f"actor_rollout_ref.actor.use_torch_compile={str(args.train_compile).lower()}",
               "actor_rollout_ref.actor.use_dynamic_bsz=true",
               f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={args.max_tokens}",
               f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={2 * args.max_tokens}",
               f"actor_rollout_ref.ref.log_prob_max_token_len_per_gpu={2 * args.max_tokens}"]
    if ppo:
        ov += [f"critic.model.path={model_dir}", "algorithm.adv_estimator=gae"]
        ov += [] if args.defaults else [f"critic.ppo_max_token_len_per_gpu={args.max_tokens}",
                                        f"critic.forward_max_token_len_per_gpu={2 * args.max_tokens}"]
    else:
        ov += ["--config", str(ROOT / "configs" / "grpo.yaml")]
    return ov


def total_steps(args) -> int:
    """Warm-up and timed steps, and one more for each diagnosis (--profile, --host-profile)."""
    return args.warmup + args.steps + int(args.profile) + int(args.host_profile)


def tiny_overrides(args, out: Path) -> list[str]:
    return ["--config", str(ROOT / "configs" / "tiny.yaml"),
            f"actor_rollout_ref.model.path={ROOT / 'models' / 'stories260k'}",
            f"data.train_files={ROOT / 'data' / 'stories_keywords' / 'train.jsonl'}",
            "data.val_files=null", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
            "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1",
            f"trainer.total_training_steps={total_steps(args)}",
            f"trainer.default_local_dir={out}"]


PHASES = ["rollout", "prefill", "decode", "reshard", "old_log_prob", "ref", "values", "adv",
          "update_critic", "update_actor", "update_critic_actor"]


def extra_overrides(args) -> list[str]:
    ov = list(args.set)
    if args.alternate_wgrad_fusion:         # built fused; side b turns the layers' switch off
        ov += [f"{role}.megatron.gradient_accumulation_fusion=true"
               for role in ("actor_rollout_ref.actor", "critic")]
    for part in filter(None, args.offload.split(",")):
        if part not in OFFLOAD_FLAGS:
            raise SystemExit(f"--offload {part!r}: choose from {', '.join(OFFLOAD_FLAGS)}")
        ov += [f"{role}.megatron.{OFFLOAD_FLAGS[part]}=true"
               for role in ("actor_rollout_ref.actor", "critic")]
    if args.lora:               # a LoRA actor: rank, alpha (default 2 x rank), every linear
        alpha = args.lora_alpha or 2 * args.lora
        ov += [f"actor_rollout_ref.model.lora_rank={args.lora}",
               f"actor_rollout_ref.model.lora_alpha={alpha}",
               "actor_rollout_ref.model.lora_save_merged=false"]
    return ov


def side_a_at(step: int, warmup: int) -> bool:
    """An --alternate-* switch at `step` (True: side a): warm-up steps alternate (both paths
    warm); the timed ones go a b b a a b b a ..., so that a drift across the run (clocks, the
    host) weighs on both alike."""
    if step <= warmup:
        return step % 2 == 1
    return (step - warmup - 1) % 4 in (0, 3)


def forget_prefill_peak(trainer) -> None:
    """--alternate-prefill-probe's side b: the built-in rollout measures its prefill's peak again
    at its next cache allocation (as every step did before session 37)."""
    engine = trainer.generator.engine
    if engine is not None and hasattr(engine, "runner"):
        engine.runner._prefill_peak = None


def fused_linears(trainer) -> list:
    """The linear layers whose weight gradient the engines accumulate into main_grad
    (gradient_accumulation_fusion: parallel.wgrad_accumulation), both trained roles'."""
    roles = [r for r in (trainer.actor, trainer.critic) if r is not None]
    return [m for r in roles for m in r.engine.model.modules()
            if getattr(m, "fuse_wgrad", False)]


def side_means(steps: list[dict], flag: str, a: str, b: str) -> dict:
    """An --alternate-* run's means of each side: {a: the steps whose `flag` is true, b: the
    others}."""
    return {a: means([s for s in steps if s[flag]]), b: means([s for s in steps if not s[flag]])}


def means(rows: list[dict]) -> dict:
    """Each numeric key's mean over the rows that have it (the phases differ between the
    interleaved and the sequential steps)."""
    keys = dict.fromkeys(k for r in rows for k, v in r.items() if not isinstance(v, bool))
    return {k: sum(r[k] for r in rows if k in r) / sum(k in r for r in rows) for k in keys}


def steady_state(step_s: dict[int, float], after: int) -> dict:
    """Median and slowest of the step times of steps > `after` (step number -> seconds), the
    slowest step's number and its ratio to the median."""
    timed = {k: v for k, v in step_s.items() if k > after}
    if not timed:
        return {}
    values = sorted(timed.values())
    mid = len(values) // 2
    median = values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2
    slowest = max(timed, key=timed.get)
    return {"after_step": after, "num_steps": len(timed), "median_s": median,
            "slowest_s": timed[slowest], "slowest_step": slowest,
            "slowest_over_median": timed[slowest] / median}


def summarize(metrics_file: Path, after: int) -> dict:
    """steady_state and compile seconds of a launch/ppo.py run (its metrics.jsonl)."""
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    step_s = {r["step"]: r["timing_s/step"] for r in rows if "timing_s/step" in r}
    compile_s = {r["step"]: r["timing_s/compile"] for r in rows if "timing_s/compile" in r}
    return {"metrics": str(metrics_file), "steady": steady_state(step_s, after),
            "compile_s": sum(compile_s.values()), "compile_s_by_step": compile_s,
            "step_s": step_s}


def prepare(args, work: Path) -> tuple[list[str], Path]:
    """The model, the prompts (and validation prompts) in `work`; the run's overrides."""
    log(f"writing a random {model_name(args.model)}-shaped model and the prompts")
    work.mkdir(parents=True, exist_ok=True)
    model_dir = make_model(work / "model", Path(args.tokenizer), args.model)
    data = make_data(work, args.workload, Path(args.gsm8k), num_rows=2048)
    val = None
    if args.val_every:
        val = work / "val.jsonl"
        rows = [json.loads(line) for line in Path(args.gsm8k_test).read_text().splitlines()]
        val.write_text("".join(json.dumps(to_verl_row(r["question"], r["answer"], "test", i))
                               + "\n" for i, r in enumerate(rows[:args.val_prompts])))
    return overrides(args, model_dir, data, work / "out", val) + extra_overrides(args), model_dir


def _log_phases(trainer) -> None:
    """Log each phase of the trainer's steps as it ends (with the offload moves into it), with
    the device memory still allocated after it: where a slow first step (compilation) spends
    its time, and which phase leaves memory to the next step."""
    phase = trainer._phase

    @contextlib.contextmanager
    def logged(name, *a, **kw):
        t0 = time.perf_counter()
        with phase(name, *a, **kw):
            yield
        held = f", {torch.cuda.memory_allocated() / 2**30:.2f} GiB allocated after it" \
            if torch.cuda.is_available() else ""
        log(f"  {name}: {time.perf_counter() - t0:.1f} s{held}")
    trainer._phase = logged


UNCHECKED_HOST_GIB = 2.0 ** 20      # --plan-for without --host-gib: a host that holds anything


def plan_for(args) -> dict:
    """--plan-for: the run's config with a config-only model directory (no weights), planned
    for a CUDA device of args.plan_for GiB on this machine: offload=auto's choice, preflight's
    error (if any), the table's lines, each phase's GiB, the host bytes."""
    from hybridengine.config import validate_config
    from hybridengine.models.hf import read_model_config
    work = Path(tempfile.mkdtemp(prefix="bench_ppo_plan_"))
    try:
        model_dir = work / "model"
        model_config(args.model).save_pretrained(str(model_dir))
        data = make_data(work, args.workload, Path(args.gsm8k), num_rows=64)
        ov = overrides(args, model_dir, data, work / "out") + extra_overrides(args) + [
            "trainer.device=cuda", f"trainer.device_memory_gb={args.plan_for}",
            f"trainer.host_memory_gb={args.host_gib or UNCHECKED_HOST_GIB}"]
        cfg = load_config(ov)
        layout = validate_config(cfg, 1)
        model = read_model_config(str(model_dir))
        critic = model if args.algo == "ppo" else None
        cuda = torch.device("cuda")
        chosen, errors = resolve_and_check(cfg, layout, model, critic, cuda)
        lines = memory_report(cfg, layout, model, critic, cuda)
        plan = plan_run_memory(cfg, layout, model, critic, cuda, device_budget(cfg, cuda))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for line in lines + errors:
        log(line)
    return {"model": model_name(args.model), "algo": args.algo, "device_gib": args.plan_for,
            "host_gib": args.host_gib, "auto_offload": chosen, "errors": errors,
            "kv_layout": cfg.actor_rollout_ref.rollout.kv_layout,
            "kv_slots": plan.kv_slots, "peak_phase": plan.peak_phase,
            "phases_gib": {p: plan.total(p) / 2**30 for p in plan.phases},
            "host_gib_per_rank": plan.host / 2**30}


def _draw_response_lengths(trainer, spec: str) -> None:
    """--response-lengths lognormal:MEAN:SIGMA: every generation of the trainer's rollout stops
    each prompt's responses at a budget drawn afresh (bench_rollout's draw, capped at the
    sampling's max_tokens; one draw per call over the global batch, indexed by the prompt's
    global index, so every replica reads the same budgets): random weights, which rarely stop,
    then spread their lengths as reasoning outputs do."""
    from bench_rollout import response_lengths
    generator, calls = trainer.generator, itertools.count(1)
    make_engine = generator._rollout_engine

    def engine_for(model):
        engine = make_engine(model)
        if getattr(engine, "bench_generate", None) is None:
            engine.bench_generate = engine.generate

            def generate(prompts, params, prompt_indices=None, max_tokens=None):
                index = prompt_indices if prompt_indices is not None else range(len(prompts))
                size = max(trainer.cfg.data.train_batch_size, max(index, default=0) + 1)
                budgets = response_lengths(spec, size, params.max_tokens, seed=next(calls))
                return engine.bench_generate(prompts, params, prompt_indices,
                                             [budgets[i] for i in index])
            engine.generate = generate
        return engine
    generator._rollout_engine = engine_for


def run(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="bench_ppo_"))
    if args.tiny:
        cfg = load_config(tiny_overrides(args, work / "out") + extra_overrides(args))
    else:
        cfg = load_config(prepare(args, work)[0])
    os.environ.setdefault("HYBRIDENGINE_NO_PROGRESS", "1")
    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    log(f"setup {time.perf_counter() - t0:.1f} s")
    if torch.cuda.is_available():       # JIT-built at its first use otherwise, inside step 1
        t0 = time.perf_counter()
        built = cuda_extension() is not None
        log(f"log-prob CUDA extension: {'loaded' if built else 'unavailable'} in "
            f"{time.perf_counter() - t0:.1f} s")
    critic_model = trainer.critic.engine.cfg if trainer.critic is not None else None
    for line in memory_report(trainer.cfg, trainer.layout, trainer.actor.engine.cfg,
                              critic_model, trainer.device):
        log(line)
    _log_phases(trainer)
    if args.response_lengths:
        _draw_response_lengths(trainer, args.response_lengths)
    if args.alternate_interleave and trainer.not_interleaved:
        raise SystemExit(f"--alternate-interleave: {trainer.not_interleaved}")
    # side b of --alternate-wgrad-fusion: the same layers on the unfused path (a bf16 weight
    # gradient that the optimizer's hook adds), read by the layer at each forward
    fused = fused_linears(trainer) if args.alternate_wgrad_fusion else []
    if args.alternate_wgrad_fusion and not fused:
        raise SystemExit("--alternate-wgrad-fusion: no linear layer fuses its weight gradient "
                         "(it needs trained weights that an optimizer gives a main_grad)")
    if fused and any(r is not None and r.engine.graphs is not None
                     for r in (trainer.actor, trainer.critic)):
        raise SystemExit("--alternate-wgrad-fusion: training CUDA graphs replay the path they "
                         "captured; run it without use_cuda_graph")
    batches = iter(trainer.sampler)
    steps, step_s, compile_s, val_s, peak_gb, phase_gb = [], {}, {}, {}, None, {}
    compile_records: list[str] = []
    compile_steps: dict[str, float] = {}
    gc_pauses, gc_by_step = GcPauses(), {}
    for step in range(1, args.warmup + args.steps + 1):
        side_a = side_a_at(step, args.warmup)
        if args.alternate_interleave:
            trainer.interleaved = side_a
        if args.alternate_prefill_probe and not side_a:
            forget_prefill_peak(trainer)
        for layer in fused:
            layer.fuse_wgrad = side_a
        t0 = time.perf_counter()
        m = trainer.train_step(step, next(batches), lambda: next(batches, None))
        step_s[step], compile_s[step] = m["timing_s/step"], m.get("timing_s/compile", 0.0)
        gc_by_step[step] = gc_pauses.take()
        if "perf/max_memory_allocated_gb" in m:
            peak_gb = max(peak_gb or 0.0, m["perf/max_memory_allocated_gb"])
        phase_peaks(phase_gb, m)
        log(f"step {step}: {time.perf_counter() - t0:.2f} s, "
            f"throughput {m.get('perf/throughput', 0):.0f} tok/s/GPU"
            + (f", compile {compile_s[step]:.1f} s" if compile_s[step] else "")
            + f", gc {sum(gc_by_step[step]['ms']):.1f} ms {gc_by_step[step]['collections']}")
        if step == 1:       # what step 1's compilations spent, cache warm or cold
            compile_records, compile_steps = compile_breakdown(), compile_timers()
            for line in compile_records:
                log(f"  compiled: {line}")
        if step > args.warmup:
            steps.append({k: m[k] for k in KEYS if k in m})
            if args.alternate_interleave:      # the two updates' seconds, either way
                steps[-1].update(interleaved=trainer.interleaved, **{"timing_s/updates": m.get(
                    "timing_s/update_critic_actor",
                    m.get("timing_s/update_critic", 0) + m.get("timing_s/update_actor", 0))})
            if args.alternate_prefill_probe:
                steps[-1]["prefill_peak_kept"] = side_a
            if fused:
                steps[-1]["wgrad_fused"] = side_a
            # on stderr as it happens: a run cut by its time limit still leaves its figures
            log(f"step {step} metrics: {json.dumps(steps[-1])}")
        if args.val_every and step % args.val_every == 0:
            t0 = time.perf_counter()
            trainer.validate()
            val_s[step] = time.perf_counter() - t0
            log(f"validation after step {step}: {val_s[step]:.2f} s")
    gc_pauses.close()
    gc_full = full_collection_ms()          # trainer.gc_freeze_freq's effect on one collection
    log(f"one full collection: {gc_full}")
    extra_steps = itertools.count(step + 1)      # the untimed, diagnosed steps after them

    def one_more_step():
        return trainer.train_step(next(extra_steps), next(batches), lambda: next(batches, None))
    profile = None
    if args.profile:
        profile = profile_ranges(one_more_step, PHASES)
        log("profiled one more step: " + ", ".join(
            f"{k} {v['kernel_ms']:.0f} ms" for k, v in profile.items()))
    host = None
    if args.host_profile:
        host = host_diagnosis(one_more_step)
        log(f"host profile of one more step: {sum(host['syncs'].values())} synchronising calls")
    shutil.rmtree(work, ignore_errors=True)
    mean = means(steps)
    alternate = side_means(steps, "interleaved", "interleaved", "sequential") \
        if args.alternate_interleave else None
    probe = side_means(steps, "prefill_peak_kept", "kept", "measured_each_step") \
        if args.alternate_prefill_probe else None
    wgrad = dict(side_means(steps, "wgrad_fused", "fused", "unfused"),
                 fused_linears=len(fused)) if fused else None
    return {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "workload": "tiny" if args.tiny else args.workload,
            "model": "stories260k" if args.tiny else model_name(args.model),
            "algo": "grpo" if args.tiny else args.algo, "sequences_per_step":
                cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n,
            "rollout_compile": cfg.actor_rollout_ref.rollout.compile,
            "compile_prefill": cfg.actor_rollout_ref.rollout.compile_prefill,
            "train_compile": cfg.actor_rollout_ref.actor.use_torch_compile,
            "train_layer_group": layer_group_size(),
            "cuda_graphs": not cfg.actor_rollout_ref.rollout.enforce_eager,
            "training_graphs": training_graphs(trainer),
            "defaults": args.defaults, "offload": args.offload, "overrides": args.set,
            "response_lengths": args.response_lengths,
            "kv_layout": trainer.cfg.actor_rollout_ref.rollout.kv_layout,    # auto resolved
            "cuda_allocator": trainer.cuda_allocator,       # auto resolved, as applied
            "steady": steady_state(step_s, args.warmup), "step_s": step_s,
            "compile_s": sum(compile_s.values()), "compile_s_by_step": compile_s,
            "compile_records_step1": compile_records, "compile_timers_step1": compile_steps,
            "gc_by_step": gc_by_step, "gc_full_collection": gc_full,
            "val_s": val_s, "mean": mean, "steps": steps,
            **memory_check(trainer, peak_gb, phase_gb),
            **({"alternate_interleave": alternate} if alternate is not None else {}),
            **({"alternate_prefill_probe": probe} if probe is not None else {}),
            **({"alternate_wgrad_fusion": wgrad} if wgrad is not None else {}),
            **({"profile": profile} if profile is not None else {}),
            **({"host_profile": host} if host is not None else {})}


def training_graphs(trainer) -> dict:
    """Per trained role: the training micro-batch shapes captured in CUDA graphs and the calls
    that ran eagerly past the cap (train.cuda_graphs), or null where the role runs eagerly."""
    roles = {"actor": trainer.actor, "critic": trainer.critic}
    return {name: None if role is None or role.engine.graphs is None else
            {"captures": role.engine.graphs.captures,
             "eager_calls": role.engine.graphs.eager_calls}
            for name, role in roles.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", choices=("seed", "fixed"), default="seed")
    ap.add_argument("--algo", choices=("ppo", "grpo"), default="ppo")
    ap.add_argument("--model", choices=(*QWEN25, *FAMILIES), default="0.5b",
                    help="the shape of the random model (not --tiny's)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps (after --warmup)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16384, help="token budget per micro-batch")
    ap.add_argument("--tokenizer", default=str(SHARED / "models" / "qwen2-tokenizer"))
    ap.add_argument("--gsm8k", default=str(SHARED / "data" / "gsm8k" / "train.jsonl"))
    ap.add_argument("--gsm8k-test", default=str(SHARED / "data" / "gsm8k" / "test.jsonl"))
    ap.add_argument("--rollout-compile", action="store_true")
    ap.add_argument("--train-compile", action="store_true", help="compile the training layers")
    ap.add_argument("--defaults", action="store_true",
                    help="graphs, compilation and micro-batching from the config's defaults")
    ap.add_argument("--val-every", type=int, default=0, help="validate every K steps (0: never)")
    ap.add_argument("--val-prompts", type=int, default=256, help="GSM8K test prompts validated")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--offload", default="", help="comma list of params,grads,optimizer")
    ap.add_argument("--lora", type=int, default=0, metavar="RANK",
                    help="a LoRA actor of this rank (actor_rollout_ref.model.lora_rank)")
    ap.add_argument("--lora-alpha", type=float, default=None, help="default: 2 x --lora")
    ap.add_argument("--alternate-interleave", action="store_true",
                    help="a same-run A/B of trainer.interleave_updates: the switch flips between "
                         "steps (timed ones a b b a ...); the JSON's alternate_interleave holds "
                         "each side's means")
    ap.add_argument("--alternate-prefill-probe", action="store_true",
                    help="a same-run A/B of the rollout's prefill-peak probe: kept from the "
                         "first step (a) or measured again at the step's cache allocation (b, "
                         "the code before session 37); the JSON's alternate_prefill_probe holds "
                         "each side's means")
    ap.add_argument("--alternate-wgrad-fusion", action="store_true",
                    help="a same-run A/B of gradient_accumulation_fusion (turned on for both "
                         "roles): fused (a) or the unfused path in the same layers (b); the "
                         "JSON's alternate_wgrad_fusion holds each side's means")
    ap.add_argument("--profile", action="store_true", help="kernel table per phase of a step")
    ap.add_argument("--host-profile", action="store_true",
                    help="one more step under cProfile and CUDA's sync debug mode: the host's "
                         "time by function and the lines that wait for the device")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="one more config override (repeatable)")
    ap.add_argument("--prepare", metavar="DIR", help="write model, prompts, overrides; no steps")
    ap.add_argument("--summarize", metavar="METRICS_JSONL", help="a launch/ppo.py run's steady "
                                                                 "state (steps > --warmup)")
    ap.add_argument("--response-lengths", default=None, metavar="lognormal:MEAN:SIGMA",
                    help="each prompt's responses stop at a length drawn per step (capped at "
                         "data.max_response_length; bench_rollout's draw)")
    ap.add_argument("--plan-for", type=float, metavar="GIB", help="plan only, for a CUDA device "
                    "of this many GiB (no GPU needed, no weights written)")
    ap.add_argument("--host-gib", type=float, default=None,
                    help="with --plan-for: host memory for offloaded state (default: no check)")
    args = ap.parse_args()
    if args.plan_for:
        print(json.dumps(plan_for(args)))
    elif args.summarize:
        print(json.dumps(summarize(Path(args.summarize), args.warmup)))
    elif args.prepare:
        work = Path(args.prepare).resolve()
        argv, _ = prepare(args, work)
        (work / "overrides.txt").write_text(" ".join(shlex.quote(a) for a in argv) + "\n")
        print(work / "overrides.txt")
    else:
        with contextlib.redirect_stdout(sys.stderr):    # the trainer's lines: stdout is JSON
            result = run(args)
        print(json.dumps(result))


if __name__ == "__main__":
    main()
