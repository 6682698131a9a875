"""The training micro-batches' CUDA graphs (train/cuda_graphs.py): the shape buckets, the padding
they add (exact for the real tokens, nothing added to any weight gradient: CPU, float64), and on
a GPU the graphed engine against the eager one over train steps of varying micro-batches."""
import pytest
import torch

from hybridengine.models.attention import PackedInput
from hybridengine.parallel.layout import Layout
from hybridengine.parallel.mesh import build_mesh
from hybridengine.train.cuda_graphs import Bucket, bucket_for, fill_static, unsupported
from hybridengine.train.engine import MicroBatch, OptimConfig, TrainEngine
from model_utils import STORIES


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


def _packed(lens, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (sum(lens),), generator=g)
    return PackedInput.from_lengths(ids, lens)


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
LENGTHS = [[[90, 70, 100], [33, 5, 61, 20]],       # train steps of two or three micro-batches:
           [[120, 7], [64, 64, 64], [1, 2, 3]],     # lengths that share buckets, lengths that
           [[90, 70, 100], [200, 180]],             # make new ones
           [[33, 5, 61, 20], [120, 7], [250]]]


def _engine(graphs: bool, compile_layers: bool, lr: float):
    return TrainEngine(STORIES, build_mesh(Layout(1, 1, 1)), dtype=torch.bfloat16,
                       device="cuda", optim=OptimConfig(lr=lr, grad_clip=1.0),
                       compile_layers=compile_layers, cuda_graphs=graphs)


def _steps(engine, park: bool = False):
    """Per train step of LENGTHS: its loss, entropy and grad norm, and every parameter's
    accumulated gradient (the optimizer's buckets, read after the step). park: the weights,
    gradient buckets and optimizer state go to host memory and back after step 2 (new
    addresses, as the trainer's offload gives them between phases)."""
    vocab = engine.cfg.vocab_size
    history, grads = [], []
    for step, lens_list in enumerate(LENGTHS):
        mbs = []
        for i, lens in enumerate(lens_list):
            p = _packed(lens, vocab, 10 * step + i)
            mask = (torch.arange(p.num_tokens) % 3 != 0).float()
            mbs.append(MicroBatch(p, {"targets": torch.roll(p.input_ids, -1), "mask": mask})
                       .to("cuda"))

        def loss_fn(out, mb):
            loss = -(out["logprob"] * mb.tensors["mask"]).sum() / 1000
            return loss, {"loss": loss.detach(), "entropy": out["entropy"].mean().detach()}
        m = engine.train_step(mbs, loss_fn)
        history.append([m["loss"], m["entropy"], m["grad_norm"]])
        if park and step == 1:
            engine.park(["params", "grads", "optimizer"])
            engine.unpark(["params", "grads", "optimizer"])
        grads.append({n: p.main_grad.float().cpu().clone()
                      for n, p in engine.model.named_parameters()})
    return torch.tensor(history), grads


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
    eager_hist, eager_grads = _steps(_engine(False, compile_layers, 0.0))
    engine = _engine(True, compile_layers, 0.0)
    assert engine.graphs is not None
    hist, grads = _steps(engine)
    torch.testing.assert_close(hist, eager_hist, rtol=1e-2, atol=1e-3)
    for step, (got, want) in enumerate(zip(grads, eager_grads)):
        for name in want:
            err = float((got[name] - want[name]).norm() / want[name].norm().clamp_min(1e-12))
            assert err < 2e-2, (step, name, err)
    buckets = {bucket_for(sum(lens), len(lens), max(lens)) for step in LENGTHS for lens in step}
    assert engine.graphs.captures == len(buckets) < 10
    assert engine.graphs.eager_calls == 0
    moving_eager, _ = _steps(_engine(False, compile_layers, 1e-3), park=True)
    moving, _ = _steps(_engine(True, compile_layers, 1e-3), park=True)
    assert not torch.equal(moving_eager[1:, 0], eager_hist[1:, 0])      # the weights moved
    torch.testing.assert_close(moving, moving_eager, rtol=2e-2, atol=2e-3)
