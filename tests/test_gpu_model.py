"""GPU checks of the decoder (run on the device machine): the varlen flash path for packed input
against the per-sequence path, and bf16 logits against transformers."""
import pytest
import torch

from hybridengine.models.attention import PackedCausalAttention, PackedInput
from hybridengine.models.features import AttentionSpec
from hybridengine.models.spec_attention import spec_attention
from hybridengine.models.hf import load_decoder
from model_utils import rel_err, save_tiny, tiny_hf_model

pytestmark = pytest.mark.gpu


def test_varlen_attention_matches_per_sequence():
    torch.manual_seed(0)
    lens = [100, 257, 768, 31]
    q = torch.randn(sum(lens), 14, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(lens), 2, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    packed = PackedInput.from_lengths(torch.zeros(sum(lens), dtype=torch.long), lens)
    packed.cu_seqlens = packed.cu_seqlens.cuda()
    ctx = PackedCausalAttention(packed)
    fast = ctx._varlen(q, k, v)
    ref = ctx._per_sequence(q.float(), k.float(), v.float())
    assert rel_err(fast.float(), ref) < 2e-2


@pytest.mark.parametrize("spec", [None, AttentionSpec(window=96, scale=0.1)],
                         ids=["causal", "window_scale"])
def test_flash_training_path_grads_match_the_fp32_reference(spec):
    """The training path (aten's flash op and its own backward, 2 K/V heads for 14 query
    heads taken as they are) against the fp32 per-sequence / masked path: output and the
    gradients of q, k and v; under a window and a query scale too (Mistral, Gemma)."""
    torch.manual_seed(0)
    lens = [100, 257, 768, 31]
    T = sum(lens)
    leaves = [torch.randn(T, h, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
              for h in (14, 2, 2)]
    packed = PackedInput.from_lengths(torch.zeros(T, dtype=torch.long), lens)
    packed.cu_seqlens = packed.cu_seqlens.cuda()
    ctx = PackedCausalAttention(packed)
    grad = torch.randn(T, 14, 64, device="cuda")
    out = ctx._varlen(*leaves, spec)
    out.backward(grad.to(out.dtype))
    ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
    ref = ctx._per_sequence(*ref_leaves) if spec is None else \
        spec_attention(*ref_leaves, packed.cu_seqlens.cpu(), spec)
    ref.backward(grad)
    assert out.shape == ref.shape and rel_err(out.float(), ref) < 2e-2
    for ours, theirs in zip(leaves, ref_leaves):
        assert ours.grad.shape == theirs.grad.shape
        assert rel_err(ours.grad.float(), theirs.grad) < 3e-2


def test_decoder_bf16_cuda_matches_hf(tmp_path):
    d = save_tiny(tmp_path / "m", "qwen2", tied=False)
    hf = tiny_hf_model("qwen2", tied=False).cuda()
    ours = load_decoder(d, device="cuda")
    lens = [37, 64, 5]
    ids = torch.randint(0, 97, (sum(lens),), device="cuda")
    packed = PackedInput.from_lengths(ids, lens)
    packed.cu_seqlens = packed.cu_seqlens.cuda()
    with torch.no_grad():
        ref = torch.cat([hf(s[None]).logits[0] for s in ids.split(lens)])
        assert rel_err(ours.logits(ours(packed)), ref) < 1e-4            # fp32 on GPU
        ours_bf16 = load_decoder(d, device="cuda", dtype=torch.bfloat16)
        assert rel_err(ours_bf16.logits(ours_bf16(packed)).float(), ref) < 5e-2
