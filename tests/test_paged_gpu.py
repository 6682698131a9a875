"""The paged layout's CUDA paths (skipped without CUDA): the Triton paged decode kernel, plain
and with RoPE and the cache write fused, at the rollout benchmark's shape in bf16; the engine
with kv_layout="paged" in CUDA graphs, compiled (inductor) and on the triton backend against
the static engine, greedy and seeded sampling token for token in fp32 (continuous batching,
preemption forced by a small cache, shared prefixes), for several head shapes (GQA among them);
bf16 log-probs against the training forward.

Robustness: small random models whose output projection is scaled up, so that the greedy
choice's margin (~1 logit) dwarfs fp32 rounding (~1e-5): the paged and the static steps sum in
different orders (split-KV kernel, inductor's kernels, prefill against decode after a
preemption), and only a near tie could turn a token."""
import pytest
import torch

from hybridengine.kernels.settings import RolloutKernelSettings
from hybridengine.models.decoder import Decoder, ModelConfig
from hybridengine.rollout.engine import Engine, max_logprob_gap
from hybridengine.rollout.rollout_config import CompileMode, RolloutConfig
from hybridengine.rollout.sampling import SamplingParams

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
MAX_LEN = 96
# (q heads, K/V heads, head_dim): GQA 4:1 (d 64), MHA (d 32), GQA 8:1 (d 128), Qwen2.5's 7:1
HEADS = [(8, 2, 64), (4, 4, 32), (16, 2, 128), (14, 2, 64)]
# the paged engine's settings under test, as overrides of RolloutConfig (enforce_eager False:
# CUDA graphs)
PAGED = {
    "graphs_compiled": dict(compile=CompileMode.INDUCTOR, compile_prefill=CompileMode.INDUCTOR),
    "graphs": {},
    "graphs_separate_rope": dict(kernels=RolloutKernelSettings(fused_rope=False)),
    "eager": dict(enforce_eager=True),
}


def _model(heads, dtype=torch.float32, sharpen=True):
    hq, hkv, d = heads
    cfg = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=3,
                      num_heads=hq, num_kv_heads=hkv, head_dim=d, attention_bias=True,
                      max_position_embeddings=MAX_LEN, model_type="qwen2")
    torch.manual_seed(sum(heads))
    model = Decoder(cfg, dtype=dtype, device=CUDA).eval()
    if sharpen:
        with torch.no_grad():
            model.lm_head.weight.mul_(16 / model.lm_head.weight.std())   # ~1 logit between choices
    return model


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    out = [torch.randint(0, vocab, (n,), generator=g).tolist()
           for n in (5, 40, 17, 1, 33, 64, 9, 23)]
    return out + [out[1], out[5][:48]]          # an equal prompt, a common 48-token prefix


def _engine(model, **kw) -> Engine:
    return Engine(model, RolloutConfig(**{**dict(max_num_seqs=16, max_model_len=MAX_LEN,
                                                 max_prefill_tokens=256), **kw}))


def _same_tokens(got, ref):
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    gap = max(abs(a - b) for r, q in zip(got, ref) for a, b in zip(r.logprobs, q.logprobs))
    assert gap < 1e-3, gap


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "x".join(map(str, h)))
def test_paged_graphs_compile_triton_equal_static_fp32(heads):
    torch._dynamo.reset()          # each head shape compiles its own steps
    model = _model(heads)
    prompts = _prompts(model.cfg.vocab_size)
    greedy = SamplingParams(n=2, temperature=0.0, max_tokens=48)
    sampled = SamplingParams(n=3, temperature=0.8, top_p=0.9, max_tokens=40, seed=5)
    static = _engine(model, attn_backend="sdpa", enforce_eager=True)
    refs = {p: static.generate(prompts, p) for p in (greedy, sampled)}
    static.free_cache()
    for name, overrides in PAGED.items():
        for budget in (None, 12 * MAX_LEN // 2):       # ample, and small: preemption
            engine = _engine(model, kv_layout="paged", block_size=16, attn_backend="triton",
                             kv_cache_tokens=budget, **overrides)
            for params, ref in refs.items():
                _same_tokens(engine.generate(prompts, params), ref)
            s = engine.stats
            assert s["attn_backend"] == "triton" and s["cuda_graphs"] == (name != "eager")
            assert s["num_prefix_cached_tokens"] > 0
            if budget is not None:
                assert s["num_preemptions"] > 0, name
            if "compile_prefill" in overrides:
                assert engine.runner.prefill_compiled, "the compiled prefill fell back"
            engine.free_cache()


def test_paged_bf16_logprobs_match_training_forward():
    # not sharpened: logits of ~100s, whose bf16 spacing (0.5-4) alone would move a log-prob
    # by more than the bound (session 18: 7.3 with the sharpened head)
    model = _model((14, 2, 64), torch.bfloat16, sharpen=False)
    prompts = _prompts(model.cfg.vocab_size)
    engine = _engine(model, kv_layout="paged", kv_cache_tokens=10 * MAX_LEN,
                     compile=CompileMode.INDUCTOR, compile_prefill=CompileMode.INDUCTOR)
    assert engine.runner.backend == "triton"       # auto on CUDA
    results = engine.generate(prompts, SamplingParams(n=3, max_tokens=48, seed=2))
    assert engine.stats["num_preemptions"] > 0
    assert max_logprob_gap(model, prompts, results) < 0.05


def test_paged_decode_kernels_bf16_benchmark_shape():
    """256 rows of up to 768 tokens in blocks of 16 (W = 48), 14 / 2 heads of 64, bf16: the
    plain kernel against the torch reference, and the fused form (RoPE, the write at each row's
    slot, attention) against apply_rope + an index write + the plain kernel."""
    from hybridengine.kernels.paged_decode_attention import (paged_decode_attention,
                                                             paged_decode_attention_rope)
    from hybridengine.models.attention import RotaryEmbedding, apply_rope
    from hybridengine.rollout import paged_cache
    B, hq, hkv, d, bs, W, bf = 256, 14, 2, 64, 16, 48, torch.bfloat16
    num_blocks = B * W
    g = torch.Generator(device=CUDA).manual_seed(0)
    kc = torch.randn(num_blocks + 1, bs, hkv, d, device=CUDA, generator=g).to(bf)
    vc = torch.randn_like(kc)
    tables = torch.randperm(num_blocks, device=CUDA, generator=g).view(B, W).int()
    lens = torch.randint(1, W * bs + 1, (B,), device=CUDA, generator=g).int()
    qkv = torch.randn(B, hq + 2 * hkv, d, device=CUDA, generator=g).to(bf)
    q = qkv[:, :hq]
    out = paged_decode_attention(q, kc, vc, tables, lens)
    ref = paged_cache.paged_decode_attention(q.float(), kc.float(), vc.float(), tables, lens)
    assert (out.float() - ref).abs().max() < 2e-2
    pos = (lens - 1).long()
    slot = tables[torch.arange(B, device=CUDA), pos // bs].long() * bs + pos % bs
    cos, sin = RotaryEmbedding(d, 1e6, CUDA)(pos)
    kf, vf = kc.clone(), vc.clone()
    rows = torch.arange(B, device=CUDA)
    out = paged_decode_attention_rope(q, qkv[:, hq:hq + hkv], qkv[:, hq + hkv:], cos, sin, kf,
                                      vf, tables, slot, rows, pos, W * bs)
    qk = apply_rope(qkv[:, :hq + hkv].float(), cos.to(bf).float(), sin.to(bf).float()).to(bf)
    kc.view(-1, hkv, d)[slot], vc.view(-1, hkv, d)[slot] = qk[:, hq:], qkv[:, hq + hkv:]
    # fused multiply-adds may round a few elements the other way
    assert (kf.float() - kc.float()).abs().max() <= 1e-2 * kc.float().abs().max()
    assert torch.equal(vf, vc)
    ref = paged_decode_attention(qk[:, :hq], kc, vc, tables, lens)
    assert (out.float() - ref.float()).abs().max() < 2e-2
