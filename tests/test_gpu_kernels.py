"""GPU checks of csrc/logprob_kernels.cu (run on the device machine): the CUDA chunk ops against
the torch chunk ops on the same inputs (fp32 tight, bf16/fp16 loose), both kernel layouts (a block
per row below 4096 rows, a warp per row above), misaligned rows, padding, ignored targets; the
Decoder head on CUDA; and a timing of the Qwen2.5-0.5B head (printed, not asserted)."""
import time

import pytest
import torch

from hybridengine.kernels import cuda_extension, fused_linear_logprob_entropy
from hybridengine.models.decoder import Decoder, ModelConfig
from hybridengine.parallel.vocab import vocab_parallel_logprob_entropy
from model_utils import rel_err

pytestmark = pytest.mark.gpu


def _inputs(tokens, hidden, vocab, padded, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g, device="cuda")
    w = torch.randn(padded, hidden, generator=g, device="cuda") * hidden ** -0.5 * 3
    w[vocab:] = 40.0                                    # pad rows: junk that must not count
    targets = torch.randint(0, vocab, (tokens,), generator=g, device="cuda")
    targets[::97] = -100                                # ignored ids: owned by no column
    a = torch.randn(tokens, generator=g, device="cuda")
    b = torch.randn(tokens, generator=g, device="cuda")
    return h.to(dtype), w.to(dtype), targets, a, b


def _run(impl, h, w, targets, a, b, vocab, temperature, chunk_cols):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    logp, ent = fused_linear_logprob_entropy(h, w, targets, None, vocab, temperature,
                                             chunk_cols=chunk_cols, impl=impl)
    ((logp * a).sum() + (ent * b).sum()).backward()
    return logp.detach(), ent.detach(), h.grad, w.grad


def test_extension_builds():
    assert cuda_extension() is not None, "the CUDA kernels did not build: see the warning above"


@pytest.mark.parametrize("tokens", [300, 5000])          # block per row / warp per row
@pytest.mark.parametrize("chunk_cols", [None, 999, 1024])  # 999 fp32 columns: misaligned rows
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_cuda_matches_torch_fp32(tokens, chunk_cols, temperature):
    args = _inputs(tokens, 64, 5003, 5008, torch.float32)
    cuda = _run("cuda", *args, 5003, temperature, chunk_cols)
    ref = _run("torch", *args, 5003, temperature, chunk_cols)
    for name, x, y, tol in zip(("logprob", "entropy", "grad hidden", "grad weight"), cuda, ref,
                               (1e-5, 1e-5, 1e-4, 1e-4)):
        assert rel_err(x, y) < tol, f"{name}: {rel_err(x, y):.3g}"
    assert cuda[3][5003:].abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens, chunk_cols", [(1000, None), (4500, 9999)])
def test_cuda_matches_torch_half(dtype, tokens, chunk_cols):
    """The Qwen2.5 head (hidden 896, vocab 151936). Both paths read the same half logits, so
    values agree to fp32 rounding; gradients pass through half dL/dlogits (1-ulp flips)."""
    args = _inputs(tokens, 896, 151936, 151936, dtype)
    cuda = _run("cuda", *args, 151936, 1.0, chunk_cols)
    ref = _run("torch", *args, 151936, 1.0, chunk_cols)
    errs = {name: rel_err(x.float(), y.float())
            for name, x, y in zip(("logprob", "entropy", "grad hidden", "grad weight"), cuda, ref)}
    print(f"\n{dtype} T={tokens}: relative errors CUDA vs torch {errs}")
    assert errs["logprob"] < 1e-4 and errs["entropy"] < 1e-4
    assert errs["grad hidden"] < 2e-2 and errs["grad weight"] < 2e-2


@pytest.mark.parametrize("final_softcap", [None, 2.0])
def test_decoder_head_on_cuda(final_softcap):
    """The fused head (CUDA chunk ops; Gemma 2's soft-cap applied per chunk) against the
    unfused head on full logits."""
    cfg = ModelConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True,
                      final_softcap=final_softcap)
    torch.manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        model = Decoder(cfg, dtype=dtype, device="cuda")
        hidden = torch.randn(777, 64, device="cuda", dtype=dtype, requires_grad=True)
        targets = torch.randint(0, 1000, (777,), device="cuda")
        outs = {}
        for name in ("fused", "unfused"):
            model.zero_grad()
            hidden.grad = None
            logp, ent = model.logprob_entropy(hidden, targets, 0.8) if name == "fused" else \
                vocab_parallel_logprob_entropy(model.logits_local(hidden), targets, None, 1000, 0.8)
            (logp.sum() - 0.5 * ent.sum()).backward()
            outs[name] = (logp.detach(), ent.detach(), hidden.grad.clone(),
                          model.head_weight.grad.clone())
        for x, y in zip(outs["fused"], outs["unfused"]):
            assert rel_err(x.float(), y.float()) < tol, (dtype, rel_err(x.float(), y.float()))


def _ms(fn, iters=5):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e3


def test_qwen_head_timing_printed():
    h, w, targets, a, b = _inputs(8192, 896, 151936, 151936, torch.bfloat16)
    h.requires_grad_()
    w.requires_grad_()

    def step(fused):
        if fused:
            logp, ent = fused_linear_logprob_entropy(h, w, targets, None, 151936)
        else:
            logits = torch.nn.functional.linear(h, w)
            logp, ent = vocab_parallel_logprob_entropy(logits, targets, None, 151936)
        ((logp * a).sum() + (ent * b).sum()).backward()
        h.grad = w.grad = None
    old, new = _ms(lambda: step(False)), _ms(lambda: step(True))
    print(f"\nQwen2.5-0.5B head, 8192 tokens, bf16 fwd+bwd: unfused {old:.1f} ms, "
          f"fused {new:.1f} ms ({old / new:.2f}x)")
