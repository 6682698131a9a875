"""CUDA graphs of the training micro-batches (actor.use_cuda_graph, critic.use_cuda_graph).

The updates are host-bound at the seed's size: in a PPO step's profile the device idles 126-182 ms
of each update's 0.7-0.8 s while the host launches a micro-batch's ~2,000 kernels (bench/RESULTS.md
sessions 22-25). A graph replays them in one launch. What is captured is a micro-batch's decoder
body, embedding to final norm, forward and backward (the parameters' gradient accumulation into the
optimizer's buckets included); the head and the loss stay eager (their inputs and RL's per-step
scalars change every call). Megatron-core's enable_cuda_graph captures per layer the same way.
Measured (bench/RESULTS.md session 31, PPO seed on one H200): the critic update 8-16% shorter, the
actor update unchanged (its fused head keeps the device busy), the step within the machines'
spread, and the pool's +6.8 GiB reserved in every phase: opt-in, not a CUDA default.

A graph has fixed shapes, packed micro-batches do not: each is padded to a bucket (bucket_for):
tokens rounded up to a 16th of the power of two below them (< 6.25% more), the number of sequences
and the longest sequence to powers of two. The pad tokens form sequences of their own (at most the
bucket's longest each, so flash attention's grid covers them), the pad sequences past them have
length 0; attention never crosses a sequence, every other op is per token, so the real tokens'
outputs are those of the unpadded batch, and the pad rows' zero output gradient adds exactly
nothing to any weight gradient. The pad tokens are whatever ids and positions the static buffers
last held (valid ones: their activations stay finite).

All graphs of a process share one memory pool (updates run one micro-batch at a time, one role at a
time), so the pool holds about one bucket's activations; unlike eager activations it stays reserved
between updates (train.memory_plan counts it in every phase: graphs.pool). A graph also fixes the
addresses of the weights and of the gradient buckets it adds into: the engine checks them at each
train_step and captures again where parking moved them.
"""
from __future__ import annotations

import math
import warnings
import weakref
from dataclasses import dataclass

import torch

from hybridengine.models.attention import PackedInput

# captures per engine before new shapes run eagerly (a run meets a handful: bench/RESULTS.md)
MAX_GRAPHS = 32
# device -> the live graphs: a new capture joins their pool (a pool handle outlives no graph)
_LIVE: dict[int, weakref.WeakSet] = {}


@dataclass(frozen=True)
class Bucket:
    tokens: int
    seqs: int
    max_seqlen: int


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def bucket_for(num_tokens: int, num_seqs: int, max_seqlen: int, multiple: int = 1) -> Bucket:
    """The padded shape of a micro-batch of `num_tokens` tokens in `num_seqs` sequences, the
    longest `max_seqlen`; tokens a multiple of `multiple` (sequence parallelism's degree)."""
    step = max(128, (1 << (max(num_tokens, 1).bit_length() - 1)) // 16)
    step = step * multiple // math.gcd(step, multiple)
    tokens = -(-num_tokens // step) * step
    longest = min(tokens, max(64, _pow2(max_seqlen)))
    pieces = -(-(tokens - num_tokens) // longest)
    return Bucket(tokens, _pow2(num_seqs + pieces), longest)


def fill_static(ids: torch.Tensor, pos: torch.Tensor, cu: torch.Tensor, packed: PackedInput,
                bucket: Bucket, steps: torch.Tensor) -> None:
    """Write `packed` into a bucket's static inputs: its tokens first, then the pad sequences
    (bounds T + k·max_seqlen capped at the bucket's tokens). steps: arange(1, seqs + 1) on the
    device, so the bounds are made there (no host-to-device copy)."""
    t, n = packed.num_tokens, packed.cu_seqlens.shape[0] - 1
    ids[:t].copy_(packed.input_ids)
    pos[:t].copy_(packed.position_ids)
    cu[:n + 1].copy_(packed.cu_seqlens)
    tail = cu[n + 1:]
    torch.clamp(steps[: tail.shape[0]] * bucket.max_seqlen + t, max=bucket.tokens, out=tail)


def _shared_pool(device: torch.device, graph: torch.cuda.CUDAGraph):
    """The pool of the device's live graphs (a new one if none is alive); `graph` joins them."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    live = _LIVE.setdefault(index, weakref.WeakSet())
    pool = next(iter(live)).pool() if live else torch.cuda.graph_pool_handle()
    live.add(graph)
    return pool


def unsupported(cfg, *, tp: int, pp: int, cp: int, dtype: torch.dtype, device_type: str,
                recompute: bool, lora: bool, offload: tuple[str, ...] = ()) -> str | None:
    """Why a role's training micro-batches cannot be graphed (None: they can): its model config
    and layout, as the engine and the memory plan (rl.memory) both know them. offload: the
    parts (train.engine.PARTS) the trainer parks between phases; parked weights or gradient
    buckets come back at new addresses (HostParking), so every step would capture again."""
    reasons = [
        (device_type != "cuda", "not on CUDA"),
        (dtype not in (torch.bfloat16, torch.float16),
         f"{str(dtype).removeprefix('torch.')} attention runs per sequence from host bounds"),
        (pp > 1, "pipeline parallel"), (cp > 1, "context parallel"),
        (tp > 1, "tensor parallel (not yet run on GPUs)"),
        (any(cfg.is_moe_layer(i) for i in range(cfg.num_layers)), "MoE routing sizes its "
         "groups on the host"),
        (cfg.attn_softcap is not None, "soft-capped attention reads host bounds"),
        (recompute, "activation recomputation"),
        (lora, "LoRA (not yet run on GPUs)"),
        (bool({"params", "grads"} & set(offload)), "its weights or gradients are offloaded "
         "between phases (new addresses every step: the graphs would be captured again every "
         "step)"),
    ]
    return next((why for bad, why in reasons if bad), None)


class _Captured:
    """One bucket's static inputs, output, output gradient and its two graphs."""

    def __init__(self, bucket: Bucket, device: torch.device):
        self.bucket = bucket
        self.ids = torch.zeros(bucket.tokens, dtype=torch.long, device=device)
        self.pos = torch.zeros(bucket.tokens, dtype=torch.long, device=device)
        self.cu = torch.zeros(bucket.seqs + 1, dtype=torch.int32, device=device)
        self.fwd, self.bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        self.out = self.grad_out = None


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, captured):
        ctx.captured = captured
        captured.fwd.replay()
        return captured.out.detach()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        c = ctx.captured
        if grad.data_ptr() != c.grad_out.data_ptr():
            c.grad_out.copy_(grad)
        c.bwd.replay()
        return None, None


class BodyGraphs:
    """The graphed decoder body of one training engine: `graphs(packed)` is `model(packed)`
    (the final-normed hidden states [T, H]) for a training micro-batch, replayed from its
    bucket's graphs, captured by begin_step at the first train_step that has the bucket."""

    def __init__(self, model, device: torch.device, max_graphs: int = MAX_GRAPHS):
        self.model, self.device, self.max_graphs = model, device, max_graphs
        self.captured: dict[Bucket, _Captured] = {}
        self.captures = self.eager_calls = 0
        self._steps: torch.Tensor | None = None
        self._anchor = torch.zeros((), device=device, requires_grad=True)
        self._addresses: tuple | None = None

    def begin_step(self, grad_buffers, packs: list[PackedInput]) -> None:
        """Before a train_step on micro-batches `packs`: drop the graphs whose weights or gradient
        buffers moved, then capture the buckets of `packs` not captured yet. Here, before any
        forward of the step: a capture must find no eager autograd graph alive that holds a
        parameter's AccumulateGrad node (a tied embedding's, made by the eager head on the
        default stream): the captured backward would then reach it across streams, which a
        capture forbids (cudaErrorStreamCaptureImplicit)."""
        addresses = tuple(p.data_ptr() for p in self.model.parameters()) + \
            tuple(g.data_ptr() for g in grad_buffers)
        if addresses != self._addresses:
            self.captured.clear()
            self._addresses = addresses
        for packed in packs:
            bucket = self._bucket(packed)
            if bucket not in self.captured and len(self.captured) < self.max_graphs:
                self._capture(bucket, packed)

    @staticmethod
    def _bucket(packed: PackedInput) -> Bucket:
        return bucket_for(packed.num_tokens, packed.cu_seqlens.shape[0] - 1, packed.max_seqlen)

    def __call__(self, packed: PackedInput) -> torch.Tensor:
        bucket = self._bucket(packed)
        c = self.captured.get(bucket)
        if c is None:           # past the cap (begin_step captured every other bucket)
            if not self.eager_calls:
                warnings.warn(f"training CUDA graphs: {self.max_graphs} shapes captured; new "
                              f"shapes run eagerly")
            self.eager_calls += 1
            return self.model(packed)
        fill_static(c.ids, c.pos, c.cu, packed, bucket, self._step_ids(bucket))
        return _Replay.apply(self._anchor, c)[: packed.num_tokens]

    def _step_ids(self, bucket: Bucket) -> torch.Tensor:
        if self._steps is None or self._steps.shape[0] < bucket.seqs:
            self._steps = torch.arange(1, max(bucket.seqs, 64) + 1, dtype=torch.int32,
                                       device=self.device)
        return self._steps

    def _body(self, c: _Captured) -> torch.Tensor:
        return self.model(PackedInput(c.ids, c.pos, c.cu, c.bucket.max_seqlen))

    def _capture(self, bucket: Bucket, packed: PackedInput) -> None:
        """Warm the body up on this micro-batch (lazy initialisation, compilation for the new
        shape: nothing of it may happen inside a capture; torch.autograd.grad, so no gradient
        reaches the optimizer's buckets but the fused linears' zeros: parallel.wgrad_accumulation),
        then capture its forward and its backward (the accumulation hooks add into the buckets:
        captured, not run)."""
        c = _Captured(bucket, self.device)
        fill_static(c.ids, c.pos, c.cu, packed, bucket, self._step_ids(bucket))
        params = [p for p in self.model.parameters() if p.requires_grad]
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                out = self._body(c)
                torch.autograd.grad(out, params, torch.zeros_like(out), allow_unused=True)
            del out
        torch.cuda.current_stream(self.device).wait_stream(side)
        pool = _shared_pool(self.device, c.fwd)
        with torch.cuda.graph(c.fwd, pool=pool):
            out = self._body(c)
        c.grad_out = torch.zeros_like(out)
        with torch.cuda.graph(c.bwd, pool=pool):
            out.backward(c.grad_out)
        # the static output without its autograd graph: kept, that graph would keep the
        # parameters' AccumulateGrad nodes of the capture stream alive, and a tied embedding's
        # eager head would then accumulate through them across streams
        c.out = out.detach()
        self.captured[bucket] = c
        self.captures += 1
