"""Vocab-parallel log-prob and entropy against full log_softmax in float64."""
import pytest
import torch

from dist_utils import run_dist
from hybridengine.parallel.tensor import padded_vocab_size
from hybridengine.parallel.vocab import vocab_parallel_logprob_entropy

VOCAB, TOKENS = 37, 11          # 37 is not divisible by 2: one pad column on the last rank


def _reference(temperature):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(TOKENS, VOCAB, generator=g, dtype=torch.float64) * 3
    targets = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    w_lp, w_ent = torch.randn(TOKENS, generator=g, dtype=torch.float64), \
        torch.randn(TOKENS, generator=g, dtype=torch.float64)
    full = logits.clone().requires_grad_()
    logp_all = torch.log_softmax(full / temperature, -1)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    ((logp * w_lp).sum() + (ent * w_ent).sum()).backward()
    return logits, targets, w_lp, w_ent, logp.detach(), ent.detach(), full.grad


def _check(rank, tp, group, temperature):
    logits, targets, w_lp, w_ent, ref_lp, ref_ent, ref_grad = _reference(temperature)
    per = padded_vocab_size(VOCAB, tp) // tp
    padded = torch.cat([logits, torch.full((TOKENS, per * tp - VOCAB), 123.0,
                                           dtype=torch.float64)], -1)   # pad junk must not count
    local = padded[:, rank * per:(rank + 1) * per].clone().requires_grad_()
    logp, ent = vocab_parallel_logprob_entropy(local, targets, group, VOCAB, temperature)
    ((logp * w_lp).sum() + (ent * w_ent).sum()).backward()
    assert (logp - ref_lp).abs().max() < 1e-6
    assert (ent - ref_ent).abs().max() < 1e-6
    valid = min(per, VOCAB - rank * per)
    assert (local.grad[:, :valid] - ref_grad[:, rank * per:rank * per + valid]).abs().max() < 1e-6
    assert local.grad[:, valid:].abs().max() == 0 if valid < per else True


def _worker(rank, world):
    for temperature in (1.0, 0.7):
        _check(rank, world, torch.distributed.group.WORLD, temperature)


@pytest.mark.multiproc
def test_vocab_parallel_tp2_matches_log_softmax_fp64():
    run_dist(_worker, 2)


def test_vocab_parallel_tp1_matches_log_softmax_fp64():
    for temperature in (1.0, 0.7):
        _check(0, 1, None, temperature)
