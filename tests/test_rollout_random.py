"""Randomized rollout parity at the head shapes of real models (issue 20): tiny Llama-shaped
models with 9/3, 14/2 heads of 64 and 16/8, 32/8 heads of 128 (SmolLM2-135M, Qwen2.5-0.5B,
Qwen3-0.6B, Llama-3.1-8B; hidden, layers and vocabulary tiny) run through the rollout Engine
with temperature sampling and stop tokens, so that sequences end at lengths of their own, and
more sequences than cache slots (continuous batching): the decode batch takes every size from
the slot count down to 1 (the last sequence alone: the size at which the fused decode attention
used to stop a SmolLM2 GRPO run, see kernels/decode_attention.stride_or_zero), graph-shaped steps
every bucket, and prefills pack from one prompt to as many as fit max_prefill_tokens.

Each fp32 run is checked against the SDPA backend on the eager path (same tokens and finish
reasons, log-probs within 1e-4, as tests/test_rollout.py holds the interpreted kernel to) and
on CPU against the training forward (max_logprob_gap < 1e-4); bf16 runs against the fp32
forward of the same weights (see test_random_rollouts_gpu); every run must have seen each
batch size it claims to. CPU: the Triton kernels in Triton's interpreter (a fresh process with
TRITON_INTERPRET=1), ~40 s. GPU (`-m gpu`, ~3 min on an H200): fp32 and bf16, eager, CUDA
graphs and compiled decode, programmatic dependent launch on and off, the dense (cuDNN)
prefill.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch

from hybridengine.models.decoder import Decoder, ModelConfig
from hybridengine.rollout.engine import Engine, max_logprob_gap
from hybridengine.rollout.rollout_config import CompileMode, RolloutConfig
from hybridengine.rollout.sampling import SamplingParams

# (q heads, K/V heads, head_dim) of SmolLM2-135M, Qwen2.5-0.5B, Qwen3-0.6B, Llama-3.1-8B
HEADS = [(9, 3, 64), (14, 2, 64), (16, 8, 128), (32, 8, 128)]
VOCAB, HIDDEN = 48, 32
STOP = (5, 11, 17)          # ~1/16 of the vocabulary: responses end at lengths of their own


def tiny_model(heads, dtype=torch.float32, device="cpu", layers: int = 2, seed: int = 0,
               emb_std: float = 0.4, gain: float = 1.5):
    """A random Llama-shaped decoder with the given head shape; weights scaled so that the
    attention scores and the logits are O(1) (the default init's std 0.02 would leave
    attention uniform and the next-token distribution flat, hiding a wrong key): embeddings
    of std emb_std, projections of std gain / sqrt(fan_in)."""
    hq, hkv, d = heads
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                      num_layers=layers, num_heads=hq, num_kv_heads=hkv, head_dim=d,
                      rope_theta=10000.0, tie_word_embeddings=True, max_position_embeddings=256)
    torch.manual_seed(seed)
    model = Decoder(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif "embed" in name:
                p.normal_(0.0, emb_std)
            else:
                p.normal_(0.0, gain / p.shape[1] ** 0.5)
    return model.to(device, dtype).eval()


def prompts_for(num: int, seed: int, max_len: int):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len + 1, (num,), generator=g).tolist()
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lens]


def record_steps(engine: Engine) -> dict:
    """Wrap the engine's runner to record each decode step's kernel batch (the graph bucket
    on graph-shaped steps) and each prefill's number of prompts."""
    runner, seen = engine.runner, {"decode": [], "prefill": []}
    decode, prefill = runner.decode, runner.prefill

    def rec_decode(slots, max_k):
        B = len(slots)
        seen["decode"].append(next(b for b in runner.buckets if b >= B)
                              if runner.static_shapes else B)
        return decode(slots, max_k)

    def rec_prefill(seqs):
        seen["prefill"].append(len({s.prompt_index for s in seqs}))
        return prefill(seqs)
    runner.decode, runner.prefill = rec_decode, rec_prefill
    return seen


def staircase(max_num_seqs: int, max_model_len: int):
    """max_num_seqs prompts whose cache rows leave room for 2, 4, ..., 2·max_num_seqs tokens
    (generated without stop tokens): with every slot taken at once, one row after the other
    runs out, so the decode batch steps through every size down to a last row alone."""
    return [[(3 * i + j) % VOCAB for j in range(max_model_len - 2 * (i + 1))]
            for i in range(max_num_seqs)]


def generate(model, seed: int, max_num_seqs: int, max_model_len: int, max_prefill_tokens: int,
             num_prompts: int, prompt_len: int, max_tokens: int, static: bool | None = None,
             **kw):
    """Two generate calls on one engine: num_prompts random prompts × 2 samples ending at stop
    tokens (more sequences than slots; several prompts per prefill where they fit; none when
    num_prompts = 0), then the staircase, whose step sizes do not depend on what is sampled.
    Returns the results of the calls, their prompts, the steps seen and the engine."""
    engine = Engine(model, RolloutConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                         max_prefill_tokens=max_prefill_tokens,
                                         kv_cache_tokens=(max_num_seqs + 1) * max_model_len,
                                         **kw))
    engine.steps_in_flight = 1          # as on CUDA: finished rows stay one more step
    if static is not None:
        engine.runner.static_shapes = static
    seen = record_steps(engine)
    calls = [(prompts_for(num_prompts, seed, prompt_len),
              SamplingParams(n=2, max_tokens=max_tokens, stop_token_ids=STOP, seed=seed)),
             (staircase(max_num_seqs, max_model_len),
              SamplingParams(max_tokens=max_model_len, ignore_eos=True, seed=seed + 1))]
    calls = calls[1:] if num_prompts == 0 else calls
    results = [engine.generate(prompts, params) for prompts, params in calls]
    return results, [prompts for prompts, _ in calls], seen, engine


def check_coverage(seen: dict, engine: Engine, min_packed: int, what: str) -> None:
    """Every decode size from the slot count down to 1 (graph-shaped: every bucket) ran, and
    prefills of one prompt and of min_packed or more."""
    runner = engine.runner
    want = set(runner.buckets) if runner.static_shapes else set(range(1, runner.num_slots + 1))
    assert want <= set(seen["decode"]), (what, sorted(want - set(seen["decode"])))
    assert 1 in seen["prefill"] and max(seen["prefill"]) >= min_packed, (what, seen["prefill"])


def check_same(results, ref, tol: float, what: str) -> None:
    """Tokens, finish reasons and log-probs (within tol) of two runs' result lists."""
    for got, want in zip(results, ref):
        assert [r.token_ids for r in got] == [r.token_ids for r in want], what
        assert [r.finish_reason for r in got] == [r.finish_reason for r in want], what
        worst = max(abs(a - b) for x, y in zip(got, want) for a, b in zip(x.logprobs, y.logprobs))
        assert worst < tol, (what, worst)


def logprob_gap(model, prompts, results) -> float:
    return max(max_logprob_gap(model, p, r) for p, r in zip(prompts, results))


# --- CPU: the Triton kernels in Triton's interpreter ------------------------------------------

# max_model_len 72: at batch 1 and 2 the keys of a row are cut into 2 splits (+ the merge)
CPU = dict(max_num_seqs=4, max_model_len=72, max_prefill_tokens=72, prompt_len=24,
           max_tokens=12)


def run_cpu_case(heads, seed: int, num_prompts: int, static_too: bool) -> None:
    """One head shape: triton (eager, and graph-shaped steps if static_too) against sdpa, and
    against the training forward, in fp32 (run under TRITON_INTERPRET=1)."""
    model = tiny_model(heads, layers=1, seed=seed)
    ref, prompts, _, _ = generate(model, seed, attn_backend="sdpa", static=False,
                                  num_prompts=num_prompts, **CPU)
    if num_prompts:
        reasons = {r.finish_reason for r in ref[0]}
        assert reasons == {"stop", "length"}, (heads, reasons)    # EOS ended some, not all
    for static in (False, True)[:1 + static_too]:
        what = f"heads={heads} static={static}"
        got, _, seen, engine = generate(model, seed, attn_backend="triton", static=static,
                                        num_prompts=num_prompts, **CPU)
        assert engine.runner.backend == "triton" and engine.runner.kernel_settings.fused_rope, \
            what
        check_coverage(seen, engine, 2 if num_prompts else 1, what)
        check_same(got, ref, 1e-4, what)
        assert logprob_gap(model, prompts, got) < 1e-4, what


def check_layouts(heads) -> None:
    """The fused decode attention on new K/V and RoPE tables of every layout a caller may
    hand over, batch 1 and 3: the decoder's views of one qkv projection (k's and v's batch
    strides differ at batch 1), V contiguous beside a strided K, K strided along d (copied),
    cos a slice of a wider table beside a contiguous sin. Output and cache write against
    apply_rope + an index write + grouped SDPA; and the backend check that `auto` runs before
    the first step (at batch 1 and 3, on the decoder's layout) passes."""
    from hybridengine.kernels.decode_attention import decode_attention_rope
    from hybridengine.models.attention import RotaryEmbedding, apply_rope
    from hybridengine.rollout import attention
    hq, hkv, d = heads
    S, L = 4, 40
    g = torch.Generator().manual_seed(0)
    rope = RotaryEmbedding(d, 10000.0)
    assert attention._decode_agrees(torch.device("cpu"), torch.float32, "triton", heads)
    for B in (1, 3):
        slots = torch.tensor([2, 0, 3][:B])
        by_slot = torch.zeros(S + 1, dtype=torch.long)
        by_slot[slots] = torch.tensor([17, 0, 39][:B])
        pos = by_slot[slots]
        cos, sin = rope(pos)
        qkv = torch.randn(B, (hq + 2 * hkv) * d, generator=g)
        q, k, v = attention.decoder_qkv(qkv, hq, hkv, d)
        wide = torch.cat([cos, torch.randn(B, d, generator=g)], 1)[:, :d]
        layouts = {"decoder": (k, v, cos, sin),
                   "v contiguous": (k, v.contiguous(), cos, sin),
                   "k strided along d": (k.transpose(1, 2).contiguous().transpose(1, 2), v,
                                         cos, sin),
                   "cos strided": (k, v, wide, sin.contiguous())}
        kc, vc = (torch.randn(S + 1, L, hkv, d, generator=g) for _ in range(2))
        qk = apply_rope(torch.cat([q, k], 1), cos, sin)
        ref_k, ref_v = kc.clone(), vc.clone()
        ref_k[slots, pos], ref_v[slots, pos] = qk[:, hq:], v
        mask = (torch.arange(L) <= pos.unsqueeze(1))[:, None, None, :]
        ref = attention.grouped_sdpa(qk[:, :hq], ref_k[slots].transpose(1, 2),
                                     ref_v[slots].transpose(1, 2), mask)
        for name, (k_new, v_new, c, s_) in layouts.items():
            k_out, v_out = kc.clone(), vc.clone()
            out = decode_attention_rope(q, k_new, v_new, c, s_, k_out, v_out, slots, by_slot)
            what = (heads, B, name)
            assert (k_out - ref_k).abs().max() < 1e-5 and torch.equal(v_out, ref_v), what
            assert (out - ref).abs().max() < 1e-4, what


def check_kv_write_layouts() -> None:
    """The prefill's Triton K/V write takes rows of one K/V head whatever stride torch gave
    that size-1 head dimension (as at generation TP where a rank holds one K/V head), and a
    prefill of one token: the write equals an index write, through the kernel."""
    from hybridengine.kernels import kv_write
    from hybridengine.rollout import attention
    g = torch.Generator().manual_seed(0)
    d, S, L = 64, 3, 16
    for T in (1, 5):
        _, k, v = attention.decoder_qkv(torch.randn(T, 4 * d, generator=g), 2, 1, d)
        odd = torch.randn(T, d, generator=g).as_strided((T, 1, d), (d, 7, 1))
        for k_new, v_new in ((k, v), (odd, v)):
            caches = [torch.zeros(S + 1, L, 1, d) for _ in range(2)]
            assert kv_write.supports(*caches, k_new, v_new)
            src, slot, pos = torch.arange(T), torch.full((T,), 2), torch.arange(T) + 3
            ref = [c.clone() for c in caches]
            ref[0][slot, pos], ref[1][slot, pos] = k_new, v_new
            kv_write.write_kv_rows(*caches, slot, pos, k_new, v_new, src)
            assert all(torch.equal(a, b) for a, b in zip(caches, ref)), T


# The interpreter runs ~20 ms per program (row × K/V head): stop tokens and graph-shaped steps
# at the 2 and 3 K/V-head shapes, the staircase alone at the 8 K/V-head ones. Two scripts, run at
# once (each case seeds its own model, prompts and sampling: no value depends on the order):
# the layouts and the 9/3-head shape; the other three shapes.
CPU_HEAD = """
import os, sys
os.environ["TRITON_INTERPRET"] = "1"          # Triton's CPU interpreter
sys.path.insert(0, {tests!r})
import torch
torch.set_num_threads(1)
import test_rollout_random as t
"""
CPU_SCRIPTS = (CPU_HEAD + """
t.check_layouts((9, 3, 64))
t.check_kv_write_layouts()
for heads in t.HEADS[:1]:
    t.run_cpu_case(heads, seed=1, num_prompts=3 if heads[1] < 8 else 0,
                   static_too=heads == (9, 3, 64))
print("ok")
""", CPU_HEAD + """
for heads in t.HEADS[1:]:
    t.run_cpu_case(heads, seed=1, num_prompts=3 if heads[1] < 8 else 0,
                   static_too=heads == (9, 3, 64))
print("ok")
""")


def test_random_rollouts_triton_interpreter_match_sdpa():
    """The fused decode attention on every layout of its new K/V and RoPE tables
    (check_layouts), the prefill's K/V write on rows of one K/V head (check_kv_write_layouts);
    then at each head shape every decode batch size 4..1 (at 9/3 heads every bucket too),
    prefills of one and of several prompts, stop tokens at varied lengths (2 and 3 K/V heads):
    the fused Triton decode, interpreted, gives SDPA's tokens and log-probs, and the training
    forward's log-probs."""
    from test_rollout import _run_in_triton_interpreter
    _run_in_triton_interpreter(*(script.format(tests=os.path.dirname(__file__))
                                 for script in CPU_SCRIPTS))


# --- GPU: bf16, CUDA graphs, eager and compiled decode, PDL on and off --------------------------

GPU = dict(max_num_seqs=40, max_model_len=128, max_prefill_tokens=128, prompt_len=16,
           max_tokens=32, num_prompts=48)
GPU_RUNS = {"eager": dict(enforce_eager=True),          # the setting: no graphs
            "graphs": dict(),
            "compiled": dict(compile=CompileMode.INDUCTOR,
                             compile_prefill=CompileMode.INDUCTOR)}


def _gpu_model(heads, dtype):
    """fp32: tiny_model's scale; bf16: half the embedding, 2/3 of the projections, where the
    log-probs of every backend sit within ~0.08 of the fp32 forward (at the full scale they
    sit 0.2-0.5 off, by amounts that change with the tokens sampled; H200, 2026-12)."""
    if dtype == torch.float32:
        return tiny_model(heads, dtype, "cuda", layers=2, seed=2)
    return tiny_model(heads, dtype, "cuda", layers=2, seed=2, emb_std=0.2, gain=1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "x".join(map(str, h)))
def test_random_rollouts_gpu(heads):
    """At each head shape, 40 slots (graph buckets 1, 2, 4, 8, 16, 24, 32, 40), 96 sequences
    ending at stop tokens and the staircase, prefills of 1 to several prompts: `auto` resolves
    to the Triton decode; eager, in CUDA graphs and compiled, every decode size (every bucket)
    runs, and in fp32 the tokens and log-probs are the SDPA backend's (1e-4). In bf16 (the
    dense cuDNN prefill) the log-probs of both backends are within 0.15 of the fp32 forward
    of the same weights, not of the bf16 training forward: SDPA's eager bf16 RoPE rounds as
    that forward does and the fused kernel's rotation (fp32, one rounding) does not, so next
    to it the Triton rollout sits ~0.06 off where SDPA sits 0.03-0.05, while next to the fp32
    forward both sit 0.06-0.08 off (H200, 2026-12)."""
    from hybridengine.rollout.attention import resolve_backend
    cuda = torch.device("cuda")
    assert resolve_backend("auto", cuda, torch.bfloat16, heads) == "triton"
    model = _gpu_model(heads, torch.float32)
    ref, _, _, _ = generate(model, 3, attn_backend="sdpa", enforce_eager=True, **GPU)
    for name, kw in GPU_RUNS.items():
        # fp32 prefills run per-sequence SDPA (flash is 16-bit only): its loop over a
        # different number of prompts at each prefill would recompile; the decode step only
        kw = dict(kw, compile_prefill=CompileMode.EAGER)
        torch._dynamo.reset()
        what = f"{heads} fp32 {name}"
        got, _, seen, engine = generate(model, 3, attn_backend="triton", **kw, **GPU)
        check_coverage(seen, engine, 4, what)
        check_same(got, ref, 1e-4, what)
    model16 = _gpu_model(heads, torch.bfloat16)
    exact = copy.deepcopy(model16).float()          # the bf16 weights, computed in fp32
    ref, prompts, _, _ = generate(model16, 3, attn_backend="sdpa", enforce_eager=True, **GPU)
    assert logprob_gap(exact, prompts, ref) < 0.15, heads
    for name, kw in GPU_RUNS.items():
        torch._dynamo.reset()
        what = f"{heads} bf16 {name}"
        got, prompts, seen, engine = generate(model16, 3, attn_backend="triton", **kw, **GPU)
        assert engine.runner.prefill_attention == "dense", what
        assert engine.stats["cuda_graphs"] == (name != "eager"), what
        assert {r.finish_reason for r in got[0]} == {"stop", "length"}, what
        check_coverage(seen, engine, 4, what)
        gap = logprob_gap(exact, prompts, got)
        assert gap < 0.15, (what, gap)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", HEADS[:2], ids=lambda h: "x".join(map(str, h)))
def test_random_rollouts_gpu_pdl_changes_no_bit(heads):
    """Programmatic dependent launch on and off (the fused decode attention and, compiled,
    inductor's kernels), every decode size, bf16. Eager and in CUDA graphs PDL is the only
    difference (the same kernels, launched otherwise): the same tokens and log-probs bit for
    bit. Compiled, each setting is an inductor compilation of its own whose code differs with
    PDL (its launch) and by the launch settings it times at a kernel's first launch, so a
    reduction may sum in another order and a sampled token near a tie may flip, after which
    the row goes its own way (H200, 2026-12-01: 9/3 heads every token the same; 14/2 heads
    row 22 apart from its 43rd token, in two runs of session 13). What a missing wait (a
    kernel reading what its predecessor has not written yet) breaks is values: each compiled
    run's log-probs must be the fp32 forward's of its own tokens, as the rollout's are in
    test_random_rollouts_gpu, and most rows the same."""
    from hybridengine.kernels.decode_attention import pdl_supported
    from hybridengine.kernels.settings import RolloutKernelSettings
    if not pdl_supported(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs Hopper or later")
    model = _gpu_model(heads, torch.bfloat16)
    exact = copy.deepcopy(model).float()            # the bf16 weights, computed in fp32
    runs = {}
    try:
        for pdl in (True, False):
            settings = RolloutKernelSettings(pdl=pdl)
            for name, kw in GPU_RUNS.items():
                torch._dynamo.reset()       # the compiled steps are cached per function
                got, prompts, _, _ = generate(model, 4, attn_backend="triton", **kw, **GPU,
                                              kernels=settings)
                runs[pdl, name] = got, prompts
    finally:
        torch._dynamo.reset()
    for name in GPU_RUNS:
        (with_pdl, prompts), (without, _) = runs[True, name], runs[False, name]
        rows = [(ra, rb) for a, b in zip(with_pdl, without) for ra, rb in zip(a, b)]
        same = [ra.token_ids == rb.token_ids for ra, rb in rows]
        if name != "compiled":
            assert all(same), (heads, name)
            assert all(ra.logprobs == rb.logprobs for ra, rb in rows), (heads, name)
            continue
        assert sum(same) >= len(rows) * 3 // 4, (heads, sum(same), len(rows))
        for got in (with_pdl, without):
            gap = logprob_gap(exact, prompts, got)
            assert gap < 0.15, (heads, gap)
