"""The rollout engine on CPU: greedy against Hugging Face generate (stories260K, tiny Qwen2; gen
TP 1 and 2), log-probs against the training forward, the sampler against the exact processed
distribution (chi-square), seed reproducibility, continuous batching against one by one."""
import os

import pytest
import torch

from dist_utils import run_dist
from hybridengine.models.attention import PackedInput
from hybridengine.models.decoder import Decoder, ModelConfig
from hybridengine.models.hf import load_decoder
from hybridengine.parallel.layout import Layout
from hybridengine.parallel.mesh import build_mesh
from hybridengine.rollout.engine import Engine
from hybridengine.rollout.kv_cache import SlotAllocator
from hybridengine.rollout.model_runner import graph_buckets
from hybridengine.rollout.rollout_config import CompileMode, RolloutConfig
from hybridengine.rollout.sampling import CDF_BLOCK, SamplingParams, inverse_cdf
from hybridengine.rollout.scheduler import Scheduler, Sequence
from model_utils import STORIES, save_tiny, tiny_hf_model

PROMPT_LENS = [5, 11, 3, 8, 1, 14]
MAX_NEW = 24


def _prompts(lens, vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def _greedy(model, prompts, stop=(), max_new=MAX_NEW, steps_in_flight=0, static=False, **kw):
    engine = Engine(model, RolloutConfig(max_num_seqs=kw.pop("max_num_seqs", 8), max_model_len=64,
                                         max_prefill_tokens=128, **kw))
    engine.steps_in_flight = steps_in_flight
    engine.runner.static_shapes = static        # the CUDA-graph shapes, without capture
    return engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_new,
                                                   stop_token_ids=tuple(stop))), engine


def _pick_stop(outputs):
    """A token of the first output that some other output lacks: stops some sequences early."""
    for t in outputs[0][2:]:
        if any(t not in o for o in outputs[1:]):
            return t
    raise AssertionError("no token stops only some sequences")


def _hf_greedy(hf, prompts, eos):
    refs = []
    for p in prompts:
        out = hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False,
                          eos_token_id=[eos], pad_token_id=0)
        refs.append(out[0, len(p):].tolist())
    return refs


def _cases(tmp_path):
    """(name, model dir, HF model, prompts) for the greedy parity tests."""
    from transformers import AutoModelForCausalLM
    qwen_dir = save_tiny(tmp_path / "qwen2", "qwen2", tied=False)
    return [("stories", STORIES, AutoModelForCausalLM.from_pretrained(STORIES).eval(),
             _prompts(PROMPT_LENS, 512)),
            ("qwen2", qwen_dir, tiny_hf_model("qwen2", False), _prompts(PROMPT_LENS, 97))]


def _check_greedy(results, refs, stop):
    got = [r.token_ids for r in results]
    assert got == refs
    reasons = [r.finish_reason for r in results]
    assert reasons == ["stop" if ref[-1] == stop else "length" for ref in refs]
    assert set(reasons) == {"stop", "length"}, reasons      # EOS stopped some, not all


def _tp2_worker(rank, world, cases, sampled_ref):
    mesh = build_mesh(Layout(2, 1, 1))
    for name, model_dir, prompts, stop, refs in cases:
        model = load_decoder(model_dir, mesh)
        results, _ = _greedy(model, prompts, stop=[stop])
        _check_greedy(results, refs, stop)
        if name == "qwen2":
            got = _sample(model, prompts)
            assert [r.token_ids for r in got] == [r[0] for r in sampled_ref]
            for r, (_, lp) in zip(got, sampled_ref):
                assert max(abs(a - b) for a, b in zip(r.logprobs, lp)) < 1e-5


def _sample(model, prompts, max_num_seqs=8):
    engine = Engine(model, RolloutConfig(max_num_seqs=max_num_seqs, max_model_len=64,
                                         max_prefill_tokens=128))
    params = SamplingParams(n=2, temperature=0.9, top_p=0.95, top_k=20, max_tokens=10, seed=7)
    return engine.generate(prompts, params)


@pytest.mark.multiproc
def test_greedy_matches_hf_generate_tp1_tp2(tmp_path):
    tp2_cases = []
    for name, model_dir, hf, prompts in _cases(tmp_path):
        model = load_decoder(model_dir)
        free, _ = _greedy(model, prompts)
        stop = _pick_stop([r.token_ids for r in free])
        refs = _hf_greedy(hf, prompts, stop)
        results, _ = _greedy(model, prompts, stop=[stop])
        _check_greedy(results, refs, stop)
        tp2_cases.append((name, model_dir, prompts, stop, refs))
    sampled = [(r.token_ids, r.logprobs) for r in _sample(model, prompts)]
    run_dist(_tp2_worker, 2, tp2_cases, sampled)


def test_logprobs_match_training_forward(tmp_path):
    model = load_decoder(save_tiny(tmp_path / "q", "qwen2", tied=True))
    prompts = _prompts([4, 9, 2], 97, seed=3)
    engine = Engine(model, RolloutConfig(max_num_seqs=8, max_model_len=32, max_prefill_tokens=64))
    for temperature in (1.0, 0.7):
        params = SamplingParams(n=2, temperature=temperature, max_tokens=12, seed=11)
        results = engine.generate(prompts, params)
        seqs = [prompts[r.prompt_index] + r.token_ids for r in results]
        with torch.no_grad():
            packed = PackedInput.from_lengths(torch.tensor(sum(seqs, [])), [len(s) for s in seqs])
            hidden = model(packed)
            targets = torch.roll(packed.input_ids, -1)
            lp1, _ = model.logprob_entropy(hidden, targets, 1.0)
            lpt, _ = model.logprob_entropy(hidden, targets, temperature)
        start = 0
        for r, s in zip(results, seqs):
            resp = slice(start + len(s) - len(r.token_ids) - 1, start + len(s) - 1)
            assert torch.allclose(torch.tensor(r.logprobs), lp1[resp], atol=1e-5, rtol=0)
            # no top-k / top-p: the processed distribution is softmax(logits / T)
            assert torch.allclose(torch.tensor(r.sampled_logprobs), lpt[resp], atol=1e-5, rtol=0)
            start += len(s)


def _chi2_sf(stat: float, df: int) -> float:
    """Survival function of the chi-square distribution: Q(df/2, stat/2)."""
    return torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                   torch.tensor(stat / 2, dtype=torch.float64)).item()


def _exact_processed(logits, temperature, top_k, top_p):
    """Brute force in float64, Hugging Face's warper order: temperature, top-k, top-p."""
    z = logits.double() / temperature
    kth = z.sort(descending=True).values[top_k - 1]
    z = z.masked_fill(z < kth, float("-inf"))
    order = z.argsort(descending=True)
    p = z.softmax(-1)
    keep = torch.zeros_like(p, dtype=torch.bool)
    mass = 0.0
    for i in order.tolist():
        if mass >= top_p:
            break
        keep[i] = True
        mass += p[i].item()
    p = p * keep
    return p / p.sum()


def _small_vocab_model():
    cfg = ModelConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=16)
    torch.manual_seed(0)
    model = Decoder(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)        # peaked logits, so that top-p cuts inside top-k
    return model


def test_sampling_matches_processed_distribution_chi_square():
    model, prompt, num = _small_vocab_model(), [3, 1, 4], 20000
    with torch.no_grad():
        logits = model.logits(model(PackedInput.from_lengths(torch.tensor(prompt), [3])))[-1]
    expected = _exact_processed(logits, 0.7, 5, 0.9)
    support = expected > 0
    assert 1 < int(support.sum()) < 5          # both filters bite
    engine = Engine(model, RolloutConfig(max_num_seqs=num, max_model_len=8, max_prefill_tokens=8))
    params = SamplingParams(n=num, temperature=0.7, top_p=0.9, top_k=5, max_tokens=1, seed=123)
    results = engine.generate([prompt], params)
    tokens = torch.tensor([r.token_ids[0] for r in results])
    counts = torch.bincount(tokens, minlength=16).double()
    assert counts[~support].sum() == 0
    exp = expected[support] * num
    stat = ((counts[support] - exp) ** 2 / exp).sum().item()
    p_value = _chi2_sf(stat, int(support.sum()) - 1)
    assert p_value > 1e-3, (stat, p_value, counts[support].tolist(), exp.tolist())
    # the processed log-prob is the exact distribution's
    slp = torch.tensor([r.sampled_logprobs[0] for r in results[:50]])
    assert torch.allclose(slp, expected[tokens[:50]].log().float(), atol=1e-5)


@pytest.mark.parametrize("vocab", [16, 5 * CDF_BLOCK, 1000])
def test_inverse_cdf_matches_a_plain_cumsum_search(vocab):
    g = torch.Generator().manual_seed(vocab)
    q = torch.rand(64, vocab, generator=g, dtype=torch.float64)
    q[q < 0.3] = 0.0                                          # filtered tokens have weight 0
    u = torch.rand(64, generator=g, dtype=torch.float64).clamp(1e-6, 1 - 1e-6)
    cdf = q.cumsum(-1)
    expected = torch.searchsorted(cdf, (u.unsqueeze(1) * cdf[:, -1:]))
    assert torch.equal(inverse_cdf(q, u), expected)


def test_inverse_cdf_never_picks_a_zero_weight_token_at_block_edges():
    # Every block ends in a run of zero-weight tokens and every u aims at a block boundary,
    # where rounding between block sums and the in-block cumsum decides.
    vocab, rows = 4 * CDF_BLOCK, 200
    g = torch.Generator().manual_seed(1)
    q = torch.rand(rows, vocab, generator=g)
    q.view(rows, 4, CDF_BLOCK)[:, :, CDF_BLOCK // 2:] = 0.0
    block_cdf = q.view(rows, 4, CDF_BLOCK).sum(-1).cumsum(-1)
    edge = torch.randint(0, 3, (rows,), generator=g)
    u = block_cdf.gather(1, edge.unsqueeze(1)).squeeze(1) / block_cdf[:, -1]
    u = u * (1 + torch.randint(-2, 3, (rows,), generator=g) * 1e-7)       # at, just below/above
    tok = inverse_cdf(q, u.clamp(1e-6, 1 - 1e-6))
    assert (q.gather(1, tok) > 0).all()


def test_fixed_seed_reproduces_independent_of_batching(tmp_path):
    model = load_decoder(save_tiny(tmp_path / "q", "qwen2", tied=False))
    prompts = _prompts([4, 9, 2, 6], 97, seed=5)

    def run(seed, max_num_seqs):
        engine = Engine(model, RolloutConfig(max_num_seqs=max_num_seqs, max_model_len=32,
                                             max_prefill_tokens=32))
        params = SamplingParams(n=3, temperature=0.8, top_p=0.95, max_tokens=10, seed=seed)
        return [r.token_ids for r in engine.generate(prompts, params)]

    first = run(7, 12)
    assert run(7, 12) == first
    assert run(7, 3) == first          # samples depend on (seed, sequence, position) only
    assert run(8, 12) != first
    assert len({tuple(t) for t in first[:3]}) > 1      # the n samples of a prompt differ


def test_continuous_batching_equals_one_by_one(tmp_path):
    model = load_decoder(save_tiny(tmp_path / "q", "qwen2", tied=True))
    prompts = _prompts([3, 12, 5, 1, 9, 7, 2, 15, 4, 6], 97, seed=9)
    free, _ = _greedy(model, prompts, max_num_seqs=16)
    stop = _pick_stop([r.token_ids for r in free])
    batched, engine = _greedy(model, prompts, stop=[stop], max_num_seqs=4)
    assert engine.stats["num_slots"] == 4 and engine.stats["num_prefill_steps"] > 2
    assert {r.finish_reason for r in batched} == {"stop", "length"}
    # the CUDA schedule: finished flags read one step late, graph buckets padded with the
    # scratch slot, every key position masked rather than sliced
    lagged, _ = _greedy(model, prompts, stop=[stop], max_num_seqs=4, steps_in_flight=1,
                        static=True)
    assert [r.token_ids for r in lagged] == [r.token_ids for r in batched]
    assert max(abs(a - b) for r, q in zip(lagged, batched)
               for a, b in zip(r.logprobs, q.logprobs)) < 1e-5
    for p, r in zip(prompts, batched):
        (alone,), _ = _greedy(model, [p], stop=[stop], max_num_seqs=1)
        assert r.token_ids == alone.token_ids
        assert r.finish_reason == alone.finish_reason
        assert max(abs(a - b) for a, b in zip(r.logprobs, alone.logprobs)) < 1e-5


@pytest.mark.parametrize("static", [False, True])
def test_no_decode_step_after_every_row_ran_out(tmp_path, static):
    """With finished flags read one launch late (CUDA), the host still knows when every row
    has generated max_tokens: MAX_NEW tokens take the prefill's token + MAX_NEW - 1 decode
    steps, none more (the step the lag used to add computed nothing that was kept)."""
    model = load_decoder(save_tiny(tmp_path / "q", "qwen2", tied=True))
    prompts = _prompts([3, 12, 5, 9], 97, seed=9)
    runs = [_greedy(model, prompts, steps_in_flight=lag, static=static) for lag in (0, 1)]
    (eager, e0), (lagged, e1) = runs
    assert e0.stats["num_decode_steps"] == e1.stats["num_decode_steps"] == MAX_NEW - 1
    assert [r.token_ids for r in lagged] == [r.token_ids for r in eager]
    assert all(len(r.token_ids) == MAX_NEW for r in lagged)


@pytest.mark.parametrize("lens", [[6, 6, 6], [5, 7, 3, 7, 6]])
def test_padded_causal_attention_matches_packed(lens):
    """The dense prefill attention over right-padded sequences (equal lengths: no copy; else a
    pad index) equals the packed causal attention, GQA included (float64)."""
    from hybridengine.models.attention import PackedCausalAttention
    from hybridengine.rollout.attention import padded_causal_attention
    g = torch.Generator().manual_seed(3)
    T, N = sum(lens), max(lens)
    q = torch.randn(T, 6, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(T, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    ref = PackedCausalAttention(PackedInput.from_lengths(torch.zeros(T, dtype=torch.long),
                                                         lens)).attend(0, q, k, v)
    pad_index = None
    if any(n != N for n in lens):
        pad_index = torch.cat([i * N + torch.arange(n) for i, n in enumerate(lens)])
    out = padded_causal_attention(q, k, v, len(lens), N, pad_index)
    assert torch.allclose(out, ref, atol=1e-12)


def test_dense_width_rounds_the_longest_prompt_up_to_few_shapes():
    """The dense prefill's padded length: a power of two up to 64, then a multiple of 64, never
    shorter than the longest prompt nor more than 63 rows (or 2x) past it."""
    from hybridengine.rollout.prefill_plan import dense_width
    widths = {n: dense_width(n) for n in range(1, 1100)}
    assert [widths[n] for n in (1, 2, 3, 9, 33, 64, 65, 129, 512, 513)] == \
        [2, 2, 4, 16, 64, 64, 128, 192, 512, 576]
    assert all(n <= w <= max(2, min(2 * n, n + 63)) for n, w in widths.items())
    assert set(widths.values()) == {2, 4, 8, 16, 32, 64, *range(128, 1153, 64)}


def test_plan_dense_chooses_the_form_both_runners_take():
    """One decision for the static and the paged runner: dense only where asked and the padding
    to dense_width stays within DENSE_MAX_PADDING; a pad index where a prompt is padded, or
    always when compiled; a forced choice wins."""
    import numpy as np
    from hybridengine.rollout.prefill_plan import plan_dense

    def plan(lens):
        cu = np.concatenate([[0], np.cumsum(lens)])
        return {"cu": cu, "positions": np.concatenate([np.arange(n) for n in lens])}
    p = plan([12, 13])                                   # width 16: 32 rows for 25 tokens
    assert plan_dense(p, 13, "dense", compiled=False) == 16
    assert p["pad_index"].tolist() == [*range(12), *range(16, 29)]
    p = plan([9, 16])                                    # 32 rows for 25 tokens: 1.28x, pays
    assert plan_dense(p, 16, "dense", compiled=False) == 16
    p = plan([3, 16])                                    # 32 rows for 19 tokens: 1.68x
    assert plan_dense(p, 16, "dense", compiled=False) is None and "pad_index" not in p
    assert plan_dense(p, 16, "dense", compiled=False, force=True) == 16 and "pad_index" in p
    p = plan([16, 16])                                   # nothing padded
    assert plan_dense(p, 16, "dense", compiled=False) == 16 and "pad_index" not in p
    assert plan_dense(p, 16, "dense", compiled=True) == 16 and "pad_index" in p
    assert plan_dense(plan([16, 16]), 16, "varlen", compiled=True) is None
    assert plan_dense(plan([16, 16]), 16, "dense", compiled=True, force=False) is None


def test_dense_prefill_equals_varlen_prefill(tmp_path, monkeypatch):
    """The engine with the dense prefill attention (prompts padded to the longest of each
    prefill while that costs at most DENSE_MAX_PADDING; beyond it, varlen) gives the varlen
    prefill's tokens and log-probs. Compiled, it always passes a pad index (one dense graph)."""
    import hybridengine.rollout.attention as rollout_attention
    calls = []
    dense_fn = rollout_attention.padded_causal_attention
    monkeypatch.setattr(rollout_attention, "padded_causal_attention",
                        lambda *a: calls.append(a[5] is None) or dense_fn(*a))
    model = load_decoder(save_tiny(tmp_path / "q", "qwen2", tied=True))
    layers = len(model.layers)
    for lens, used in (([9, 12, 10, 12], [False] * layers), ([8, 8, 8], [True] * layers),
                       ([2, 14, 3], [])):       # padded, exact, too much padding: varlen
        prompts = _prompts(lens, 97, seed=sum(lens))
        runs = []
        for mode, compiled in (("varlen", CompileMode.EAGER), ("dense", CompileMode.EAGER),
                               ("dense", CompileMode.AOT_EAGER)):
            calls.clear()
            eager = compiled is CompileMode.EAGER
            engine = Engine(model, RolloutConfig(max_num_seqs=8, max_model_len=64,
                                                 max_prefill_tokens=128, prefill_attention=mode,
                                                 compile_prefill=compiled))
            runs.append(engine.generate(prompts, SamplingParams(temperature=0.0,
                                                                max_tokens=6)))
            assert engine.runner.prefill_compiled == (not eager)   # no eager fallback
            if eager:                           # one call per layer, pad index or none
                assert calls == (used if mode == "dense" else [])
        assert not any(calls)                   # (traced calls) never without a pad index
        varlen = runs[0]
        for dense in runs[1:]:
            assert [r.token_ids for r in dense] == [r.token_ids for r in varlen]
            assert max(abs(a - b) for r, q in zip(dense, varlen)
                       for a, b in zip(r.logprobs, q.logprobs)) < 1e-5


def _varlen_seqused_reference(q, k, v, cu_q, cu_k, seqused, max_q, max_k):
    """Flash varlen semantics, non-causal, with seqused_k: the query rows
    q[cu_q[i] : cu_q[i+1]] of sequence i attend to k[cu_k[i] : cu_k[i] + used[i]]; query head h
    uses K/V head h // (h_q / h_kv)."""
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    for i in range(len(seqused)):
        rows = slice(int(cu_q[i]), int(cu_q[i + 1]))
        assert rows.stop - rows.start <= max_q
        s, n = int(cu_k[i]), int(seqused[i])
        ks = k[s:s + n].repeat_interleave(group, 1)                     # [n, h_q, d]
        vs = v[s:s + n].repeat_interleave(group, 1)
        w = torch.einsum("qhd,nhd->qhn", q[rows], ks) / q.shape[-1] ** 0.5
        out[rows] = torch.einsum("qhn,nhd->qhd", w.softmax(-1), vs)
    return out


@pytest.mark.parametrize("backend", ["flash", "flash_per_head"])
def test_flash_decode_arguments_match_sdpa(monkeypatch, backend):
    """The flash backends' cu_seqlens / seqused_k address the right cache tokens, and `flash`
    maps each K/V head's query heads to query rows and back (kernel replaced by a reference of
    its documented semantics; the kernel itself needs CUDA)."""
    from hybridengine.rollout import attention
    from hybridengine.rollout.kv_cache import KVCache
    monkeypatch.setattr(attention, "_FLASH_DECODE", _varlen_seqused_reference)
    g = torch.Generator().manual_seed(0)
    cache = KVCache(2, 5, 16, 2, 8, torch.float32, torch.device("cpu"))
    for t in cache.k + cache.v:
        t.copy_(torch.randn(t.shape, generator=g))
    slots, pos = torch.tensor([0, 2, 3, 5, 5]), torch.tensor([9, 0, 15, 0, 0])
    q, k = torch.randn(5, 6, 8, generator=g), torch.randn(5, 2, 8, generator=g)   # G = 3
    tail, cu_q = torch.tensor([6 * 16]), torch.arange(6, dtype=torch.int32)
    outs = [attention.DecodeContext(cache, 1, slots, pos, name, 16, cu_q, tail)
            .attend(1, q, k, k) for name in (backend, "sdpa")]
    assert torch.allclose(outs[0], outs[1], atol=1e-5)
    assert torch.equal(cache.k[0][3, 15], k[2]) and torch.equal(cache.k[0][0, 9], k[0])


def test_free_cache_then_generate_again():
    model = _small_vocab_model()
    engine = Engine(model, RolloutConfig(max_num_seqs=4, max_model_len=12, kv_cache_tokens=5 * 12))
    params = SamplingParams(n=2, max_tokens=6, seed=3)
    first = engine.generate([[1, 2, 3], [4]], params)
    assert engine.runner.num_slots == 4
    engine.free_cache()
    assert engine.runner.cache is None
    again = engine.generate([[1, 2, 3], [4]], params)
    assert [r.token_ids for r in again] == [r.token_ids for r in first]
    assert [(r.prompt_index, r.sample_index) for r in again] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(len(r.token_ids) == 6 for r in again)


def test_cache_budget_keeps_the_prefill_peak_until_the_config_changes(monkeypatch):
    """gpu_memory_utilization's budget: the prefill probe's peak is measured at the first
    allocation only (free_cache_engine frees the cache every step); the budget follows what is
    allocated at each call, and a config of another prefill size, length or row count measures
    again. (The device calls replaced: the budget is CUDA's; the GPU test runs the real probe.)"""
    from dataclasses import replace
    from hybridengine.rollout.kv_cache import DEVICE_RESERVE
    engine = Engine(_small_vocab_model(), RolloutConfig(max_num_seqs=4, max_model_len=12,
                                                        gpu_memory_utilization=0.5))
    runner, total, allocated, measured = engine.runner, 10_000_000, [1_000_000], []
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: type("Props", (), {"total_memory": total}))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: allocated[0])
    monkeypatch.setattr(runner, "_measure_prefill_peak",
                        lambda: measured.append(runner.config.max_num_seqs) or 300_000)
    budget = lambda: int((0.5 - DEVICE_RESERVE) * total - allocated[0] - 300_000)  # noqa: E731
    assert runner._free_bytes_for_cache() == budget()
    allocated[0] = 2_500_000                     # more held at the next step's allocation
    assert runner._free_bytes_for_cache() == budget()
    assert measured == [4]
    runner.config = replace(runner.config, max_num_seqs=8)
    assert runner._free_bytes_for_cache() == budget()
    assert measured == [4, 8]


def test_stats_count_slots_and_the_sequences_that_waited():
    """8 sequences on kv_cache_tokens = 4 rows of 12 (3 slots + the scratch row; the trainer's
    engine is capped by memory instead) run in waves: 3 at once, 5 wait, and SlotUse's warning
    says so; on 8 slots they all run at once."""
    from hybridengine.hybrid.generator import SlotUse
    model = _small_vocab_model()
    prompts, params = [[1, 2, 3], [4], [5, 6], [7]], SamplingParams(n=2, max_tokens=6, seed=3)

    def slot_use(**budget):
        engine = Engine(model, RolloutConfig(max_model_len=12, **budget))
        engine.generate(prompts, params)
        s = engine.stats
        return SlotUse(s["num_slots"], s["max_concurrent"], s["num_seqs"], s["num_waited"])

    waves = slot_use(max_num_seqs=8, kv_cache_tokens=4 * 12)
    assert waves == SlotUse(num_slots=3, max_concurrent=3, num_seqs=8, num_waited=5)
    assert waves.metrics() == {"rollout/num_slots": 3, "rollout/max_concurrent": 3,
                               "rollout/preemptions": 0}
    assert waves.warning(max_num_seqs=8) == (
        "the rollout ran in waves: a generation replica got 8 sequences but its KV cache holds 3 "
        "(rollout/num_slots): at most 3 ran at once, 5 waited for a free slot; the memory left "
        "for the cache caps the slots: more with a higher actor_rollout_ref.rollout."
        "gpu_memory_utilization or tensor_model_parallel_size, the actor's megatron."
        "optimizer_offload or param_offload, or a shorter data.max_prompt_length + "
        "max_response_length")
    assert slot_use(max_num_seqs=3).warning(max_num_seqs=3).endswith(
        "; actor_rollout_ref.rollout.max_num_seqs=3 caps the slots")
    fits = slot_use(max_num_seqs=8)
    assert fits == SlotUse(num_slots=8, max_concurrent=8, num_seqs=8, num_waited=0)
    assert fits.warning(max_num_seqs=8) is None


def test_scheduler_budget_shared_prompts_and_slot_order():
    sched = Scheduler(SlotAllocator(4), max_prefill_tokens=10)
    for i, (prompt_index, n) in enumerate([(0, 6), (0, 6), (1, 5), (2, 3)]):
        sched.add(Sequence(i, prompt_index, [1] * n, 4, 0))
    first = sched.schedule_prefill()
    assert [s.seq_id for s in first] == [0, 1]         # prompt 0 counted once; prompt 1 > budget
    assert [s.seq_id for s in sched.schedule_prefill()] == [2, 3]
    assert sched.schedule_prefill() == []              # no free slot
    sched.finish(1)
    assert [s.slot for s in sched.decode_rows()] == [0, 2, 3]
    assert graph_buckets(256) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256]
    assert graph_buckets(5) == [1, 2, 4, 5] and graph_buckets(100)[-3:] == [64, 96, 100]


def test_bad_inputs_one_line_errors():
    model = _small_vocab_model()
    engine = Engine(model, RolloutConfig(max_num_seqs=2, max_model_len=8))
    params = SamplingParams(max_tokens=2)
    seeded = SamplingParams(max_tokens=2, seed=3)
    good = engine.generate([[1, 2], [3]], seeded)
    for prompts, match in [([[]], "prompt 0 is empty"), ([[1] * 8], "leaves no room"),
                           ([[1, 16]], "prompt 0 has token id 16 outside the vocabulary"),
                           ([[1, 2], [3, -1]], "prompt 1 has token id -1 outside")]:
        with pytest.raises(ValueError, match=match):
            engine.generate(prompts, params)
    # an error raised by a prefill (token ids are checked there) leaves the engine usable
    again = engine.generate([[1, 2], [3]], seeded)
    assert [r.token_ids for r in again] == [r.token_ids for r in good]
    for kw, match in [({"top_p": 0.0}, "top_p"), ({"n": 0}, "n=0"),
                      ({"temperature": -1.0}, "temperature"), ({"max_tokens": 0}, "max_tokens")]:
        with pytest.raises(ValueError, match=match):
            SamplingParams(**kw)
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        Engine(model, RolloutConfig(max_model_len=8, max_prefill_tokens=4))
    with pytest.raises(ValueError, match="kv_cache_tokens"):
        Engine(model, RolloutConfig(max_model_len=8, kv_cache_tokens=8)).generate([[1]], params)
    # the checks that need no model fail where the config is built
    for kw, match in [({"attn_backend": "paged"}, "attn_backend='paged' is not one of"),
                      ({"prefill_attention": "paged"}, "prefill_attention='paged' is not one of"),
                      ({"max_num_seqs": 0}, "max_num_seqs=0 must be >= 1"),
                      ({"gpu_memory_utilization": 0.0}, r"gpu_memory_utilization=0.0 must be"),
                      ({"compile": CompileMode.CPP_WRAPPER},
                       "compile=CompileMode.CPP_WRAPPER: the decode step takes"),
                      ({"compile_prefill": CompileMode.MAX_AUTOTUNE},
                       "compile_prefill=CompileMode.MAX_AUTOTUNE: the prefill step takes"),
                      ({"compile": True}, r"compile=True \(not a CompileMode\)"),
                      ({"compile_prefill": CompileMode.AOT_EAGER.value},   # its string: no mode
                       r"compile_prefill='aot_eager' \(not a CompileMode\)")]:
        with pytest.raises(ValueError, match=match):
            RolloutConfig(**kw)


def test_auto_backend_falls_back_triton_then_flash_then_per_head_then_sdpa(monkeypatch):
    """auto takes the Triton kernel when it agrees with SDPA on the device, else the grouped
    flash call, else the per-head call, else SDPA (the check itself runs on the GPU; here its
    verdicts are given)."""
    from hybridengine.rollout import attention
    monkeypatch.setattr(attention, "_FLASH_DECODE", _varlen_seqused_reference)
    monkeypatch.setattr(attention.triton_decode, "available", lambda device: True)
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    for works, expected in [({"triton", "flash", "flash_per_head"}, "triton"),
                            ({"flash", "flash_per_head"}, "flash"),
                            ({"flash_per_head"}, "flash_per_head"), (set(), "sdpa")]:
        monkeypatch.setattr(attention, "_decode_agrees",
                            lambda device, dtype, backend, heads, settings, ok=works:
                            backend in ok)
        assert attention.resolve_backend("auto", cuda, bf16) == expected
    assert attention.resolve_backend("auto", torch.device("cpu"), torch.float32) == "sdpa"
    with pytest.raises(ValueError, match="attn_backend='flash_per_head' needs CUDA"):
        attention.resolve_backend("flash_per_head", torch.device("cpu"), torch.float32)
    # a head shape the Triton kernel does not take (stories260K: head_dim 8) skips it
    monkeypatch.setattr(attention, "_decode_agrees",
                        lambda device, dtype, backend, heads, settings: True)
    assert attention.resolve_backend("auto", cuda, bf16, (8, 4, 8)) == "flash"
    with pytest.raises(ValueError, match="power-of-two head_dim >= 16"):
        attention.resolve_backend("triton", cuda, bf16, (8, 4, 8))


def _run_in_triton_interpreter(*scripts: str) -> None:
    """Run each check script in a fresh process (it sets TRITON_INTERPRET=1 before importing
    the kernels); each prints "ok" when every assertion held. Several scripts run at once: the
    interpreter is single-threaded, and CI's second core is otherwise idle during the test."""
    pytest.importorskip("triton")
    import subprocess
    import sys
    import tempfile
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        try:
            for i, script in enumerate(scripts):
                out, err = (open(os.path.join(tmp, f"{i}.{s}"), "w+") for s in ("out", "err"))
                procs.append((subprocess.Popen([sys.executable, "-c", script], stdout=out,
                                               stderr=err, text=True, env=env), out, err))
            for proc, out, err in procs:
                proc.wait(timeout=300)
            for proc, out, err in procs:
                out.seek(0)
                err.seek(0)
                assert proc.returncode == 0 and out.read().strip() == "ok", err.read()[-3000:]
        finally:
            for proc, out, err in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                out.close()
                err.close()


def interpreter_results(scripts: dict[str, str]) -> dict:
    """Each check script (as _run_in_triton_interpreter runs it) in a fresh process, two at a
    time (the interpreter is single-threaded; CI has 2 cores), in the order given (the longest
    first balances the two); returns once all ended: {name: subprocess.CompletedProcess}."""
    pytest.importorskip("triton")
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with ThreadPoolExecutor(2) as pool:
        jobs = {name: pool.submit(subprocess.run, [sys.executable, "-c", script],
                                  capture_output=True, text=True, env=env, timeout=300)
                for name, script in scripts.items()}
        return {name: job.result() for name, job in jobs.items()}


def assert_printed_ok(proc) -> None:
    """A check script of interpreter_results held every assertion (it printed "ok")."""
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


@pytest.fixture(scope="module")
def interpreter_checks():
    """This module's five interpreter check scripts, run once, two at a time, the longest
    first (instead of one test at a time, where three of them ran alone on one core)."""
    return interpreter_results({"sampler_draws": SAMPLER_DRAWS_CHECK, "sampler": SAMPLER_CHECK,
                                "decode": TRITON_CHECK, "settings": SETTINGS_CHECK,
                                "kv_write": KV_WRITE_CHECK})


# The tail of an interpreter check script that defined `model`, `prompts`, `max_model_len` and
# `max_tokens`: greedy tokens and log-probs of the engine on the triton backend as on SDPA.
TRITON_MATCHES_SDPA = """
from hybridengine.rollout.engine import Engine
from hybridengine.rollout.rollout_config import RolloutConfig
from hybridengine.rollout.sampling import SamplingParams
engines = {b: Engine(model, RolloutConfig(max_num_seqs=4, max_model_len=max_model_len,
                                          attn_backend=b))
           for b in ("triton", "sdpa")}
assert engines["triton"].runner.backend == "triton"
runs = {b: e.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
        for b, e in engines.items()}
for a, b in zip(runs["triton"], runs["sdpa"]):
    assert a.token_ids == b.token_ids
    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
print("ok")
"""


TRITON_CHECK = """
import os, sys, torch
os.environ["TRITON_INTERPRET"] = "1"          # Triton's CPU interpreter
import hybridengine.kernels.decode_attention as da
from hybridengine.kernels.decode_attention import decode_attention, decode_attention_rope
from hybridengine.models.attention import RotaryEmbedding, apply_rope
from hybridengine.rollout.attention import grouped_sdpa
torch.manual_seed(0)
S, L, hkv, G, d = 5, 200, 2, 7, 64
rope = RotaryEmbedding(d, 10000.0)
# 64 "SMs": several splits (empty ones too) and the merge; 1: one split, no merge
for dtype, tol, sms in ((torch.float32, 1e-5, 64), (torch.float16, 2e-3, 64),
                        (torch.float32, 1e-5, 1), (torch.float16, 2e-3, 1)):
    da._num_sms = lambda device, n=sms: n
    assert (da.split_len(4, hkv, L, sms) < L) == (sms > 1)
    k, v = (torch.randn(S + 1, L, hkv, d).to(dtype) for _ in range(2))
    slots = torch.tensor([3, 0, 4, 5])
    seqlens = torch.tensor([1, 200, 77, 130], dtype=torch.int32)   # one key .. the whole row
    # q, k, v as the decode step hands them over: strided views of the fused qkv projection
    qkv = torch.randn(4, hkv * G + 2 * hkv, d).to(dtype)
    q, k_new, v_new = qkv[:, : hkv * G], qkv[:, hkv * G: -hkv], qkv[:, -hkv:]
    out = decode_attention(q, k, v, slots, seqlens)
    assert out.is_contiguous() and not q.is_contiguous()
    mask = (torch.arange(L) < seqlens.unsqueeze(1))[:, None, None, :]
    kg, vg = (t[slots].transpose(1, 2).float() for t in (k, v))
    err = (out.float() - grouped_sdpa(q.float(), kg, vg, mask)).abs().max().item()
    assert out.dtype == dtype and err < tol, (dtype, err)
    # the fused form: RoPE of q and k_new, k_new / v_new written at the slot's position (the
    # last row sits one past the cache: it writes at L - 1 and reads all L), attention
    by_slot = torch.full((S + 1,), 10**6)
    by_slot[slots] = torch.tensor([0, 199, 76, 200])
    pos = by_slot[slots].clamp(max=L - 1)
    cos, sin = rope(by_slot[slots])
    kc, vc = k.clone(), v.clone()
    out = decode_attention_rope(q, k_new, v_new, cos, sin, kc, vc, slots, by_slot)
    # the tables rounded to the dtype as apply_rope does, one rounding at the end (as the
    # compiled apply_rope computes it)
    qk = apply_rope(qkv[:, :-hkv].float(), cos.to(dtype).float(), sin.to(dtype).float()).to(dtype)
    k[slots, pos] = qk[:, hkv * G:]
    v[slots, pos] = v_new
    assert torch.equal(kc, k) and torch.equal(vc, v), dtype     # the cache write, bit for bit
    kg, vg = (t[slots].transpose(1, 2).float() for t in (k, v))
    mask = (torch.arange(L) <= pos.unsqueeze(1))[:, None, None, :]
    ref = grouped_sdpa(qk[:, : hkv * G].float(), kg, vg, mask)
    err = (out.float() - ref).abs().max().item()
    assert out.dtype == dtype and err < tol, (dtype, err, "rope")
# The engine on the triton backend: greedy tokens and log-probs as on SDPA.
from hybridengine.models.decoder import Decoder, ModelConfig
cfg = ModelConfig(vocab_size=50, hidden_size=64, intermediate_size=96, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16)
model = Decoder(cfg)
prompts = [[1, 2, 3], [7] * 70, [4, 9]]
max_model_len, max_tokens = 96, 12
""" + TRITON_MATCHES_SDPA


def test_triton_decode_attention_matches_sdpa_in_the_interpreter(interpreter_checks):
    """The Triton split-KV kernel (several splits, empty ones included) against grouped SDPA,
    run by Triton's CPU interpreter (bf16 is checked on the GPU: the interpreter lacks it)."""
    assert_printed_ok(interpreter_checks["decode"])


KV_WRITE_CHECK = """
import os, torch
os.environ["TRITON_INTERPRET"] = "1"          # Triton's CPU interpreter
from hybridengine.kernels.kv_write import write_kv_rows
from hybridengine.rollout import attention
torch.manual_seed(0)
S, L, hkv, d, T = 4, 50, 2, 16, 37
for dtype in (torch.float32, torch.float16):
    # k as the prefill hands it over: a view of the RoPE output [T, h_q + h_kv, d]; v a view
    # of the qkv projection [T, (h_q + 2 h_kv) d]; two samples of one prompt share the rows
    qk = torch.randn(T, 6 + hkv, d).to(dtype)
    qkv = torch.randn(T, (6 + 2 * hkv) * d).to(dtype)
    k, v = qk[:, 6:], qkv[:, -hkv * d:].view(T, hkv, d)
    src = torch.cat([torch.arange(T), torch.arange(20)])
    dst_slot = torch.cat([torch.full((T,), 2), torch.full((20,), 0)])
    dst_pos = torch.cat([torch.arange(T), torch.arange(20)])
    caches = [torch.randn(S + 1, L, hkv, d).to(dtype) for _ in range(2)]
    ref = [t.clone() for t in caches]
    ref[0][dst_slot, dst_pos] = k[src]
    ref[1][dst_slot, dst_pos] = v[src]
    write_kv_rows(*caches, dst_slot, dst_pos, k, v, src)
    assert all(torch.equal(a, b) for a, b in zip(caches, ref)), dtype
    # the custom op takes the kernel in the interpreter, the torch path without it
    # (RolloutKernelSettings.triton_kv_write)
    for use in (True, False):
        out = [t.clone() for t in ref]
        for t in out:
            t[dst_slot, dst_pos] = 0
        attention.write_prefill_kv(*out, dst_slot, dst_pos, k, v, src, use)
        assert all(torch.equal(a, b) for a, b in zip(out, ref)), (dtype, use)
print("ok")
"""


def test_triton_kv_write_matches_index_put_in_the_interpreter(interpreter_checks):
    """The prefill's Triton K/V cache write (strided rows, two cache rows from one packed row)
    equals torch's index_put bit for bit, as does the op that chooses between them."""
    assert_printed_ok(interpreter_checks["kv_write"])


SAMPLER_HEAD = """
import os, torch
os.environ["TRITON_INTERPRET"] = "1"          # Triton's CPU interpreter
from hybridengine.kernels.sampler import sample_temperature
from hybridengine.rollout.sampling import SamplerMode, sample_torch, uniforms
torch.manual_seed(0)
"""
SAMPLER_CHECK = SAMPLER_HEAD + """
keys = torch.randint(0, 2**32, (16,), dtype=torch.int64)     # 16 rows: the interpreter's
u = uniforms(keys, torch.arange(16))                        # time goes by programs
# 1000: a partial last block, one chunk; 5000: three chunks with maxima far apart; the last
# with every logit far below zero (a padded block's weight must not overflow to inf)
for V, spread, shift in ((1000, 3.0, 0.0), (5000, 12.0, 0.0), (5000, 3.0, -200.0)):
    z = torch.randn(16, V) * spread + shift
    z[:, : V // 3] -= 20.0                      # the chunks' maxima differ by ~20 nats
    for T in (1.0, 0.7):
        mode = SamplerMode(False, 0, False, T != 1.0)
        temp = torch.tensor([T])
        for dtype in (torch.float32, torch.float16):
            x = z.to(dtype)
            tok, lp, slp = sample_temperature(x, temp, u, scaled=T != 1.0)
            rtok, rlp, rslp = sample_torch(x, mode, temp, torch.ones(1), u)
            assert tok.dtype == torch.int64 and torch.equal(tok, rtok), (V, T, dtype)
            # log-probs against float64 (the torch path's own z / T rounds at |z| ~ 200)
            x64 = x.double()
            exact = x64.log_softmax(-1).gather(1, tok[:, None])[:, 0]
            exact_t = (x64 / T).log_softmax(-1).gather(1, tok[:, None])[:, 0]
            assert (lp - exact).abs().max() < 1e-5 and (slp - exact_t).abs().max() < 1e-5
print("ok")
"""
SAMPLER_DRAWS_CHECK = SAMPLER_HEAD + """
# the draw's distribution: 480 draws from one row against softmax(z / 0.7), chi-square over
# 8 tokens spread across two blocks (the rest has weight ~0); the live logits close enough
# that every token expects >= 20 draws (the interpreter's time goes by draws: one program each)
z = torch.full((136,), -40.0)
live = torch.tensor([0, 5, 60, 127, 128, 130, 131, 135])
z[live] = torch.tensor([1.0, 0.8, 0.3, -0.2, 0.0, 0.6, -0.1, 0.5])
n = 480
tok, _, slp = sample_temperature(z.expand(n, -1), torch.tensor([0.7]),
                                 uniforms(torch.full((n,), 12345), torch.arange(n)))
p = torch.softmax(z.double() / 0.7, -1)
assert (n * p[live]).min() >= 20
counts = torch.bincount(tok, minlength=136).double()
assert counts.sum() == counts[live].sum()
stat = ((counts[live] - n * p[live]) ** 2 / (n * p[live])).sum().item()
q = torch.special.gammaincc(torch.tensor(7 / 2, dtype=torch.float64),
                            torch.tensor(stat / 2, dtype=torch.float64)).item()
assert q > 1e-3, (stat, q)
assert torch.allclose(slp.double(), p[tok].log(), atol=1e-5)
print("ok")
"""


def test_fused_sampler_matches_the_torch_sampler_in_the_interpreter(interpreter_checks):
    """The Triton temperature sampler (kernels/sampler.py) draws the torch sampler's tokens
    from the same uniforms, over partial blocks, several chunks and a row far below zero, fp32
    and fp16 logits, with log-probs within 1e-5 of float64; its draws follow softmax(z / T)
    (chi-square)."""
    # two processes (no value depends on the other half: the draws' uniforms come from fixed
    # keys, not from the generator seeded above)
    assert_printed_ok(interpreter_checks["sampler"])
    assert_printed_ok(interpreter_checks["sampler_draws"])


SETTINGS_CHECK = """
import os, torch
os.environ["TRITON_INTERPRET"] = "1"          # Triton's CPU interpreter
from unittest import mock
from hybridengine.kernels import decode_attention as da, sampler as fs
from hybridengine.kernels.settings import RolloutKernelSettings
from hybridengine.models.decoder import Decoder, ModelConfig
from hybridengine.rollout.engine import Engine
from hybridengine.rollout.rollout_config import RolloutConfig
from hybridengine.rollout.sampling import SamplingParams
torch.manual_seed(0)
cfg = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=1,
                  num_heads=4, num_kv_heads=2, head_dim=16)
model = Decoder(cfg)
other = RolloutKernelSettings(decode_block_n=16, decode_num_warps=2, decode_num_stages=2,
                              pdl=False, decode_prefetch_keys=0, sampler_chunk_blocks=4,
                              sampler_chunk_warps=4)
engines = {s: Engine(model, RolloutConfig(max_num_seqs=3, max_model_len=40, attn_backend="triton",
                                         kernels=s)) for s in (RolloutKernelSettings(), other)}
seen = []
launch, sample = da._launch, fs.sample_temperature
def launch_spy(*a, **k):
    seen.append(("attention", k["block_n"], k["num_warps"], k["num_stages"], k["pdl"],
                 k["prefetch_keys"]))
    return launch(*a, **k)
def sample_spy(*a, **k):
    seen.append(("sampler", k["chunk_blocks"], k["chunk_warps"]))
    return sample(*a, **k)
runs = []
with mock.patch.object(da, "_launch", launch_spy), \\
        mock.patch.object(fs, "sample_temperature", sample_spy):
    for s, engine in list(engines.items()) * 2:          # interleaved: each keeps its own
        seen.clear()
        runs.append(engine.generate([[1, 2, 3], [7] * 20],
                                    SamplingParams(temperature=0.9, max_tokens=6, seed=3)))
        assert set(seen) == {("attention", s.decode_block_n, s.decode_num_warps,
                              s.decode_num_stages, s.pdl, s.decode_prefetch_keys),
                             ("sampler", s.sampler_chunk_blocks, s.sampler_chunk_warps)}, seen
for run in runs[1:]:                                     # the same tokens under every setting
    assert [r.token_ids for r in run] == [r.token_ids for r in runs[0]]
print("ok")
"""


def test_kernel_settings_reach_the_launchers_per_engine(interpreter_checks):
    """Two engines in one process with different RolloutKernelSettings: each one's decode
    attention and fused sampler launch with its own tile, warps, stages, PDL and prefetch
    (interleaved generate calls, Triton's interpreter), and the tokens are the same."""
    assert_printed_ok(interpreter_checks["settings"])


@pytest.mark.parametrize("static", [False, True])
def test_compiled_decode_and_bookkeeping_equal_eager(static):
    """compile (aot_eager here) runs the decode forward, the random stream's hashing and the
    per-step result / state updates through torch.compile: with continuous batching (3 slots,
    6 prompts, a stop token ending some early) and graph-shaped padded steps, the sampled
    tokens and log-probs equal eager's."""
    model = load_decoder(STORIES)
    prompts = _prompts([5, 17, 2, 9, 30, 4], 512, seed=11)
    free, _ = _greedy(model, prompts)
    stop = _pick_stop([r.token_ids for r in free])
    params = SamplingParams(temperature=0.8, max_tokens=MAX_NEW, stop_token_ids=(stop,), seed=5)
    runs = []
    for compile in (CompileMode.EAGER, CompileMode.AOT_EAGER):
        engine = Engine(model, RolloutConfig(max_num_seqs=3, max_model_len=64,
                                             max_prefill_tokens=128, compile=compile))
        engine.runner.static_shapes = static
        runs.append(engine.generate(prompts, params))
    plain, compiled = runs
    assert [r.token_ids for r in compiled] == [r.token_ids for r in plain]
    assert any(r.finish_reason == "stop" for r in plain)
    assert any(r.finish_reason == "length" for r in plain)
    assert all(abs(a - b) < 1e-5 for x, y in zip(compiled, plain)
               for a, b in zip(x.logprobs + x.sampled_logprobs, y.logprobs + y.sampled_logprobs))


def test_compiled_prefill_equals_eager_and_falls_back(monkeypatch, caplog):
    """compile_prefill (aot_eager here: the trace, not inductor's kernels) gives eager's tokens
    and log-probs across prefills of different shapes; a prefill that fails to compile runs
    eagerly from then on, with one warning."""
    model = load_decoder(STORIES)
    prompts = _prompts([5, 17, 2, 9, 30, 4], 512, seed=7)
    plain, _ = _greedy(model, prompts, max_num_seqs=3)          # several prefills of new shapes
    compiled, engine = _greedy(model, prompts, max_num_seqs=3,
                               compile_prefill=CompileMode.AOT_EAGER)
    assert [r.token_ids for r in compiled] == [r.token_ids for r in plain]
    assert all(abs(a - b) < 1e-5 for x, y in zip(compiled, plain)
               for a, b in zip(x.logprobs, y.logprobs))
    assert engine.runner.prefill_compiled

    def broken(fn, **kw):
        def run(*a, **k):
            raise RuntimeError("inductor says no")
        return run
    monkeypatch.setattr(torch, "compile", broken)
    with caplog.at_level("WARNING", logger="hybridengine.rollout.model_runner"):
        fallback, engine = _greedy(model, prompts, max_num_seqs=3,
                                   compile_prefill=CompileMode.INDUCTOR)
    assert [r.token_ids for r in fallback] == [r.token_ids for r in plain]
    assert not engine.runner.prefill_compiled
    assert sum("compiled prefill failed (RuntimeError: inductor says no)" in r.message
               for r in caplog.records) == 1
