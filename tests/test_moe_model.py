"""Mixture-of-experts families against Hugging Face (models.moe): tiny Qwen3-MoE (one dense layer
among sparse ones, as mlp_only_layers allows) and Mixtral. Config fields, parameter lists of the
memory plan and the vLLM weight stream, packed logits (fp32), save_hf -> transformers, the rollout
engine's greedy tokens against generate; at tp 2 (SP off and on) logits and float64 gradients."""
import pytest
import torch

from dist_utils import run_dist
import hybridengine.models.moe as moe
from hybridengine.models.hf import load_decoder, read_model_config, save_hf
from hybridengine.parallel.layout import Layout
from hybridengine.parallel.mesh import build_mesh
from model_utils import rel_err, save_cases
from hybridengine.rollout.engine import Engine
from hybridengine.rollout.rollout_config import RolloutConfig
from hybridengine.rollout.sampling import SamplingParams
from test_model_families import MAX_NEW, VOCAB, _engine_greedy, _hf_greedy, _hf_logits, \
    LENGTHS, _loss_and_grads, _packed_logits, _prompts, check_plans_see_the_model

CASES = ["qwen3_moe", "mixtral"]


def moe_hf_model(name: str, seed: int = 0, *, hidden: int = 32, layers: int = 3,
                 head_dim: int = 16, ffn: int = 24, dense_ffn: int = 40, vocab: int | None = None,
                 max_positions: int = 128):
    """4 experts of `ffn` units, top 2, 4 / 2 heads (Qwen3-MoE: layer 1 dense, tied; Mixtral
    untied); weights spread so that every expert is routed to and a wrong mapping shows. The
    vocabulary: VOCAB at call time (tests/test_moe_e2e.py sets it to stories260K's)."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, \
        Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab or VOCAB, hidden_size=hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                  max_position_embeddings=max_positions, rms_norm_eps=1e-6, num_experts_per_tok=2,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if name == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
            intermediate_size=dense_ffn, moe_intermediate_size=ffn, num_experts=4,
            norm_topk_prob=False, mlp_only_layers=[1], tie_word_embeddings=True, **common))
    else:
        model = MixtralForCausalLM(MixtralConfig(intermediate_size=ffn, num_local_experts=4,
                                                 tie_word_embeddings=False, **common))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.15)
    return model.eval()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return save_cases(tmp_path_factory.mktemp("moe"), moe_hf_model, CASES)


def test_config_and_parameter_lists(dirs):
    for name in CASES:
        cfg = read_model_config(dirs[name])
        hf = moe_hf_model(name)
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 2, 24)
        assert [cfg.is_moe_layer(i) for i in range(3)] == \
            ([True, False, True] if name == "qwen3_moe" else [True] * 3)
        assert cfg.norm_topk_prob == (name == "mixtral")
        # the checkpoint's per-expert names (what vLLM loads), not HF 5's stacked modules
        check_plans_see_the_model(cfg, hf, dirs[name])


@pytest.mark.parametrize("name", CASES)
def test_logits_match_hf_packed(dirs, name):
    model = load_decoder(dirs[name])
    assert rel_err(_packed_logits(model), _hf_logits(moe_hf_model(name))) < 1e-5


@pytest.mark.parametrize("name", CASES)
def test_save_hf_loads_in_transformers(dirs, tmp_path, name):
    """From the ModelConfig alone (no source config): the expert fields must survive."""
    from transformers import AutoModelForCausalLM
    model = load_decoder(dirs[name])
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.25)
    save_hf(model, tmp_path / "out")
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    assert hf.config.model_type == name
    assert rel_err(_packed_logits(model), _hf_logits(hf)) < 1e-5
    assert read_model_config(tmp_path / "out") == model.cfg


@pytest.mark.parametrize("name", CASES)
def test_rollout_greedy_matches_hf_generate(dirs, name):
    want = _hf_greedy(moe_hf_model(name))
    assert _engine_greedy(load_decoder(dirs[name])) == want
    # the forms a CUDA-graph or compiled decode step runs (no host sync: grouped over the routed
    # rows, or every expert where the grouped GEMM does not run), with the graph-shaped decode
    # batches, here on the CPU
    for grouped in (True, False):
        engine = Engine(load_decoder(dirs[name]), RolloutConfig(
            max_num_seqs=8, max_model_len=64, max_prefill_tokens=128))
        engine.runner.static_shapes = True
        layers = [layer.mlp for layer in engine.runner.model.layers
                  if hasattr(layer.mlp, "sync_free")]
        assert layers and not any(m.sync_free for m in layers)      # eager on the CPU
        for m in layers:
            m.sync_free = True
        with pytest.MonkeyPatch.context() as mp:
            if not grouped:
                mp.setattr(moe, "grouped_mm_runs", lambda x, ffn: False)
            got = engine.generate(_prompts(), SamplingParams(temperature=0.0,
                                                             max_tokens=MAX_NEW))
        assert [r.token_ids for r in got] == want, grouped


def _with_router_losses(model):
    """The load-balancing and z-losses on (models.moe): their gradients join the backward."""
    for layer in model.layers:
        if hasattr(layer.mlp, "aux_loss_coef"):
            layer.mlp.aux_loss_coef, layer.mlp.z_loss_coef = 0.3, 0.05
    return model


# 59 tokens: tp 2 pads the micro-batch with one row, which the router losses must not count
ODD_LENGTHS = [7, 40, 12]


def _tp2_worker(rank, world, dirs, refs):
    mesh = build_mesh(Layout(2, 1, 1))
    for name, (logits, by_lengths) in refs.items():
        for sp in (False, True):
            model = load_decoder(dirs[name], mesh, sequence_parallel=sp)
            assert rel_err(_packed_logits(model, 2), logits) < 1e-5, (name, sp)
            model = _with_router_losses(load_decoder(dirs[name], mesh, sequence_parallel=sp,
                                                     dtype=torch.float64))
            for lengths, grads in by_lengths:
                loss, got = _loss_and_grads(model, 2, lengths)
                assert torch.allclose(loss, grads[0], rtol=1e-10), (name, sp, lengths)
                assert got.keys() == grads[1].keys()
                for k, ref in grads[1].items():
                    err = rel_err(got[k], ref)
                    assert err < 1e-8, (name, sp, lengths, k, err)


@pytest.mark.multiproc
def test_tp2_logits_and_grads_equal_tp1(dirs):
    """Experts split over TP inside (gate/up columns, down rows), the router whole: its
    gradient summed over TP as the q/k norms' are; with the router losses on (each TP rank
    computes them on the same tokens)."""
    refs = {}
    for name in CASES:
        ref = _with_router_losses(load_decoder(dirs[name], dtype=torch.float64))
        refs[name] = (_packed_logits(load_decoder(dirs[name])),
                      [(n, _loss_and_grads(ref, 1, n)) for n in (LENGTHS, ODD_LENGTHS)])
    run_dist(_tp2_worker, 2, dirs, refs)
