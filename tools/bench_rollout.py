"""Rollout throughput of the built-in engine, next to Hugging Face `generate` in the same run.

A --model shape (models/shapes.py: qwen2.5-0.5b, the default, qwen3-0.6b, qwen3-1.7b, gemma2-2b)
with random bf16 weights built directly as a Decoder (no files); `batch` prompts of `prompt_len`
random tokens, `new_tokens` generated per prompt ignoring EOS (sampling at temperature 1).
Reports generated and (prompt + response) tokens/s, the engine's prefill / decode split, and a
check of its log-probs against the training forward. JSON to stdout, progress to stderr.

    python tools/bench_rollout.py [--model qwen2.5-0.5b] [--batch 256] [--prompt-len 512]
                                  [--new-tokens 256] [--hf] [--variants sdpa,eager] [--profile]
                                  [--kv-layout paged] [--n 8] [--response-lengths lognormal:M:S]
--n: samples per prompt (batch · n sequences); --response-lengths lognormal:MEAN:SIGMA: each
prompt's token budget drawn from a log-normal of mean MEAN tokens (SIGMA: the underlying
normal's), clipped to [1, --new-tokens], as RL responses spread (default: all --new-tokens).
--profile: one more generate under torch.profiler; "profile": its kernels (tools/profiling.py).
    python tools/bench_rollout.py --tiny [--hf] [--model M]   # CPU smoke run: M's family, tiny
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hybridengine.models.decoder import Decoder, ModelConfig  # noqa: E402
from hybridengine.kernels import sampler as fused_sampler  # noqa: E402
from hybridengine.kernels.settings import RolloutKernelSettings  # noqa: E402
from hybridengine.rollout.engine import Engine  # noqa: E402
from hybridengine.rollout.rollout_config import (BACKENDS, KV_LAYOUTS,  # noqa: E402
                                                 PREFILL_ATTENTION, CompileMode, RolloutConfig)
from hybridengine.rollout.sampling import SamplingParams  # noqa: E402
from hybridengine.models.shapes import SHAPES  # noqa: E402
from profiling import profile_ranges  # noqa: E402
# the HF / vLLM peers and the helpers they share (log, sync, logprob_check): importable here
from rollout_peers import bench_hf, bench_vllm, log, logprob_check, sync  # noqa: E402


def model_shape(model: str, tiny: bool, vllm: bool) -> tuple[ModelConfig, str]:
    """(the shape, its name): --model's, or its family's smoke-test shape (vLLM's CPU attention
    needs head_dim >= 32)."""
    full, small = SHAPES[model]
    if vllm:
        small = replace(small, hidden_size=128, intermediate_size=256, head_dim=32)
    return (small, "tiny" if model == "qwen2.5-0.5b" else f"tiny-{model}") if tiny \
        else (full, f"{model}-shape")


def random_prompts(batch: int, prompt_len: int, vocab: int, seed: int = 0,
                   min_len: int | None = None) -> list[list[int]]:
    """`batch` prompts of random tokens: prompt_len each, or lengths uniform in
    [min_len, prompt_len]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, prompt_len), generator=g).tolist()
    if min_len is None or min_len >= prompt_len:
        return ids
    lens = torch.randint(min_len, prompt_len + 1, (batch,), generator=g).tolist()
    return [p[:n] for p, n in zip(ids, lens)]


def response_lengths(spec: str | None, batch: int, new_tokens: int,
                     seed: int = 1) -> list[int] | None:
    """Per-prompt token budgets of --response-lengths lognormal:MEAN:SIGMA (None: none)."""
    if spec is None:
        return None
    _, mean, sigma = spec.split(":")
    mean, sigma = float(mean), float(sigma)
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(batch, generator=g, dtype=torch.float64)
    x = torch.exp(math.log(mean) - sigma ** 2 / 2 + sigma * z)         # E[x] = mean
    return x.round().clamp(1, new_tokens).long().tolist()


def kernel_settings(args) -> RolloutKernelSettings:
    """The engine's kernel settings that the arguments name: the defaults, with the changes of
    the benchmark's flags (a variant is a dataclasses.replace of the defaults)."""
    changes = {}
    if args.kv_write == "torch":  # the dense prefill's cache write through torch's indexing
        changes["triton_kv_write"] = False
    if args.decode_launch:        # the Triton decode kernel's tile and launch
        block_n, warps, stages = (int(x) for x in args.decode_launch.split(","))
        changes.update(decode_block_n=block_n, decode_num_warps=warps,
                       decode_num_stages=stages)
    if args.no_pdl:               # no programmatic dependent launch
        changes["pdl"] = False
    if args.no_prefetch:          # the decode attention asks nothing into L2 before its wait
        changes["decode_prefetch_keys"] = 0
    if args.sampler == "torch":   # the torch sampler, not the fused Triton one
        changes["fused_sampler"] = False
    if args.separate_rope:        # RoPE and the cache write before the decode attention
        changes["fused_rope"] = False
    return replace(RolloutKernelSettings(), **changes)


def rollout_config(args) -> RolloutConfig:
    """The engine's config that the arguments name: a row per prompt and the cache sized for
    them (so that every variant runs the same batch), the flags' knobs, kernel_settings."""
    max_len, seqs = args.max_model_len or args.prompt_len + args.new_tokens, args.batch * args.n
    # static: exactly a row per sequence; paged: the device's budget (gpu_memory_utilization),
    # which admission by blocks fills as the sequences' real lengths need; --kv-cache-tokens:
    # the same size for both (fewer rows than sequences: the case kv_layout=auto hands to paged)
    tokens = args.kv_cache_tokens or ((seqs + 1) * max_len if args.kv_layout == "static" else None)
    return RolloutConfig(max_num_seqs=seqs, max_model_len=max_len,
                         kv_cache_tokens=tokens, kv_layout=args.kv_layout,
                         block_size=args.block_size,
                         max_prefill_tokens=max(args.max_prefill_tokens, max_len),
                         enforce_eager=args.eager, attn_backend=args.attn, compile=args.compile,
                         compile_prefill=args.compile_prefill,
                         prefill_attention=args.prefill_attention, kernels=kernel_settings(args))


def bench_engine(model, prompts, args, device) -> dict:
    """_bench_engine with the process-wide state the arguments name set for the run (and put
    back after it)."""
    with contextlib.ExitStack() as stack:
        if args.no_pdl:
            # dynamo's cache is per code object: without a reset the compiled steps of an
            # earlier run (same functions, guards pass) would be reused, and later runs would
            # reuse these
            torch._dynamo.reset()
            stack.callback(torch._dynamo.reset)
        if args.blas != "default" and device.type == "cuda":
            # process-wide: restored after the run
            stack.callback(torch.backends.cuda.preferred_blas_library,
                           torch.backends.cuda.preferred_blas_library())
            torch.backends.cuda.preferred_blas_library(args.blas)
        return _bench_engine(model, prompts, args, device)


def build_engine(model, args) -> tuple[Engine, SamplingParams]:
    """The benchmark's engine (rollout_config) and its sampling."""
    engine = Engine(model, rollout_config(args))
    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, max_tokens=args.new_tokens, ignore_eos=True,
                            seed=0)
    return engine, params


def _bench_engine(model, prompts, args, device) -> dict:
    engine, params = build_engine(model, args)
    compiling = args.compile is not CompileMode.EAGER
    log(f"engine warm-up (graph capture{', compile' if compiling else ''})")
    t0 = time.perf_counter()
    # with spread lengths the timed batch shrinks through every decode graph's bucket, captured
    # (and compiled) at first use: so does the warm-up, each prompt stopping one token after the
    # one before (the long workload's first timed run took 1.25-1.28x its second without it,
    # bench/RESULTS.md session 30)
    spread = [min(args.new_tokens, i + 1) for i in range(len(prompts))] \
        if args.response_lengths else None
    engine.generate(prompts, replace(params, max_tokens=min(8, args.new_tokens)),
                    max_tokens=spread)
    sync(device)
    warmup_s = time.perf_counter() - t0
    log(f"engine: {args.batch} x {args.n} x ({args.prompt_len} + {args.new_tokens}) tokens, "
        f"{args.repeat} run(s)")
    lengths = response_lengths(args.response_lengths, len(prompts), args.new_tokens)
    runs = []
    for _ in range(args.repeat):
        if args.free_cache:       # as a trainer step (free_cache_engine): cache, graphs dropped
            engine.free_cache()
        sync(device)
        t0 = time.perf_counter()
        results = engine.generate(prompts, params, max_tokens=lengths)
        sync(device)
        runs.append((time.perf_counter() - t0, results, engine.stats))
    # the median run's figures: one generate is ~0.65 s on an H200, and single runs of the same
    # code spread by ~1.5% (mostly the host's result conversion)
    sec, results, stats = sorted(runs, key=lambda run: run[0])[len(runs) // 2]
    generated = sum(len(r.token_ids) for r in results)
    expected = args.n * (sum(lengths) if lengths else len(prompts) * args.new_tokens)
    if generated != expected:
        raise RuntimeError(f"engine generated {generated} tokens, expected {expected}")
    out = {"seconds": sec, "generated_tokens_per_s": generated / sec,
           "total_tokens_per_s": (generated + sum(map(len, prompts))) / sec,
           "runs_s": [run[0] for run in runs],
           "warmup_s": warmup_s, "logprob_max_abs_diff_vs_training_forward":
               logprob_check(model, prompts, results)}
    out.update({k: stats[k] for k in ("prefill_s", "decode_s", "num_prefill_steps",
                                      "num_decode_steps", "host_setup_s", "host_results_s",
                                      "attn_backend", "prefill_attention", "cuda_graphs",
                                      "num_slots", "kv_layout", "num_preemptions",
                                      "max_concurrent")})
    out.update({k: stats[k] for k in ("num_blocks", "num_prefix_cached_tokens", "kv_blocks_peak",
                                      "kv_tokens_at_peak") if k in stats})
    if stats.get("kv_tokens_at_peak"):      # issue 25: KV memory used over the tokens it held
        out["kv_used_over_held"] = (stats["kv_blocks_peak"] * engine.config.block_size /
                                    stats["kv_tokens_at_peak"])
    out["decode_ms_per_step"] = 1e3 * stats["decode_s"] / max(stats["num_decode_steps"], 1)
    settings = engine.runner.kernel_settings
    out["fused_sampler"] = settings.fused_sampler and fused_sampler.available(device)
    out["kernel_settings"] = asdict(settings)
    if getattr(args, "profile", False):
        out["profile"] = profile_generate(engine, prompts, params)
    engine.free_cache()
    return out


def profile_generate(engine, prompts, params) -> dict:
    """Kernel tables of one more generate call, and the decode kernels per step."""
    table = profile_ranges(lambda: engine.generate(prompts, params), ["prefill", "decode"],
                           top=20)
    steps = max(engine.stats["num_decode_steps"], 1)
    if "decode" in table:
        d = table["decode"]
        table["decode_per_step"] = {"kernel_ms": d["kernel_ms"] / steps,
                                    "kernels": d["kernels"] / steps, "steps": steps}
    log("profile: " + ", ".join(f"{k} {v['kernel_ms']:.1f} ms" for k, v in table.items()))
    return table


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-0.5b", choices=tuple(SHAPES))
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--max-prefill-tokens", type=int, default=16384)
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="the engine's context length: its rows (static) or the tables' width "
                         "(paged) (default: --prompt-len + --new-tokens); a run's last rows "
                         "in a wider table, as the long workload's tail")
    ap.add_argument("--n", type=int, default=1, help="samples per prompt")
    ap.add_argument("--response-lengths", default=None, metavar="lognormal:MEAN:SIGMA",
                    help="per-prompt token budgets from a log-normal (module doc)")
    ap.add_argument("--kv-layout", default="static", choices=KV_LAYOUTS,
                    help="the KV cache: a max_model_len row per sequence, or blocks")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per block (paged)")
    ap.add_argument("--kv-cache-tokens", type=int, default=None,
                    help="the KV cache's size in tokens, either layout (default: static, a row "
                         "per sequence; paged, the device's budget)")
    ap.add_argument("--repeat", type=int, default=3,
                    help="timed generate calls after the warm-up; the median one is reported "
                         "(all in runs_s)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=-1)
    ap.add_argument("--attn", default="auto", choices=BACKENDS)
    ap.add_argument("--sampler", default="auto", choices=("auto", "torch"),
                    help="auto: the fused Triton temperature sampler where it runs")
    ap.add_argument("--separate-rope", action="store_true",
                    help="RoPE and the K/V-cache write as their own kernels before the Triton "
                         "decode attention (default: inside it)")
    ap.add_argument("--blas", default="default", choices=("default", "cublas", "cublaslt"),
                    help="torch.backends.cuda.preferred_blas_library for the engine's GEMMs")
    ap.add_argument("--prompt-len-min", type=int, default=None,
                    help="prompt lengths uniform in [this, --prompt-len] (default: all "
                         "--prompt-len; not with --hf)")
    ap.add_argument("--prefill-attention", default="auto", choices=PREFILL_ATTENTION,
                    help="prefill attention: flash varlen, or a dense kernel (cuDNN) over the "
                         "right-padded prompts (Engine.prefill_attention)")
    ap.add_argument("--kv-write", default="triton", choices=("triton", "torch"),
                    help="the dense prefill's K/V cache write: kernels.kv_write, or torch's "
                         "indexing")
    ap.add_argument("--decode-launch", default="",
                    help="BLOCK_N,WARPS,STAGES of the Triton decode attention (default: "
                         "kernels.decode_attention's)")
    ap.add_argument("--no-pdl", action="store_true",
                    help="no programmatic dependent launch (default on Hopper+: inductor's "
                         "kernels and the fused decode attention may start while the kernel "
                         "before them drains)")
    ap.add_argument("--no-prefetch", action="store_true",
                    help="the fused decode attention under PDL does not prefetch the first "
                         "cached K/V tiles into L2 before its device wait")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--free-cache", action="store_true",
                    help="free the cache before each timed run, as a trainer's step does "
                         "(free_cache_engine): each run allocates it and captures its graphs")
    # the flags set a CompileMode (inductor); the autotune and prefill_cpp_wrapper variants
    # set the benchmark-only ones
    ap.add_argument("--compile", action="store_const", const=CompileMode.INDUCTOR,
                    default=CompileMode.EAGER, help="torch.compile the decode step")
    ap.add_argument("--compile-prefill", action="store_const", const=CompileMode.INDUCTOR,
                    default=CompileMode.EAGER, help="torch.compile the prefill forward")
    ap.add_argument("--hf", action="store_true", help="also time HF transformers generate")
    ap.add_argument("--vllm", action="store_true", help="also time the vLLM rollout backend")
    ap.add_argument("--variants", default="",
                    help="comma list of extra engine runs to compare, each changing knobs: "
                         "triton, flash, flash_per_head, sdpa (decode attention), eager (no "
                         "CUDA graphs), compile, compile_prefill, torch_sampler, autotune "
                         "(compile in inductor's max-autotune mode), separate_rope, prefill_64k "
                         "(--max-prefill-tokens 65536), cublaslt (--blas cublaslt), "
                         "prefill_cpp_wrapper (the compiled prefill launched from C++), "
                         "prefill_varlen / prefill_dense (--prefill-attention), "
                         "decode_launch_env (--decode-launch $DECODE_LAUNCH), kv_write_torch "
                         "(--kv-write torch), no_pdl (--no-pdl), no_prefetch (--no-prefetch), "
                         "paged / static (--kv-layout), free_cache (--free-cache); "
                         "'+' combines them (triton+compile)")
    ap.add_argument("--profile", action="store_true",
                    help="kernel table of one more generate (prefill, decode)")
    ap.add_argument("--out", default=None,
                    help="also write the JSON here, rewritten after every part")
    ap.add_argument("--tiny", "--cpu-tiny", dest="tiny", action="store_true",
                    help="CPU smoke run: tiny model, batch 4, prompt 16, 8 new tokens")
    args = ap.parse_args(argv)
    if args.prompt_len_min is not None and args.prompt_len_min < args.prompt_len and \
            (args.hf or args.vllm):
        ap.error("--prompt-len-min: the HF and vLLM peers take prompts of one length")
    if args.repeat < 1:
        ap.error(f"--repeat={args.repeat}: at least one timed run")
    if args.n < 1:
        ap.error(f"--n={args.n}: at least one sample per prompt")
    if args.response_lengths is not None:
        parts = args.response_lengths.split(":")
        try:
            ok = len(parts) == 3 and parts[0] == "lognormal" and float(parts[1]) > 0 and \
                float(parts[2]) >= 0
        except ValueError:
            ok = False
        if not ok:
            ap.error(f"--response-lengths={args.response_lengths}: lognormal:MEAN:SIGMA with "
                     f"MEAN > 0 and SIGMA >= 0")
    if (args.n > 1 or args.response_lengths) and (args.hf or args.vllm):
        ap.error("--n / --response-lengths: the HF and vLLM peers take one sample of "
                 "--new-tokens per prompt")
    if args.tiny:
        args.batch, args.prompt_len = min(args.batch, 4), min(args.prompt_len, 16)
        args.new_tokens = min(args.new_tokens, 8)
    if args.max_model_len is not None and \
            args.max_model_len < args.prompt_len + args.new_tokens:
        ap.error(f"--max-model-len={args.max_model_len}: below --prompt-len + --new-tokens "
                 f"({args.prompt_len + args.new_tokens})")
    return args


def save(out: dict, path: str | None) -> None:
    """Rewrite the JSON so far (a run cut short by a time limit keeps what finished)."""
    if path:
        Path(path).write_text(json.dumps(out, indent=1))


def main(argv=None) -> None:
    args = parse_args(argv)
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg, shape = model_shape(args.model, args.tiny or (args.vllm and not cuda), args.vllm)
    log(f"building the {shape} decoder on {device} {dtype}")
    torch.manual_seed(0)
    model = Decoder(cfg, dtype=dtype, device=device).eval()
    prompts = random_prompts(args.batch, args.prompt_len, cfg.vocab_size,
                             min_len=args.prompt_len_min)
    out = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
           "model": shape, "dtype": str(dtype),
           "batch": args.batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
           "n": args.n, "response_lengths": args.response_lengths,
           "prompt_len_min": args.prompt_len_min, "prompt_tokens": sum(map(len, prompts)),
           "sampling": {"temperature": args.temperature, "top_p": args.top_p,
                        "top_k": args.top_k},
           "ours": bench_engine(model, prompts, args, device)}
    log(f"ours: {out['ours']['generated_tokens_per_s']:.0f} generated tokens/s")
    save(out, args.out)
    if args.vllm:
        out["vllm"] = bench_vllm(cfg, model, prompts, args, dtype)
        out["speedup_vs_vllm"] = (out["ours"]["generated_tokens_per_s"]
                                  / out["vllm"]["generated_tokens_per_s"])
        log(f"vllm: {out['vllm']['generated_tokens_per_s']:.0f} generated tokens/s")
        save(out, args.out)
    if args.hf:       # before the variants: the same-run peer must not wait on them
        out["hf"] = bench_hf(cfg, prompts, args, device, dtype)
        out["speedup_vs_hf"] = (out["ours"]["generated_tokens_per_s"]
                                / out["hf"]["generated_tokens_per_s"])
        log(f"hf: {out['hf']['generated_tokens_per_s']:.0f} generated tokens/s")
        if cuda:
            torch.cuda.empty_cache()
        save(out, args.out)
    knobs = {"triton": {"attn": "triton"}, "flash": {"attn": "flash"},
             "flash_per_head": {"attn": "flash_per_head"}, "sdpa": {"attn": "sdpa"},
             "eager": {"eager": True}, "compile": {"compile": CompileMode.INDUCTOR},
             "compile_prefill": {"compile_prefill": CompileMode.INDUCTOR},
             "torch_sampler": {"sampler": "torch"},
             "autotune": {"compile": CompileMode.MAX_AUTOTUNE},
             "separate_rope": {"separate_rope": True},
             "prefill_64k": {"max_prefill_tokens": 65536}, "cublaslt": {"blas": "cublaslt"},
             "prefill_cpp_wrapper": {"compile_prefill": CompileMode.CPP_WRAPPER},
             "prefill_varlen": {"prefill_attention": "varlen"},
             "prefill_dense": {"prefill_attention": "dense"},
             "decode_launch_env": {"decode_launch": os.environ.get("DECODE_LAUNCH", "")},
             "kv_write_torch": {"kv_write": "torch"}, "no_pdl": {"no_pdl": True},
             "no_prefetch": {"no_prefetch": True}, "paged": {"kv_layout": "paged"},
             "free_cache": {"free_cache": True},
             "static": {"kv_layout": "static"},
             "block32": {"kv_layout": "paged", "block_size": 32},
             "block64": {"kv_layout": "paged", "block_size": 64}}
    for name in filter(None, args.variants.split(",")):
        unknown = [part for part in name.split("+") if part not in knobs]
        if unknown:
            raise SystemExit(f"--variants: unknown variant {unknown[0]!r} "
                             f"(choose from {', '.join(knobs)}, joined by '+')")
        knob = {k: v for part in name.split("+") for k, v in knobs[part].items()}
        log(f"variant {name}")
        try:
            res = bench_engine(model, prompts, argparse.Namespace(**{**vars(args), **knob}),
                               device)
        except Exception as e:  # noqa: BLE001 - one variant failing must not lose the others
            res = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        out.setdefault("variants", {})[name] = res
        save(out, args.out)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
