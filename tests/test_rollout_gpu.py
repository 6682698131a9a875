"""The rollout engine's CUDA paths (skipped without CUDA): decode graphs with continuous
batching and one step in flight against HF greedy, the flash decode kernel against SDPA and the
training forward in bf16, the gpu_memory_utilization budget, and the compiled decode step."""
import pytest
import torch

from hybridengine.models.decoder import Decoder, ModelConfig
from hybridengine.models.hf import load_decoder
from hybridengine.rollout import attention
from hybridengine.rollout.engine import Engine, max_logprob_gap
from hybridengine.rollout.rollout_config import CompileMode, RolloutConfig
from hybridengine.rollout.sampling import SamplingParams
from model_utils import STORIES
from test_rollout import _hf_greedy, _pick_stop, _prompts

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
SMALL = ModelConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_layers=4,
                    num_heads=8, num_kv_heads=2, head_dim=64, attention_bias=True,
                    tie_word_embeddings=True, max_position_embeddings=256, model_type="qwen2")


def _greedy(model, prompts, stop, **kw):
    engine = Engine(model, RolloutConfig(max_num_seqs=kw.pop("max_num_seqs", 4), max_model_len=64,
                                         max_prefill_tokens=128,
                                         kv_cache_tokens=kw.pop("kv_cache_tokens", 5 * 64),
                                         **kw))
    params = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=tuple(stop))
    return engine.generate(prompts, params), engine


def test_graphs_continuous_batching_match_hf_fp32():
    from transformers import AutoModelForCausalLM
    model = load_decoder(STORIES, device=CUDA)
    prompts = _prompts([3, 12, 5, 1, 9, 7, 2, 15, 4, 6], 512, seed=9)
    free, _ = _greedy(model, prompts, (), max_num_seqs=16, kv_cache_tokens=17 * 64)
    stop = _pick_stop([r.token_ids for r in free])
    refs = _hf_greedy(AutoModelForCausalLM.from_pretrained(STORIES).eval(), prompts, stop)
    for eager in (False, True):
        results, engine = _greedy(model, prompts, [stop], enforce_eager=eager)
        assert engine.stats["cuda_graphs"] is not eager
        assert [r.token_ids for r in results] == refs, f"enforce_eager={eager}"
        assert {r.finish_reason for r in results} == {"stop", "length"}


def _small_bf16():
    torch.manual_seed(0)
    return Decoder(SMALL, dtype=torch.bfloat16, device=CUDA)


def test_flash_decode_bf16_logprobs_match_training_forward():
    if attention._FLASH_DECODE is None:
        pytest.skip("this torch's flash varlen kernel has no seqused_k")
    model = _small_bf16()
    prompts = _prompts([30, 7, 64, 1, 45], SMALL.vocab_size, seed=2)
    params = SamplingParams(n=3, max_tokens=40, seed=5)
    by_backend = {}
    for backend in ("triton", "flash", "flash_per_head", "sdpa"):
        engine = Engine(model, RolloutConfig(max_num_seqs=8, max_model_len=128,
                                             kv_cache_tokens=9 * 128, attn_backend=backend))
        assert engine.runner.backend == backend
        by_backend[backend] = engine.generate(prompts, params)
    for backend, results in by_backend.items():
        worst = max_logprob_gap(model, prompts, results)
        assert worst < 0.05, (backend, worst)          # bf16 forward vs bf16 forward


def test_gpu_memory_utilization_budget():
    model = _small_bf16()
    engine = Engine(model, RolloutConfig(max_num_seqs=64, max_model_len=128,
                                         gpu_memory_utilization=0.3))
    results = engine.generate(_prompts([5, 9], SMALL.vocab_size), SamplingParams(max_tokens=4))
    total = torch.cuda.get_device_properties(CUDA).total_memory
    assert 1 <= engine.runner.num_slots <= 64
    assert engine.runner.cache.num_bytes < 0.3 * total
    assert all(len(r.token_ids) == 4 for r in results)
    engine.free_cache()
    assert engine.runner.cache is None


def test_compiled_decode_matches_eager_fp32():
    model = load_decoder(STORIES, device=CUDA)
    prompts = _prompts([3, 12, 5, 9], 512, seed=4)
    plain, _ = _greedy(model, prompts, ())
    compiled, _ = _greedy(model, prompts, (), compile=CompileMode.INDUCTOR)
    assert [r.token_ids for r in compiled] == [r.token_ids for r in plain]
    both, engine = _greedy(model, prompts, (), compile=CompileMode.INDUCTOR,
                           compile_prefill=CompileMode.INDUCTOR)
    assert engine.runner.prefill_compiled, "the compiled prefill fell back to eager"
    assert [r.token_ids for r in both] == [r.token_ids for r in plain]


def test_fused_sampler_matches_torch_sampler_bf16_full_vocab():
    """The Triton temperature sampler at the benchmark's shape (256 rows, vocabulary 151936,
    bf16 logits): the torch sampler's tokens and log-probs; in the engine, sampled log-probs
    at temperature 1 equal the training forward's."""
    from hybridengine.kernels.sampler import sample_temperature
    from hybridengine.rollout.sampling import SamplerMode, sample_torch, uniforms
    g = torch.Generator(device=CUDA).manual_seed(0)
    z = (torch.randn(256, 151936, device=CUDA, generator=g) * 4).to(torch.bfloat16)
    u = uniforms(torch.arange(256, device=CUDA) * 7919, torch.arange(256, device=CUDA))
    for T in (1.0, 0.6):
        temp = torch.tensor([T], device=CUDA)
        tok, lp, slp = sample_temperature(z, temp, u, scaled=T != 1.0)
        rtok, rlp, rslp = sample_torch(z, SamplerMode(False, 0, False, T != 1.0), temp,
                                       torch.ones(1, device=CUDA), u)
        same = tok == rtok
        assert same.float().mean() > 0.99, T          # differ only at rounding boundaries
        assert (lp - rlp)[same].abs().max() < 1e-4 and (slp - rslp)[same].abs().max() < 1e-4
    model = Decoder(SMALL, dtype=torch.float32, device=CUDA)
    prompts = _prompts([5, 9, 3, 12], SMALL.vocab_size, seed=4)
    engine = Engine(model, RolloutConfig(max_num_seqs=4, max_model_len=64, max_prefill_tokens=128,
                                         kv_cache_tokens=5 * 64))
    res = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=16, seed=3))
    assert max_logprob_gap(model, prompts, res) < 1e-4
    again = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=16, seed=3))
    assert [r.token_ids for r in again] == [r.token_ids for r in res]


def _decode_case(B, hq, hkv, d, L, spread=1.0):
    """A decode step's bf16 inputs: the qkv projection's rows [B, h_q + 2h_kv, d], K/V caches of
    B + 1 slots (values of scale `spread`), the rows' slots and each slot's position."""
    g = torch.Generator(device=CUDA).manual_seed(0)
    qkv = (torch.randn(B, hq + 2 * hkv, d, device=CUDA, generator=g) * spread).to(torch.bfloat16)
    kc = (torch.randn(B + 1, L, hkv, d, device=CUDA, generator=g) * spread).to(torch.bfloat16)
    vc = torch.randn_like(kc)
    slots = torch.randperm(B, device=CUDA, generator=g)
    by_slot = torch.randint(0, L, (B + 1,), device=CUDA, generator=g)
    return qkv, kc, vc, slots, by_slot, by_slot[slots]


def test_fused_rope_decode_attention_bf16_benchmark_shape():
    """The one-launch decode attention (RoPE of q and the new key, cache write, attention) at
    the rollout benchmark's shape in bf16 (256 rows, 768 cached positions, 14 / 2 heads of 64):
    the cache gets what the compiled apply_rope and an index write store, and the output
    matches separate RoPE + write + the plain kernel."""
    from hybridengine.kernels import decode_attention as da
    from hybridengine.models.attention import RotaryEmbedding, apply_rope
    B, hq, hkv, d, L, bf = 256, 14, 2, 64, 768, torch.bfloat16
    qkv, kc, vc, slots, by_slot, pos = _decode_case(B, hq, hkv, d, L)
    cos, sin = RotaryEmbedding(d, 1e6, CUDA)(pos)
    kf, vf = kc.clone(), vc.clone()
    out = da.decode_attention_rope(qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:], cos, sin,
                                   kf, vf, slots, by_slot)
    qk = apply_rope(qkv[:, :hq + hkv].float(), cos.to(bf).float(), sin.to(bf).float()).to(bf)
    kc[slots, pos], vc[slots, pos] = qk[:, hq:], qkv[:, hq + hkv:]
    # fused multiply-adds may round a few elements the other way
    assert (kf.float() - kc.float()).abs().max() <= 1e-2 * kc.float().abs().max()
    assert torch.equal(vf, vc)
    seqlens = (pos + 1).to(torch.int32)
    ref = da.decode_attention(qk[:, :hq], kc, vc, slots, seqlens)
    assert (out.float() - ref.float()).abs().max() < 2e-2


def test_decode_attention_with_gemma2_spec_at_head_dim_256():
    """Gemma 2's attention in the triton decode kernels at the 2B shape's heads (8 / 4 of 256,
    the tile narrowed to fit shared memory): a query scale other than 1/sqrt(d), the logit
    soft-cap of 50 and a window of 100 keys, plain and fused-RoPE forms, against the masked
    torch attention (fp32) over the same cache."""
    from hybridengine.kernels import decode_attention as da
    from hybridengine.models.attention import RotaryEmbedding, apply_rope
    from hybridengine.models.features import AttentionSpec, masked_attention, window_mask
    B, hq, hkv, d, L, bf = 64, 8, 4, 256, 768, torch.bfloat16
    qkv, kc, vc, slots, by_slot, pos = _decode_case(B, hq, hkv, d, L, spread=2.0)
    cos, sin = RotaryEmbedding(d, 1e4, CUDA)(pos)
    kf, vf = kc.clone(), vc.clone()
    for spec in (AttentionSpec(window=100, softcap=50.0, scale=0.3),
                 AttentionSpec(softcap=50.0, scale=0.3)):
        args = dict(scale=spec.scale, softcap=spec.softcap, window=spec.window or 0)
        out = da.decode_attention_rope(qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:],
                                       cos, sin, kf, vf, slots, by_slot, **args)
        qk = apply_rope(qkv[:, :hq + hkv].float(), cos.to(bf).float(),
                        sin.to(bf).float()).to(bf)
        kc[slots, pos], vc[slots, pos] = qk[:, hq:], qkv[:, hq + hkv:]
        plain = da.decode_attention(qk[:, :hq], kc, vc, slots, (pos + 1).to(torch.int32), **args)
        cols = torch.arange(L, device=CUDA)
        mask = window_mask(pos[:, None], cols[None, :], spec.window)[:, None, None, :]
        ref = masked_attention(qk[:, :hq].float().unsqueeze(2), kc[slots].float().transpose(1, 2),
                               vc[slots].float().transpose(1, 2), mask, spec).squeeze(2)
        for name, got in (("plain", plain), ("fused", out)):
            err = (got.float() - ref).abs().max().item()
            assert err < 3e-2, f"{name} {spec}: {err}"


def test_dense_prefill_attention_bf16_matches_varlen():
    """cuDNN over right-padded prompts (the dense prefill) against flash varlen on the same
    packed tokens, bf16, GQA 14/2 heads of 64, prompts of different lengths and of one."""
    from hybridengine.models.attention import PackedCausalAttention, PackedInput
    g = torch.Generator(device="cpu").manual_seed(0)
    for lens in ([300, 512, 257, 511], [128] * 5):
        T, N = sum(lens), max(lens)
        q = torch.randn(T, 14, 64, generator=g).to(CUDA, torch.bfloat16)
        k, v = (torch.randn(T, 2, 64, generator=g).to(CUDA, torch.bfloat16) for _ in range(2))
        packed = PackedInput.from_lengths(torch.zeros(T, dtype=torch.long, device=CUDA), lens)
        ref = PackedCausalAttention(packed).attend(0, q, k, v).float()
        pad_index = None
        if len(set(lens)) > 1:
            pad_index = torch.cat([i * N + torch.arange(n) for i, n in enumerate(lens)]).to(CUDA)
        out = attention.padded_causal_attention(q, k, v, len(lens), N, pad_index).float()
        assert (out - ref).abs().max().item() < 2e-2, lens


def test_auto_prefill_is_dense_in_bf16_and_logprobs_match_training_forward():
    model = _small_bf16()
    prompts = _prompts([30, 28, 32, 25, 31], SMALL.vocab_size, seed=4)
    engine = Engine(model, RolloutConfig(max_num_seqs=8, max_model_len=128,
                                         kv_cache_tokens=9 * 128))
    assert engine.runner.prefill_attention == "dense"
    results = engine.generate(prompts, SamplingParams(n=2, max_tokens=30, seed=1))
    assert max_logprob_gap(model, prompts, results) < 0.05


def test_programmatic_dependent_launch_changes_no_result():
    """With PDL (the default on Hopper+: inductor's kernels and the fused decode attention may
    start while the kernel before them drains) a compiled bf16 rollout in CUDA graphs is as
    right as without: no kernel reads what its predecessor is still writing. 64 rows sampled at
    temperature 1, so every step fills the GPU. Each setting is an inductor compilation of its
    own, whose first-launch timing may pick another reduction order (test_rollout_random): on
    an H200 (2026-12-01, session 12) one sampled token of row 35 came out otherwise, and that
    row went its own way from there. What a missing wait breaks is values, so each run's
    log-probs must be a teacher-forced forward's of its own tokens, and most rows the same.
    PDL on and off bit for bit where the kernels are the same (eager, in CUDA graphs):
    test_rollout_random.test_random_rollouts_gpu_pdl_changes_no_bit."""
    from hybridengine.kernels.decode_attention import pdl_supported
    from hybridengine.kernels.settings import RolloutKernelSettings
    from hybridengine.rollout.compile_steps import inductor_options
    if not pdl_supported(CUDA):
        pytest.skip("programmatic dependent launch needs Hopper or later")
    model = _small_bf16()
    prompts = _prompts([5 + i % 40 for i in range(64)], SMALL.vocab_size, seed=6)
    params = SamplingParams(temperature=1.0, max_tokens=48, seed=11)
    runs = []
    for pdl in (True, False):
        torch._dynamo.reset()       # the compiled steps are cached per function
        try:
            for decode in (True, False):
                options = inductor_options(CUDA, decode, pdl)
                assert options.get("triton.enable_pdl", False) == pdl
            engine = Engine(model, RolloutConfig(
                max_num_seqs=64, max_model_len=96, max_prefill_tokens=1024,
                kv_cache_tokens=65 * 96, compile=CompileMode.INDUCTOR,
                compile_prefill=CompileMode.INDUCTOR, kernels=RolloutKernelSettings(pdl=pdl)))
            runs.append(engine.generate(prompts, params))
        finally:
            torch._dynamo.reset()
    with_pdl, without = runs
    for results in runs:
        assert max_logprob_gap(model, prompts, results) < 0.05
    same = sum(a.token_ids == b.token_ids for a, b in zip(with_pdl, without))
    assert same >= len(prompts) * 3 // 4, same


def test_captures_after_free_cache_leave_no_memory_behind():
    """Generations with CUDA graphs, each after free_cache() (as the trainer runs its rollouts):
    the graphs are captured again every time, and the memory allocated after free_cache() stays
    that of the first (a side stream per capture left a cuBLAS workspace behind each time)."""
    model = _small_bf16()
    engine = Engine(model, RolloutConfig(max_num_seqs=32, max_model_len=128,
                                         kv_cache_tokens=33 * 128))
    prompts = _prompts([5, 9, 30, 17, 2, 44, 8, 12, 3, 21, 6, 1], SMALL.vocab_size, seed=4)
    held = []
    for k in range(6):
        engine.generate(prompts[: 4 + 2 * k], SamplingParams(n=2, max_tokens=16, seed=k))
        assert engine.stats["cuda_graphs"]
        engine.free_cache()
        torch.cuda.synchronize()
        held.append(torch.cuda.memory_allocated(CUDA))
    assert max(held) - held[0] < (1 << 20), held


def test_prefill_peak_is_measured_once_across_free_cache():
    """The gpu_memory_utilization budget's prefill probe (a full max_prefill_tokens forward)
    runs at the first cache allocation only: after free_cache() the next generation sizes its
    cache from the kept peak, to the same slot count, without running the model outside its
    prefill and decode steps."""
    model = _small_bf16()
    engine = Engine(model, RolloutConfig(max_num_seqs=64, max_model_len=128,
                                         gpu_memory_utilization=0.3))
    probes = []
    hook = model.register_forward_hook(
        lambda module, args, output: probes.append(args[0].input_ids.numel()))
    prompts, params = _prompts([5, 9], SMALL.vocab_size), SamplingParams(max_tokens=4)
    try:
        slots = []
        for _ in range(3):
            engine.generate(prompts, params)
            slots.append(engine.runner.num_slots)
            engine.free_cache()
        first, later = probes.count(engine.config.max_prefill_tokens), len(probes)
    finally:
        hook.remove()
    assert first == 1, probes          # the probe's 16k-token forward ran once in three
    assert later > 1                   # (the hook sees the generations' own forwards too)
    assert slots[0] == slots[1] == slots[2], slots
