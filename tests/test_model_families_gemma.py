"""Sliding-window and Gemma families against Hugging Face: Mistral (a window on every layer),
Gemma 2 ((1 + w) sandwich norms, GeGLU, √hidden embedding scale, attention- and final-logit
soft-caps, query_pre_attn_scalar, alternating sliding / full layers, tied embeddings) and Gemma 3
text (q/k norms, a RoPE base of its own for sliding layers, no soft-caps). Windows of 5 keys and
sequences up to 40 tokens, so the window matters. Packed logits, save_hf -> transformers, the
rollout engine's greedy tokens against generate, the reshard plan, the memory plan's parameter
list; Gemma 2 at tp 2 (SP off and on): logits, fp64 gradients through the capped log-probs and
greedy tokens."""
import dataclasses

import pytest
import torch

from dist_utils import run_dist
from hybridengine.models.decoder import Decoder
from hybridengine.models.hf import load_decoder, read_model_config, save_hf
from hybridengine.parallel.layout import GenLayout, Layout
from hybridengine.parallel.mesh import build_mesh
from hybridengine.rollout.engine import Engine
from hybridengine.rollout.rollout_config import RolloutConfig
from hybridengine.rollout.sampling import SamplingParams
from model_utils import rel_err, save_cases
# the shared fixtures of the families tests (the same vocabulary, lengths and prompts)
from test_rollout import TRITON_MATCHES_SDPA
from test_model_families import (MAX_NEW, VOCAB, _engine_greedy, _hf_greedy, _hf_logits,
                                 _loss_and_grads, _packed_logits, _prompts)

WINDOW = 5
CASES = ["mistral", "gemma2", "gemma3"]


def family_hf_model(name: str, seed: int = 0, vocab: int = VOCAB):
    """A random tiny HF model of family `name` (GQA: 4 heads, 2 K/V heads, head_dim 16)."""
    import transformers as tf
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                  rms_norm_eps=1e-6, sliding_window=WINDOW)
    if name == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(
            num_hidden_layers=2, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, **common))
    elif name == "gemma2":      # caps small enough to bend random logits; scalar != head_dim
        model = tf.Gemma2ForCausalLM(tf.Gemma2Config(
            num_hidden_layers=3, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
            query_pre_attn_scalar=24, attn_implementation="eager",
            rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, **common))
    else:                       # sliding, sliding, full; full layers at head_dim's scale
        model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(
            num_hidden_layers=3, query_pre_attn_scalar=16, sliding_window_pattern=3,
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default",
                                                   "rope_theta": 100.0}}, **common))
    with torch.no_grad():   # random norm weights, so a wrong mapping or (1 + w) shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.normal_(0.0 if name != "mistral" else 1.0, 0.3)
    return model.eval()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return save_cases(tmp_path_factory.mktemp("gemma_families"), family_hf_model, CASES)


def test_config_and_plans_see_the_family(dirs):
    """read_model_config's fields; the memory plan's parameter list and num_params equal the
    Decoder's and HF's; the vLLM weight stream names every HF tensor (the sandwich norms)."""
    from hybridengine.hybrid.hf_stream import hf_weight_stream
    from hybridengine.train.memory_plan import stage_params
    for name in CASES:
        cfg = read_model_config(dirs[name])
        hf = family_hf_model(name)
        assert cfg.sliding_window == WINDOW and cfg.model_type == hf.config.model_type
        slides = [cfg.is_sliding(i) for i in range(cfg.num_layers)]
        assert slides == {"mistral": [True, True], "gemma2": [True, False, True],
                          "gemma3": [True, True, False]}[name]
        assert cfg.num_params() == sum(p.numel() for p in hf.parameters())
        decoder = Decoder(cfg, device="meta")
        assert [(n, tuple(p.shape)) for n, p in decoder.named_parameters()] == \
            stage_params(cfg, 1)
        names = {n for n, _ in hf_weight_stream(load_decoder(dirs[name]), None, 1.0)}
        assert names == set(hf.state_dict()) - ({"lm_head.weight"}
                                                if cfg.tie_word_embeddings else set())
    gemma2 = read_model_config(dirs["gemma2"])
    assert (gemma2.attn_softcap, gemma2.final_softcap, gemma2.query_pre_attn_scalar) == \
        (2.0, 3.0, 24.0)
    assert read_model_config(dirs["gemma3"]).rope_local_theta == 100.0


@pytest.mark.parametrize("name", CASES)
def test_logits_match_hf_packed(dirs, name):
    model = load_decoder(dirs[name])
    ref = _hf_logits(family_hf_model(name))
    assert rel_err(_packed_logits(model), ref) < 1e-5
    # the window (and Gemma 2's caps) matter at these lengths: without them, other logits
    for layer in model.layers:
        attn = layer.self_attn
        if attn.spec is not None:
            attn.spec = dataclasses.replace(attn.spec, window=None, softcap=None)
    assert rel_err(_packed_logits(model), ref) > 1e-3


@pytest.mark.parametrize("name,with_src", [("mistral", False), ("gemma2", True),
                                           ("gemma2", False), ("gemma3", False)])
def test_save_hf_loads_in_transformers(dirs, tmp_path, name, with_src):
    """With the source config copied, or written from the ModelConfig alone (window, layer
    types, caps, query scale, both RoPE bases must survive)."""
    from transformers import AutoModelForCausalLM
    model = load_decoder(dirs[name])
    with torch.no_grad():   # move off the source weights so the test sees what was saved
        for p in model.parameters():
            p.mul_(1.5)
    save_hf(model, tmp_path / "out", src_dir=dirs[name] if with_src else None)
    # eager: transformers' SDPA path drops Gemma 2's attention soft-cap (2.7e-4 off here)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"),
                                              attn_implementation="eager").eval()
    assert hf.config.model_type == family_hf_model(name).config.model_type
    assert rel_err(_packed_logits(model), _hf_logits(hf)) < 1e-5
    assert read_model_config(tmp_path / "out") == model.cfg


@pytest.mark.parametrize("name", CASES)
def test_rollout_greedy_matches_hf_generate(dirs, name):
    """Prompts and generations past the window; the graph-shaped decode (all max_model_len
    keys, scratch rows) too for Gemma 2."""
    model = load_decoder(dirs[name])
    ref = _hf_greedy(family_hf_model(name))
    assert _engine_greedy(model) == ref
    if name == "gemma2":
        engine = Engine(model, RolloutConfig(max_num_seqs=8, max_model_len=64,
                                             max_prefill_tokens=128))
        engine.runner.static_shapes = True
        got = engine.generate(_prompts(), SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
        assert [r.token_ids for r in got] == ref


def test_reshard_plan_moves_the_sandwich_norms():
    """The reshard plan's brute-force simulation (test_reshard_plan) with Gemma's four norms per
    layer and Gemma 3's q/k norms: every generation shard built exactly."""
    from hybridengine.hybrid.plan import plan_reshard
    from test_reshard_plan import LAYOUTS, _cfg, _expected_gen, _hf_tensors, _simulate
    cfg = dataclasses.replace(_cfg(True), model_type="gemma3_text", qk_norm=True,
                              attention_bias=False)
    hf = {n: t for n, t in _hf_tensors(cfg).items() if not n.endswith("bias")}
    start = 1 + max(int(t.max()) for t in hf.values())
    for i in range(cfg.num_layers):
        for k, n in (("self_attn.q_norm", cfg.head_dim), ("self_attn.k_norm", cfg.head_dim),
                     ("pre_feedforward_layernorm", cfg.hidden_size),
                     ("post_feedforward_layernorm", cfg.hidden_size)):
            hf[f"model.layers.{i}.{k}.weight"] = torch.arange(start, start + n,
                                                              dtype=torch.float64)
            start += n
    for (t, p, d), gen_tp in LAYOUTS:
        for j in range(gen_tp):
            plan = plan_reshard(cfg, GenLayout(Layout(t, p, d), gen_tp), j,
                                max_bucket_numel=700)
            expected = _expected_gen(hf, cfg, Layout(t, p, d), gen_tp, j)
            assert any("post_feedforward" in n for n in expected)
            for got in _simulate(plan, hf, cfg):
                assert set(got) == set(expected)
                for n, ref in expected.items():
                    assert torch.equal(got[n], ref), (t, p, d, gen_tp, j, n)


def _tp2_worker(rank, world, path, logits, greedy, grads):
    mesh = build_mesh(Layout(2, 1, 1))
    for sp in (False, True):
        model = load_decoder(path, mesh, sequence_parallel=sp)
        assert rel_err(_packed_logits(model, 2), logits) < 1e-5, sp
        model = load_decoder(path, mesh, sequence_parallel=sp, dtype=torch.float64)
        loss, got = _loss_and_grads(model, 2)
        assert torch.allclose(loss, grads[0], rtol=1e-10), sp
        assert got.keys() == grads[1].keys()
        for k, ref in grads[1].items():
            assert rel_err(got[k], ref) < 1e-8, (sp, k, rel_err(got[k], ref))
    assert _engine_greedy(load_decoder(path, mesh)) == greedy


@pytest.mark.multiproc
def test_gemma2_tp2_logits_grads_and_greedy_equal_tp1(dirs, one_thread):
    """tp 2, sequence parallel off and on: logits, gradients (the capped log-prob path, the
    sandwich norms summed over TP under SP) and the rollout at generation TP 2. The reference
    runs on one thread as the workers do: the global layer's soft-capped attention cancels so
    much that its fp64 q/k gradients move by 3e-8 (relative) between 1 and 2 intra-op threads."""
    model = load_decoder(dirs["gemma2"])
    grads = _loss_and_grads(load_decoder(dirs["gemma2"], dtype=torch.float64), 1)
    run_dist(_tp2_worker, 2, dirs["gemma2"], _packed_logits(model), _engine_greedy(model),
             grads)


TRITON_MIXED_CHECK = """
import os, torch
os.environ["TRITON_INTERPRET"] = "1"          # Triton's CPU interpreter
import hybridengine.rollout.attention as rollout_attention
from hybridengine.models.decoder import Decoder, ModelConfig
# the spec layers' torch path (masked_attention over the gathered cache), counted: under the
# triton backend every decode layer, windowed, capped and rescaled ones included, takes the
# kernel
torch_spec_calls = []
_masked = rollout_attention.masked_attention
rollout_attention.masked_attention = lambda *a: torch_spec_calls.append(1) or _masked(*a)
torch.manual_seed(0)
# Gemma 2: every layer capped (a cap of 2 bends these scores), query scale 1/sqrt(10), not
# head_dim's; sliding layers of 5 keys beside global ones; prompts longer than the window
cfg = ModelConfig(vocab_size=50, hidden_size=48, intermediate_size=96, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, model_type="gemma2",
                  sliding_window=5, query_pre_attn_scalar=10, attn_softcap=2.0,
                  final_softcap=3.0, layer_types=("sliding_attention", "full_attention"),
                  hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True)
model = Decoder(cfg)
with torch.no_grad():       # scores of a few units, which the cap bends
    for layer in model.layers:
        layer.self_attn.qkv_proj.weight.mul_(4.0)
assert all(layer.self_attn.spec.softcap == 2.0 for layer in model.layers)
prompts = [[1, 2, 3], [7] * 12, [4, 9]]
max_model_len, max_tokens = 64, 8
""" + TRITON_MATCHES_SDPA.replace('print("ok")', """
calls_sdpa = len(torch_spec_calls)
torch_spec_calls.clear()
engines["triton"].generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
assert not torch_spec_calls and calls_sdpa > 0, (len(torch_spec_calls), calls_sdpa)
# the kernel's plain form too (RoPE and the cache write before it: fused_rope off)
from dataclasses import replace
from hybridengine.kernels.settings import DEFAULT_KERNEL_SETTINGS
plain = Engine(model, RolloutConfig(max_num_seqs=4, max_model_len=max_model_len,
                                    attn_backend="triton",
                                    kernels=replace(DEFAULT_KERNEL_SETTINGS, fused_rope=False)))
for a, b in zip(plain.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens)),
                runs["sdpa"]):
    assert a.token_ids == b.token_ids
    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
assert not torch_spec_calls
""") + """
torch.manual_seed(0)
cfg = ModelConfig(vocab_size=50, hidden_size=48, intermediate_size=96, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True,
                  model_type="gemma3_text", sliding_window=5, query_pre_attn_scalar=16,
                  layer_types=("sliding_attention", "full_attention"),
                  hidden_act="gelu_pytorch_tanh", rope_theta=1e6, rope_local_theta=100.0,
                  tie_word_embeddings=True)
model = Decoder(cfg)
with torch.no_grad():
    for n, p in model.named_parameters():
        if "norm" in n:
            p.normal_(0.0, 0.3)
assert [layer.self_attn.spec is None for layer in model.layers] == [False, True]
prompts = [[1, 2, 3], [7] * 12, [4, 9]]
max_model_len, max_tokens = 64, 8
""" + TRITON_MATCHES_SDPA


def test_fused_triton_decode_beside_windowed_layers_in_the_interpreter(family_interpreter_checks):
    """Gemma 3 under the triton backend: its full layer through the fused RoPE + cache write +
    attention kernel, its sliding layer through the masked torch path over the same cache;
    greedy tokens and log-probs as on SDPA. (conftest.family_interpreter_checks runs this script
    beside tests/test_model_families.py's.)"""
    from test_rollout import assert_printed_ok
    assert_printed_ok(family_interpreter_checks["test_model_families_gemma"])


def _one_sequence_at_a_time(q, k, v, bounds, spec):
    """The reference: masked_attention on each packed sequence alone (autograd through it)."""
    from hybridengine.models.features import masked_attention, window_mask
    out = []
    for s, e in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[s:e].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        pos = torch.arange(e - s)
        mask = window_mask(pos[:, None], pos[None, :], spec.window)[None, None]
        out.append(masked_attention(qs, ks, vs, mask, spec).squeeze(0).transpose(0, 1))
    return torch.cat(out)


@pytest.mark.parametrize("spec", [
    dict(softcap=2.0, scale=0.2), dict(softcap=2.0, window=5), dict(window=3, scale=0.3)])
def test_spec_attention_op_equals_one_sequence_at_a_time(spec):
    """models.spec_attention (sequences padded into groups by length; budgets that force several
    groups, a sequence of its own; an empty sequence) against masked attention on each sequence
    alone: values, and gradients of q, k, v from its recomputing backward against autograd's
    through the reference; GQA 6 / 2 heads, fp64 (the capped form's softmax is fp32, as HF's:
    1e-6 there). Then the op under torch.compile (aot_eager): the same, with no graph break."""
    from hybridengine.models.features import AttentionSpec
    from hybridengine.models.spec_attention import grouped_attention, \
        grouped_attention_backward, spec_attention
    g = torch.Generator().manual_seed(0)
    lens = [7, 1, 0, 12, 3, 9, 30, 5]
    bounds = [0]
    for n in lens:
        bounds.append(bounds[-1] + n)
    q = torch.randn(bounds[-1], 6, 8, generator=g, dtype=torch.float64) * 2
    k, v = (torch.randn(bounds[-1], 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    grad = torch.randn(q.shape, generator=g, dtype=torch.float64)
    s = AttentionSpec(**spec)
    tol = 1e-6 if s.softcap else 1e-12
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _one_sequence_at_a_time(*leaves, bounds, s)
    ref_grads = torch.autograd.grad(ref, leaves, grad)
    for budget in (1 << 20, 6 * 12 ** 2 * 2):      # one group but the longest; groups of <= 2
        out = grouped_attention(q, k, v, bounds, s, max_elements=budget)
        assert (out - ref).abs().max() < tol, budget
        for a, b in zip(grouped_attention_backward(grad, q, k, v, bounds, s, budget), ref_grads):
            assert (a - b).abs().max() < tol, budget
    cu = torch.tensor(bounds, dtype=torch.int32)
    torch._dynamo.reset()
    for fn in (spec_attention, torch.compile(spec_attention, backend="aot_eager",
                                             fullgraph=True)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, cu, s)
        assert (out - ref).abs().max() < tol
        for a, b in zip(torch.autograd.grad(out, leaves, grad), ref_grads):
            assert (a - b).abs().max() < tol


def test_moved_microbatch_hands_spec_attention_its_bounds_on_the_host(monkeypatch):
    """A micro-batch built on the host and moved to the device keeps its sequence bounds on the
    host too, and the packed attention hands those to the spec_attention op, whose forward and
    backward read them as numbers (the device's copy would cost a sync a layer each; "meta"
    stands in for the device here)."""
    import hybridengine.models.attention as attention
    from hybridengine.models.attention import PackedCausalAttention, PackedInput
    from hybridengine.models.features import AttentionSpec
    from hybridengine.train.engine import MicroBatch
    packed = PackedInput.from_lengths(torch.arange(10), [4, 6], multiple_of=4)
    moved = MicroBatch(packed).to("meta").packed
    assert moved.cu_seqlens.device.type == "meta"
    assert moved.host_bounds.device.type == "cpu"
    assert moved.host_bounds.tolist() == [0, 4, 10, 12]          # the SP pad's sequence too
    seen = []
    monkeypatch.setattr(attention, "spec_attention", lambda q, k, v, cu, spec: seen.append(cu))
    q = torch.zeros(12, 2, 8)
    PackedCausalAttention(moved).attend(0, q, q, q, AttentionSpec(softcap=50.0))
    assert seen[0].device.type == "cpu" and seen[0].tolist() == [0, 4, 10, 12]
