"""Model families beyond Llama / Qwen2 against Hugging Face: Qwen3 (per-head RMSNorm of q and k
before RoPE, head_dim apart from hidden / heads, no qkv bias; tied and untied) and Llama 3.x
RoPE scaling (llama3, linear; positions past original_max_position_embeddings). Packed logits,
save_hf -> transformers, the rollout engine's greedy tokens against generate, the reshard plan
and the memory plan with the q/k norms; at tp 2 (SP off and on) logits, gradients and greedy
tokens; the fused Triton decode step (Triton's CPU interpreter) against SDPA."""
import dataclasses

import pytest
import torch

from dist_utils import run_dist
from hybridengine.models.attention import PackedInput, RotaryEmbedding
from hybridengine.models.decoder import Decoder
from hybridengine.models.hf import _gather_full, load_decoder, read_model_config, save_hf
from hybridengine.parallel.layout import GenLayout, Layout
from hybridengine.parallel.mesh import build_mesh
from hybridengine.parallel.tensor import sync_sequence_parallel_grads
from hybridengine.rollout.engine import Engine
from hybridengine.rollout.rollout_config import RolloutConfig
from hybridengine.rollout.sampling import SamplingParams
from model_utils import rel_err, save_cases
from test_rollout import TRITON_MATCHES_SDPA, assert_printed_ok

VOCAB = 97
LENGTHS = [7, 40, 13]         # positions up to 39: past original_max_position_embeddings = 16
PROMPT_LENS = [5, 11, 3, 14]
MAX_NEW = 24
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
CASES = ["qwen3_tied", "qwen3", "llama3_rope", "linear_rope"]


def family_hf_model(name: str, seed: int = 0, vocab: int = VOCAB):
    """A random tiny HF model of case `name` (GQA: 4 heads, 2 K/V heads, head_dim 16)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=128, rms_norm_eps=1e-6)
    if name.startswith("qwen3"):        # hidden / heads = 12 != head_dim
        model = Qwen3ForCausalLM(Qwen3Config(
            hidden_size=48, tie_word_embeddings=name == "qwen3_tied",
            rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, **common))
    else:
        rope = LLAMA3_ROPE if name == "llama3_rope" else \
            {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
        model = LlamaForCausalLM(LlamaConfig(hidden_size=64, tie_word_embeddings=False,
                                             rope_parameters=rope, **common))
    with torch.no_grad():   # random norm weights (q_norm / k_norm too), so a wrong mapping shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.normal_(1.0, 0.1)
    return model.eval()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return save_cases(tmp_path_factory.mktemp("families"), family_hf_model, CASES)


def _seqs(seed=1, lengths=LENGTHS):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


def _packed_logits(model, tp=1):
    packed = PackedInput.from_lengths(torch.cat(_seqs()), LENGTHS, multiple_of=tp)
    with torch.no_grad():
        return packed.strip(model.logits(model(packed)))


def _hf_logits(hf):
    with torch.no_grad():
        return torch.cat([hf(s[None]).logits[0] for s in _seqs()])


def _prompts():
    g = torch.Generator().manual_seed(2)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _engine_greedy(model, **kw):
    engine = Engine(model, RolloutConfig(max_num_seqs=8, max_model_len=64,
                                         max_prefill_tokens=128, **kw))
    results = engine.generate(_prompts(), SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    return [r.token_ids for r in results]


def _hf_greedy(hf):
    out = []
    for p in _prompts():
        ids = hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(ids[0, len(p):].tolist())
    return out


def test_config_and_plans_see_the_family(dirs):
    """read_model_config's family fields; the memory plan's parameter list and num_params equal
    the Decoder's and HF's; the vLLM weight stream names every HF tensor (q_norm, k_norm)."""
    for name in CASES:
        cfg = read_model_config(dirs[name])
        hf = family_hf_model(name)
        assert cfg.qk_norm == name.startswith("qwen3") and not cfg.attention_bias
        assert cfg.head_dim == 16 and cfg.model_type == hf.config.model_type
        rope = dict(cfg.rope_scaling)
        assert rope.get("rope_type") == {"llama3_rope": "llama3",
                                         "linear_rope": "linear"}.get(name)
        check_plans_see_the_model(cfg, hf, dirs[name])


def check_plans_see_the_model(cfg, hf, model_dir: str) -> None:
    """num_params and the memory plan's parameter list are the model's (HF's, the Decoder's);
    the vLLM weight stream names every tensor of the checkpoint (per-expert names, tied head
    left out, as saved)."""
    from hybridengine.hybrid.hf_stream import hf_weight_stream
    from hybridengine.models.hf import SafetensorsDir
    from hybridengine.train.memory_plan import stage_params
    assert cfg.num_params() == sum(p.numel() for p in hf.parameters())
    decoder = Decoder(cfg, device="meta")
    assert [(n, tuple(p.shape)) for n, p in decoder.named_parameters()] == stage_params(cfg, 1)
    names = {n for n, _ in hf_weight_stream(load_decoder(model_dir), None, 1.0)}
    assert names == set(SafetensorsDir(model_dir).where)


@pytest.mark.parametrize("name", CASES)
def test_logits_match_hf_packed(dirs, name):
    hf = family_hf_model(name)
    model = load_decoder(dirs[name])
    ref = _hf_logits(hf)
    assert rel_err(_packed_logits(model), ref) < 1e-5
    if not name.startswith("qwen3"):
        # the scaling matters at these positions: the unscaled RoPE gives other logits
        cfg = model.cfg
        model.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)
        assert rel_err(_packed_logits(model), ref) > 1e-3


@pytest.mark.parametrize("name,with_src", [("qwen3_tied", True), ("qwen3", False),
                                           ("llama3_rope", True), ("linear_rope", False)])
def test_save_hf_loads_in_transformers(dirs, tmp_path, name, with_src):
    """With the source config copied, or written from the ModelConfig alone (model_type, q/k
    norms, rope_parameters must survive)."""
    from transformers import AutoModelForCausalLM
    model = load_decoder(dirs[name])
    with torch.no_grad():   # move off the source weights so the test sees what was saved
        for p in model.parameters():
            p.mul_(1.5)
    save_hf(model, tmp_path / "out", src_dir=dirs[name] if with_src else None)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    src = family_hf_model(name).config
    assert hf.config.model_type == src.model_type
    assert hf.config.rope_parameters == src.rope_parameters
    assert hf.config.tie_word_embeddings == src.tie_word_embeddings
    assert rel_err(_packed_logits(model), _hf_logits(hf)) < 1e-5
    assert read_model_config(tmp_path / "out") == model.cfg


@pytest.mark.parametrize("name", CASES)
def test_rollout_greedy_matches_hf_generate(dirs, name):
    got = _engine_greedy(load_decoder(dirs[name]))
    assert got == _hf_greedy(family_hf_model(name))
    assert max(PROMPT_LENS) + MAX_NEW > 16              # past the llama3 original length


def test_reshard_plan_moves_the_qk_norms():
    """The reshard plan's brute-force simulation (test_reshard_plan) with Qwen3's replicated
    q/k norms: every generation shard built exactly, at every layout of that test."""
    from hybridengine.hybrid.plan import plan_reshard
    from test_reshard_plan import LAYOUTS, _cfg, _expected_gen, _hf_tensors, _simulate
    for tied in (True, False):
        cfg = dataclasses.replace(_cfg(tied), qk_norm=True)
        hf = _hf_tensors(cfg)
        start = 1 + max(int(t.max()) for t in hf.values())
        for i in range(cfg.num_layers):
            for k in ("q_norm", "k_norm"):
                hf[f"model.layers.{i}.self_attn.{k}.weight"] = \
                    torch.arange(start, start + cfg.head_dim, dtype=torch.float64)
                start += cfg.head_dim
        for (t, p, d), gen_tp in LAYOUTS:
            for mode in ("zero_redundancy", "naive"):
                for j in range(gen_tp):
                    plan = plan_reshard(cfg, GenLayout(Layout(t, p, d), gen_tp), j, mode=mode,
                                        max_bucket_numel=700)
                    expected = _expected_gen(hf, cfg, Layout(t, p, d), gen_tp, j)
                    assert any("q_norm" in n for n in expected)
                    for got in _simulate(plan, hf, cfg):
                        assert set(got) == set(expected)
                        for n, ref in expected.items():
                            assert torch.equal(got[n], ref), (t, p, d, gen_tp, j, mode, n)


def _loss_and_grads(model, tp, lengths=LENGTHS):
    """fp64 loss and full (HF-named) gradients, TP-replicated gradients summed over TP."""
    ids = torch.cat(_seqs(lengths=lengths))
    packed = PackedInput.from_lengths(ids, lengths, multiple_of=tp)
    targets = torch.nn.functional.pad(torch.roll(ids, -1), (0, packed.num_pad))
    model.zero_grad()
    logp, ent = model.logprob_entropy(model(packed), targets)
    loss = -packed.strip(logp).sum() + 0.1 * packed.strip(ent).sum()
    loss.backward()
    sync_sequence_parallel_grads(model, model.tp_group)
    grads = {}
    for n, p in model.named_parameters():
        grads.update(_gather_full(model, n, p.grad))
    return loss.detach(), grads


def _tp2_worker(rank, world, dirs, refs):
    mesh = build_mesh(Layout(2, 1, 1))
    for name, (logits, greedy, grads) in refs.items():
        for sp in (False, True):
            model = load_decoder(dirs[name], mesh, sequence_parallel=sp)
            assert rel_err(_packed_logits(model, 2), logits) < 1e-5, (name, sp)
            if grads is not None:
                model = load_decoder(dirs[name], mesh, sequence_parallel=sp, dtype=torch.float64)
                loss, got = _loss_and_grads(model, 2)
                assert torch.allclose(loss, grads[0], rtol=1e-10), (name, sp)
                assert got.keys() == grads[1].keys()
                for k, ref in grads[1].items():
                    assert rel_err(got[k], ref) < 1e-8, (name, sp, k, rel_err(got[k], ref))
        assert _engine_greedy(load_decoder(dirs[name], mesh)) == greedy, name


@pytest.mark.multiproc
def test_tp2_logits_grads_and_greedy_equal_tp1(dirs):
    """tp 2, sequence parallel off and on: logits, the gradients (q_norm / k_norm: each rank's
    covers its own heads, summed over TP) and the rollout at generation TP 2."""
    refs = {}
    for name in ("qwen3_tied", "qwen3", "llama3_rope"):
        model = load_decoder(dirs[name])
        grads = _loss_and_grads(load_decoder(dirs[name], dtype=torch.float64), 1) \
            if name.startswith("qwen3") else None
        refs[name] = (_packed_logits(model), _engine_greedy(model), grads)
    run_dist(_tp2_worker, 2, dirs, refs)


TRITON_FAMILY_CHECK = """
import os, torch
os.environ["TRITON_INTERPRET"] = "1"          # Triton's CPU interpreter
from hybridengine.models.decoder import Decoder, ModelConfig
torch.manual_seed(0)
rope = (("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
        ("original_max_position_embeddings", 16), ("rope_type", "llama3"))
cfg = ModelConfig(vocab_size=50, hidden_size=48, intermediate_size=96, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True, rope_scaling=rope)
model = Decoder(cfg)
with torch.no_grad():
    for n, p in model.named_parameters():
        if "norm" in n:
            p.normal_(1.0, 0.1)
prompts = [[1, 2, 3], [7] * 30, [4, 9]]
max_model_len, max_tokens = 64, 12
""" + TRITON_MATCHES_SDPA


def test_fused_triton_decode_with_qk_norm_and_llama3_rope_in_the_interpreter(
        family_interpreter_checks):
    """The fused decode kernel rotates the q / k that the model already normed, with the
    scaled tables: greedy tokens and log-probs as on SDPA. (conftest.family_interpreter_checks
    runs this script beside tests/test_model_families_gemma.py's.)"""
    assert_printed_ok(family_interpreter_checks["test_model_families"])
