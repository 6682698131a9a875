"""The rollout benchmark's peers (tools/bench_rollout.py --hf, --vllm): Hugging Face
`generate` and the vLLM rollout backend on the same shape, weights and prompts."""
from __future__ import annotations

import functools
import sys
import time
from dataclasses import replace

import torch

from hybridengine.models.decoder import ModelConfig
from hybridengine.models.hf_config import hf_config
from hybridengine.rollout.engine import max_logprob_gap
from hybridengine.rollout.sampling import SamplingParams


def log(msg: str) -> None:
    print(f"[bench_rollout] {msg}", file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def logprob_check(model, prompts, results, num: int = 4) -> float:
    """Max |engine logprob - training-forward logprob| over the first `num` sequences."""
    return max_logprob_gap(model, prompts, results[:num])


def bench_hf(cfg: ModelConfig, prompts, args, device, dtype) -> dict:
    from transformers import AutoModelForCausalLM
    hf_cfg = hf_config(replace(cfg, max_position_embeddings=4096))
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa")
    model = model.to(dtype).eval()
    ids = torch.tensor(prompts, device=device)
    kw = dict(do_sample=True, temperature=args.temperature, top_p=args.top_p,
              top_k=max(args.top_k, 0), attention_mask=torch.ones_like(ids), pad_token_id=0)
    log("hf warm-up")
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kw)
        log(f"hf generate: {args.batch} x ({args.prompt_len} + {args.new_tokens}) tokens")
        sync(device)
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                             **kw)
        sync(device)
    sec = time.perf_counter() - t0
    generated = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    del model
    return {"seconds": sec, "generated_tokens_per_s": generated / sec,
            "total_tokens_per_s": out.numel() / sec}


def bench_vllm(cfg: ModelConfig, model, prompts, args, dtype) -> dict:
    """The vLLM backend on the same weights and prompts (its engine start is not timed)."""
    import tempfile
    from hybridengine.hybrid.hf_stream import hf_weight_stream
    from hybridengine.rollout.vllm import VllmRollout
    max_len = args.prompt_len + args.new_tokens
    with tempfile.TemporaryDirectory() as model_dir:     # config.json only: weights come below
        hf_config(replace(cfg, max_position_embeddings=max_len)).save_pretrained(model_dir)
        log("vllm: engine start")
        rollout = VllmRollout(model_dir, cfg, 1, dtype=dtype, max_model_len=max_len,
                              max_num_seqs=args.batch, enforce_eager=args.eager)
    try:
        sync_s = rollout.update_weights(functools.partial(hf_weight_stream, model, None, 256.0)
                                        )["weight_sync_s"]
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, max_tokens=args.new_tokens, ignore_eos=True,
                                seed=0)
        rollout.generate(prompts, replace(params, max_tokens=min(8, args.new_tokens)))
        log(f"vllm: {args.batch} x ({args.prompt_len} + {args.new_tokens}) tokens")
        t0 = time.perf_counter()
        results = rollout.generate(prompts, params)
        sec = time.perf_counter() - t0
    finally:
        rollout.close()
    generated = sum(len(r.token_ids) for r in results)
    return {"seconds": sec, "generated_tokens_per_s": generated / sec,
            "total_tokens_per_s": (generated + args.batch * args.prompt_len) / sec,
            "engine_start_s": rollout.stats["engine_start_s"], "weight_sync_s": sync_s,
            "logprob_max_abs_diff_vs_training_forward": logprob_check(model, prompts, results)}
