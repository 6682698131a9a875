"""The fused LM-head log-prob / entropy (torch path) against parallel/vocab.py on full logits:
values and gradients w.r.t. hidden and weight, at tp=1 and tp=2 with and without sequence
parallelism, with chunks that do not divide the vocabulary slice."""
import pytest
import torch

from dist_utils import run_dist
from hybridengine.kernels import fused_linear_logprob_entropy
from hybridengine.kernels.logprob import MAX_CHUNK_ELEMENTS, _chunks
from hybridengine.models.decoder import Decoder, ModelConfig
from hybridengine.parallel.tensor import padded_vocab_size
from hybridengine.parallel.vocab import vocab_parallel_logprob_entropy

VOCAB, TOKENS, HIDDEN = 37, 12, 8      # 37 is not divisible by 2: one pad row on the last rank
TOL = {torch.float64: 1e-10, torch.float32: 2e-5}


def _inputs(dtype, tp=1):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(TOKENS, HIDDEN, generator=g, dtype=torch.float64)
    # tp=1: 3 pad rows (a padded head); tp=2: one pad row, on the last rank
    padded = padded_vocab_size(VOCAB, tp) if tp > 1 else VOCAB + 3
    weight = torch.randn(padded, HIDDEN, generator=g, dtype=torch.float64)
    weight[VOCAB:] = 50.0                               # pad rows: junk that must not count
    targets = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    w_lp, w_ent = torch.randn(TOKENS, generator=g), torch.randn(TOKENS, generator=g)
    return hidden.to(dtype), weight.to(dtype), targets, w_lp.to(dtype), w_ent.to(dtype)


def _loss(logp, ent, w_lp, w_ent):
    return (logp * w_lp).sum() + (ent * w_ent).sum()


def _reference(hidden, weight, targets, w_lp, w_ent, temperature):
    """vocab.py on the full logits (tp=1): values and grads w.r.t. hidden and weight."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, ent = vocab_parallel_logprob_entropy(h @ w.t(), targets, None, VOCAB, temperature)
    _loss(logp, ent, w_lp, w_ent).backward()
    return logp.detach(), ent.detach(), h.grad, w.grad


def _assert_close(a, b, tol, what):
    err = ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
    assert err < tol, f"{what}: relative error {err:.3g} >= {tol}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_cols", [None, 5, 16, 1])
def test_tp1_matches_vocab_parallel(dtype, temperature, chunk_cols):
    hidden, weight, targets, w_lp, w_ent = _inputs(dtype)
    ref_lp, ref_ent, ref_gh, ref_gw = _reference(hidden, weight, targets, w_lp, w_ent,
                                                 temperature)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, ent = fused_linear_logprob_entropy(h, w, targets, None, VOCAB, temperature,
                                             chunk_cols=chunk_cols)
    assert logp.dtype == ent.dtype == dtype and logp.shape == (TOKENS,)
    _loss(logp, ent, w_lp, w_ent).backward()
    tol = TOL[dtype]
    _assert_close(logp, ref_lp, tol, "logprob")
    _assert_close(ent, ref_ent, tol, "entropy")
    _assert_close(h.grad, ref_gh, tol, "grad hidden")
    _assert_close(w.grad, ref_gw, tol, "grad weight")
    assert w.grad[VOCAB:].abs().max() == 0


def test_one_output_and_frozen_weight():
    """Only logprob used (entropy grad None), weight without grad: grad hidden still exact."""
    hidden, weight, targets, w_lp, _ = _inputs(torch.float64)
    ref = _reference(hidden, weight, targets, w_lp, torch.zeros_like(w_lp), 0.9)
    h = hidden.clone().requires_grad_()
    logp, _ = fused_linear_logprob_entropy(h, weight, targets, None, VOCAB, 0.9, chunk_cols=6)
    (logp * w_lp).sum().backward()
    _assert_close(h.grad, ref[2], 1e-10, "grad hidden")


def test_out_of_range_targets_are_owned_by_no_column():
    """Ignore ids (-100) and pad ids (>= vocab) give logp = -log Z and no one-hot gradient."""
    hidden, weight, targets, _, _ = _inputs(torch.float64, tp=2)    # one pad row (id 37)
    targets[:3] = torch.tensor([-100, VOCAB, VOCAB + 5])
    w = weight.clone().requires_grad_()
    logp, _ = fused_linear_logprob_entropy(hidden, w, targets, None, VOCAB, chunk_cols=10)
    log_z = torch.logsumexp(hidden @ weight[:VOCAB].t(), -1)
    _assert_close(logp[:3], -log_z[:3], 1e-12, "logp of ignored targets")
    logp[:3].sum().backward()
    assert w.grad[VOCAB:].abs().max() == 0
    # d(-log Z)/dW = -p^T h: every real row gets the (negative) softmax-weighted hidden state
    p = torch.softmax(hidden[:3] @ weight[:VOCAB].t(), -1)
    _assert_close(w.grad[:VOCAB], -p.t() @ hidden[:3], 1e-10, "grad weight")


def test_chunks_cover_the_slice_balanced_and_bounded():
    chunks = _chunks(75968, 75968, 151935, 16384, None)     # Qwen2.5 vocab, rank 1 of tp=2
    assert chunks[0][0] == 0 and chunks[-1][1] == 75968
    assert all(a == prev[1] for prev, (a, _, _) in zip(chunks, chunks[1:]))
    widths = [b - a for a, b, _ in chunks]
    assert max(widths) * 16384 <= MAX_CHUNK_ELEMENTS and widths[0] % 128 == 0
    assert max(widths) - min(widths) < 128 * len(chunks)
    assert [n for _, _, n in chunks] == widths[:-1] + [widths[-1] - 1]   # one pad column
    assert _chunks(19, 19, 37, 5, 7) == [(0, 7, 7), (7, 14, 7), (14, 19, 4)]


@pytest.mark.parametrize("final_softcap", [None, 1.5])
def test_decoder_logprob_entropy_matches_unfused_head(final_softcap):
    """The decoder's head (fused, chunked) against full logits (soft-capped for Gemma 2: the
    cap 1.5 bends logits of size ~3, so a missing or wrong cap derivative shows)."""
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=8, tie_word_embeddings=True,
                      final_softcap=final_softcap)
    torch.manual_seed(0)
    model = Decoder(cfg, dtype=torch.float64)
    hidden = torch.randn(TOKENS, 16, dtype=torch.float64)
    targets = torch.randint(0, VOCAB, (TOKENS,))
    ref = vocab_parallel_logprob_entropy(model.logits_local(hidden), targets, None, VOCAB, 0.8)
    _loss(*ref, 1.0, 0.3).backward()
    ref_grad = model.head_weight.grad.clone()
    model.zero_grad()
    out = model.logprob_entropy(hidden, targets, 0.8)
    _loss(*out, 1.0, 0.3).backward()
    for a, b in zip(out, ref):
        _assert_close(a, b.detach(), 1e-10, "decoder outputs")
    _assert_close(model.head_weight.grad, ref_grad, 1e-10, "decoder head grad")


@pytest.mark.parametrize("chunk_cols", [None, 5, 1])
@pytest.mark.parametrize("picked", [False, True])
def test_softcap_matches_capped_full_logits(chunk_cols, picked):
    """Gemma 2's final soft-cap inside the chunks: values and gradients equal vocab.py on
    cap·tanh(logits/cap) of the full logits (fp64), with and without picked rows."""
    hidden, weight, targets, w_lp, w_ent = _inputs(torch.float64)
    weight[VOCAB:] = 0.0
    cap = 2.0
    rows = PICKED if picked else None
    keep = torch.zeros(TOKENS, dtype=torch.float64).index_fill(0, PICKED, 1.0) if picked \
        else torch.ones(TOKENS, dtype=torch.float64)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    capped = torch.tanh((h @ w.t()) / cap) * cap
    ref = vocab_parallel_logprob_entropy(capped, targets, None, VOCAB, 0.7)
    _loss(ref[0] * keep, ref[1] * keep, w_lp, w_ent).backward()
    ref_gh, ref_gw = h.grad, w.grad
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, ent = fused_linear_logprob_entropy(h, w, targets, None, VOCAB, 0.7,
                                             chunk_cols=chunk_cols, rows=rows, softcap=cap)
    _loss(logp, ent, w_lp, w_ent).backward()
    _assert_close(logp, ref[0].detach() * keep, 1e-10, "logprob")
    _assert_close(ent, ref[1].detach() * keep, 1e-10, "entropy")
    _assert_close(h.grad, ref_gh, 1e-10, "grad hidden")
    _assert_close(w.grad, ref_gw, 1e-10, "grad weight")
    uncapped = fused_linear_logprob_entropy(hidden, weight, targets, None, VOCAB, 0.7)[0]
    assert (uncapped - ref[0].detach()).abs().max() > 1e-2     # the cap matters here


def test_bad_input_is_one_clear_error():
    hidden, weight, targets, _, _ = _inputs(torch.float32)
    with pytest.raises(ValueError, match="targets"):
        fused_linear_logprob_entropy(hidden, weight, targets[:-1], None, VOCAB)
    with pytest.raises(ValueError, match="vocab_size"):
        fused_linear_logprob_entropy(hidden, weight, targets, None, weight.shape[0] + 1)
    with pytest.raises(ValueError, match="weight"):
        fused_linear_logprob_entropy(hidden[:, :-1], weight, targets, None, VOCAB)
    with pytest.raises(ValueError, match="temperature"):
        fused_linear_logprob_entropy(hidden, weight, targets, None, VOCAB, 0.0)
    with pytest.raises(ValueError, match="chunk_cols"):
        fused_linear_logprob_entropy(hidden, weight, targets, None, VOCAB, chunk_cols=0)
    with pytest.raises(ValueError, match="softcap=0"):
        fused_linear_logprob_entropy(hidden, weight, targets, None, VOCAB, softcap=0)
    with pytest.raises(ValueError, match="impl"):
        fused_linear_logprob_entropy(hidden, weight, targets, None, VOCAB, impl="triton")
    with pytest.raises(RuntimeError, match="cuda"):
        fused_linear_logprob_entropy(hidden, weight, targets, None, VOCAB, impl="cuda")


# positions asked for (RL's response tokens): the head runs on these only, the rest are 0
PICKED = torch.tensor([1, 4, 5, 9, 11])


def _tp_worker(rank, world):
    group = torch.distributed.group.WORLD
    per = padded_vocab_size(VOCAB, world) // world
    block = TOKENS // world
    keep = torch.zeros(TOKENS).index_fill(0, PICKED, 1.0)
    for dtype, picked in ((torch.float64, None), (torch.float32, None), (torch.float64, PICKED)):
        hidden, weight, targets, w_lp, w_ent = _inputs(dtype, tp=world)
        if picked is not None:          # the reference's loss reads those positions only
            w_lp, w_ent = w_lp * keep.to(dtype), w_ent * keep.to(dtype)
        for temperature in (1.0, 0.7):
            ref_lp, ref_ent, ref_gh, ref_gw = _reference(hidden, weight, targets, w_lp, w_ent,
                                                         temperature)
            if picked is not None:
                ref_lp, ref_ent = ref_lp * keep.to(dtype), ref_ent * keep.to(dtype)
            for sp, chunk_cols in ((False, None), (False, 5), (True, 5), (True, None)):
                rows = slice(rank * block, (rank + 1) * block) if sp else slice(None)
                h = hidden[rows].clone().requires_grad_()
                w = weight[rank * per:(rank + 1) * per].clone().requires_grad_()
                logp, ent = fused_linear_logprob_entropy(h, w, targets, group, VOCAB, temperature,
                                                         sp, chunk_cols, rows=picked)
                _loss(logp, ent, w_lp, w_ent).backward()
                what = f"{dtype} T={temperature} sp={sp} chunk={chunk_cols} rank={rank} " \
                    f"picked={picked is not None}"
                tol = TOL[dtype]
                _assert_close(logp, ref_lp, tol, f"logprob {what}")
                _assert_close(ent, ref_ent, tol, f"entropy {what}")
                _assert_close(h.grad, ref_gh[rows], tol, f"grad hidden {what}")
                _assert_close(w.grad, ref_gw[rank * per:(rank + 1) * per], tol,
                              f"grad weight {what}")


@pytest.mark.multiproc
def test_tp2_with_and_without_sequence_parallel():
    run_dist(_tp_worker, 2)
