"""The training micro-batches' CUDA graphs (train/cuda_graphs.py): the shape buckets, the padding
they add (exact for the real tokens, nothing added to any weight gradient: CPU, float64), and on
a GPU the graphed engine against the eager one over train steps of varying micro-batches."""
import pytest
import torch

from hybridengine.models.attention import PackedInput
from hybridengine.parallel.layout import Layout
from hybridengine.parallel.mesh import build_mesh
from hybridengine.train.cuda_graphs import Bucket, bucket_for, fill_static, unsupported
from hybridengine.train.engine import OptimConfig, TrainEngine
from model_utils import STORIES
from train_utils import LENGTHS, assert_grads_close, packed as _packed, train_steps


@pytest.mark.parametrize("tokens,seqs,longest,multiple", [
    (1, 1, 1, 1), (100, 3, 60, 1), (129, 2, 128, 1), (4097, 17, 768, 1), (8192, 23, 768, 1),
    (7000, 40, 300, 4), (50_000, 9, 16384, 2), (777, 5, 777, 1)])
def test_bucket_holds_the_micro_batch_and_its_pad_sequences(tokens, seqs, longest, multiple):
    b = bucket_for(tokens, seqs, longest, multiple)
    assert b.tokens >= tokens and b.tokens % multiple == 0
    assert b.tokens - tokens < max(128, tokens / 16) * multiple     # the pad stays small
    assert longest <= b.max_seqlen <= b.tokens
    pieces = -(-(b.tokens - tokens) // b.max_seqlen)
    assert b.seqs >= seqs + pieces and b.seqs & (b.seqs - 1) == 0


def test_nearby_micro_batches_share_a_bucket():
    """A run's micro-batches of about the token budget fall into a few buckets (graphs)."""
    g = torch.Generator().manual_seed(0)
    buckets = set()
    for _ in range(200):
        t = int(torch.randint(7000, 8193, (1,), generator=g))
        buckets.add(bucket_for(t, int(torch.randint(17, 31, (1,), generator=g)), 768))
    assert len(buckets) <= 5


def test_padded_body_equals_the_micro_batch_and_adds_no_gradient(one_thread):
    """The body over fill_static's padded inputs (pad ids and positions left over from a
    longer micro-batch before it) gives the micro-batch's hidden states on its rows, and a
    loss on those rows gives the same weight gradients as the unpadded micro-batch's."""
    engine = TrainEngine(STORIES, build_mesh(Layout(1, 1, 1)), dtype=torch.float64,
                         optim=OptimConfig(lr=0.0))
    model, vocab = engine.model, engine.cfg.vocab_size
    packed = _packed([33, 5, 61, 20], vocab, 2)
    n = packed.cu_seqlens.shape[0] - 1
    bucket = bucket_for(packed.num_tokens, n, packed.max_seqlen)
    assert bucket == Bucket(128, 8, 64)
    ids = torch.zeros(bucket.tokens, dtype=torch.long)
    pos, cu = torch.zeros_like(ids), torch.zeros(bucket.seqs + 1, dtype=torch.int32)
    steps = torch.arange(1, 65, dtype=torch.int32)
    fill_static(ids, pos, cu, _packed([40, 60, 28], vocab, 3), bucket, steps)
    fill_static(ids, pos, cu, packed, bucket, steps)
    assert cu.tolist() == [0, 33, 38, 99, 119, 128, 128, 128, 128]
    assert ids[119:].ne(0).any()                # leftovers of the first micro-batch, not zeros

    weight = torch.randn(packed.num_tokens, engine.cfg.hidden_size, dtype=torch.float64,
                         generator=torch.Generator().manual_seed(4))

    def grads(hidden):
        model.zero_grad(set_to_none=True)
        (hidden[: packed.num_tokens] * weight).sum().backward()
        return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    with torch.no_grad():
        engine.optimizer.release()              # plain .grad accumulation for the comparison
    want = model(packed)
    got = model(PackedInput(ids, pos, cu, bucket.max_seqlen))
    assert got.shape[0] == bucket.tokens
    torch.testing.assert_close(got[: packed.num_tokens], want, rtol=1e-12, atol=1e-12)
    g_want, g_got = grads(want), grads(got)
    assert g_want.keys() == g_got.keys() and len(g_want) > 10
    for k in g_want:
        torch.testing.assert_close(g_got[k], g_want[k], rtol=1e-10, atol=1e-12, msg=k)


def test_layouts_without_graphs_say_why():
    engine = TrainEngine(STORIES, build_mesh(Layout(1, 1, 1)), dtype=torch.float32,
                         optim=OptimConfig(lr=0.0), cuda_graphs=True)
    assert engine.graphs is None and engine.graphs_off == "not on CUDA"
    kw = dict(tp=1, pp=1, cp=1, dtype=torch.bfloat16, device_type="cuda", recompute=False,
              lora=False)
    assert unsupported(engine.cfg, **kw) is None
    assert unsupported(engine.cfg, **{**kw, "device_type": "cpu"}) == "not on CUDA"
    assert unsupported(engine.cfg, **{**kw, "dtype": torch.float32}).startswith("float32")
    assert unsupported(engine.cfg, **{**kw, "pp": 2}) == "pipeline parallel"
    assert unsupported(engine.cfg, **{**kw, "recompute": True}) == "activation recomputation"
    assert unsupported(engine.cfg, **{**kw, "offload": ("grads",)}).startswith(
        "its weights or gradients are offloaded between phases")
    assert unsupported(engine.cfg, **{**kw, "offload": ("optimizer",)}) is None


# --- GPU ---------------------------------------------------------------------------------------
def _engine(graphs: bool, compile_layers: bool, lr: float):
    return TrainEngine(STORIES, build_mesh(Layout(1, 1, 1)), dtype=torch.bfloat16,
                       device="cuda", optim=OptimConfig(lr=lr, grad_clip=1.0),
                       compile_layers=compile_layers, cuda_graphs=graphs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compile_layers", [False, True])
def test_graphed_train_steps_match_eager_on_cuda(compile_layers):
    """bf16 stories260K (tied embedding: its gradient comes from the graphed body and the eager
    head), eager and compiled layers, four train steps at lr 0 (the same weights for both at
    every step): the graphed engine's losses, grad norms and every parameter's gradient match
    the eager engine's to bf16's rounding (the padded GEMMs may tile differently); one capture
    per bucket, replays for the rest. Then four AdamW steps with the engine's parts parked and
    brought back after the second: the weights move and the losses follow the eager
    engine's."""
    eager_hist, eager_grads = train_steps(_engine(False, compile_layers, 0.0))
    engine = _engine(True, compile_layers, 0.0)
    assert engine.graphs is not None
    hist, grads = train_steps(engine)
    torch.testing.assert_close(hist, eager_hist, rtol=1e-2, atol=1e-3)
    assert_grads_close(grads, eager_grads, 2e-2)
    buckets = {bucket_for(sum(lens), len(lens), max(lens)) for step in LENGTHS for lens in step}
    assert engine.graphs.captures == len(buckets) < 10
    assert engine.graphs.eager_calls == 0
    moving_eager, _ = train_steps(_engine(False, compile_layers, 1e-3), park=True)
    moving, _ = train_steps(_engine(True, compile_layers, 1e-3), park=True)
    assert not torch.equal(moving_eager[1:, 0], eager_hist[1:, 0])      # the weights moved
    torch.testing.assert_close(moving, moving_eager, rtol=2e-2, atol=2e-3)
