"""Train steps of varying packed micro-batches on a TrainEngine, with every parameter's
accumulated gradient read after each step: what the GPU tests of the training engine's fast
paths (CUDA graphs, gradient-accumulation fusion) compare against the plain engine."""
from __future__ import annotations

import torch

from hybridengine.models.attention import PackedInput
from hybridengine.train.engine import MicroBatch

# train steps of two or three micro-batches: lengths that share CUDA-graph buckets, lengths that
# make new ones
LENGTHS = [[[90, 70, 100], [33, 5, 61, 20]],
           [[120, 7], [64, 64, 64], [1, 2, 3]],
           [[90, 70, 100], [200, 180]],
           [[33, 5, 61, 20], [120, 7], [250]]]


def packed(lens, vocab, seed) -> PackedInput:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (sum(lens),), generator=g)
    return PackedInput.from_lengths(ids, lens)


def train_steps(engine, park: bool = False, device: str = "cuda"):
    """Per train step of LENGTHS: its loss, entropy and grad norm, and every parameter's
    accumulated gradient (the optimizer's buckets, read after the step). park: the weights,
    gradient buckets and optimizer state go to host memory and back after step 2 (new
    addresses, as the trainer's offload gives them between phases)."""
    vocab = engine.cfg.vocab_size
    history, grads = [], []
    for step, lens_list in enumerate(LENGTHS):
        mbs = []
        for i, lens in enumerate(lens_list):
            p = packed(lens, vocab, 10 * step + i)
            mask = (torch.arange(p.num_tokens) % 3 != 0).float()
            mbs.append(MicroBatch(p, {"targets": torch.roll(p.input_ids, -1), "mask": mask})
                       .to(device))

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


def assert_grads_close(grads, want_grads, tol: float) -> None:
    """Every parameter's gradient at every step within `tol` of the reference's (relative L2)."""
    for step, (got, want) in enumerate(zip(grads, want_grads)):
        assert got.keys() == want.keys()
        for name in want:
            err = float((got[name] - want[name]).norm() / want[name].norm().clamp_min(1e-12))
            assert err < tol, (step, name, err)
