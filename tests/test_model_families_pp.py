"""Every model family at pipeline parallel 2 against Hugging Face (issue 26, acceptance 1): the
forward-only schedule over two packed micro-batches gives transformers' logits on the last stage
(fp32, <= 1e-5 relative). The cases are those of test_model_families (Qwen3 tied / untied,
Llama 3 with llama3 and linear RoPE scaling) and test_model_families_gemma (Mistral, Gemma 2,
Gemma 3): the embedding scale and the first layers on stage 0; the later layers (their own
sliding / full types and RoPE bases, by global index), the final norm, the tied head's copy and
the final soft-cap on stage 1."""
import pytest
import torch

import test_model_families as base
import test_model_families_gemma as gemma
from dist_utils import run_dist
from hybridengine.models.attention import PackedInput
from hybridengine.models.hf import load_decoder
from hybridengine.parallel.layout import Layout
from hybridengine.parallel.mesh import build_mesh
from hybridengine.parallel.pipeline import StageComm, forward_only
from model_utils import rel_err

FAMILIES = {**{n: base.family_hf_model for n in base.CASES},
            **{n: gemma.family_hf_model for n in gemma.CASES}}
SPLIT = 2                   # micro-batch 0: the first two sequences, 1: the rest


def _microbatches() -> list[PackedInput]:
    seqs, lens = base._seqs(), base.LENGTHS
    return [PackedInput.from_lengths(torch.cat(seqs[:SPLIT]), lens[:SPLIT]),
            PackedInput.from_lengths(torch.cat(seqs[SPLIT:]), lens[SPLIT:])]


def _pp2_logits(model_dir: str, mesh) -> torch.Tensor | None:
    """The last stage's logits of every token, micro-batch after micro-batch ([T, V]); None on
    the first stage."""
    model = load_decoder(model_dir, mesh)
    mbs = _microbatches()

    def forward_step(i, hidden):
        h = model(mbs[i], hidden=hidden)
        return mbs[i].strip(model.logits(h)) if model.is_last else h

    def activation_shape(i):
        return torch.Size([mbs[i].num_tokens, model.cfg.hidden_size])     # [T, H], SP off

    outs = forward_only(forward_step, len(mbs), activation_shape,
                        StageComm(mesh, torch.float32, torch.device("cpu")))
    return torch.cat(outs) if model.is_last else None


def _pp2_worker(rank, world, dirs, refs):
    mesh = build_mesh(Layout(1, 2, 1))
    for name, ref in refs.items():
        got = _pp2_logits(dirs[name], mesh)
        if mesh.is_last_stage:
            err = rel_err(got, ref)
            assert err < 1e-5, (name, err)


@pytest.mark.multiproc
def test_pp2_logits_match_hf_every_family(tmp_path):
    dirs, refs = {}, {}
    for name, make in FAMILIES.items():
        hf = make(name)
        dirs[name] = str(tmp_path / name)
        hf.save_pretrained(dirs[name])
        refs[name] = base._hf_logits(hf)
    run_dist(_pp2_worker, 2, dirs, refs)
