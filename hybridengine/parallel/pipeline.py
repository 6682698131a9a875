"""Pipeline-parallel schedules: 1F1B for training, forward-only for scoring.

A schedule is a plain function over callables and a count of micro-batches (STYLE rule 4):

    forward_step(i, input_tensor | None) -> output
        the stage's forward of micro-batch i; `input_tensor` is the activation received from
        the previous stage (None on the first stage). Not last stage: the activation to send.
        Last stage (training): the scalar loss of micro-batch i, already normalised so that the
        sum over micro-batches and data-parallel ranks is the batch loss.
    activation_shape(i) -> torch.Size
        the shape of the activation entering / leaving a stage for micro-batch i. Every rank of a
        pipeline holds the same micro-batch metadata (token counts), so receivers derive shapes
        locally and no shape message is needed for packed micro-batches of varying length.

Point-to-point transfers go to the same (dp, tp) coordinate of the neighbouring stage (under
sequence parallelism each TP rank sends its own [T/tp, H] block). Sends and receives that happen at
the same time are issued together with batch_isend_irecv so that neighbouring stages never wait
on each other in opposite orders.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.profiler import record_function

from hybridengine.parallel.interleave import run_to_end


class StageComm:
    """Activation transfers between neighbouring pipeline stages of one (dp, tp) coordinate."""

    def __init__(self, mesh, dtype: torch.dtype, device):
        self.mesh, self.dtype, self.device = mesh, dtype, device
        s, ranks = mesh.pp_rank, mesh.pp_ranks
        self.group = mesh.pp_group              # peers are global ranks of this group
        self.prev = ranks[s - 1] if s > 0 else None
        self.next = ranks[s + 1] if s + 1 < len(ranks) else None

    def exchange(self, send_next=None, send_prev=None, recv_prev=None, recv_next=None):
        """Issue the given transfers together; recv_* are shapes. Returns (from_prev, from_next)."""
        ops, got_prev, got_next = [], None, None
        if send_next is not None and self.next is not None:
            ops.append(dist.P2POp(dist.isend, send_next.contiguous(), self.next, group=self.group))
        if send_prev is not None and self.prev is not None:
            ops.append(dist.P2POp(dist.isend, send_prev.contiguous(), self.prev, group=self.group))
        if recv_prev is not None and self.prev is not None:
            got_prev = torch.empty(recv_prev, dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, got_prev, self.prev, group=self.group))
        if recv_next is not None and self.next is not None:
            got_next = torch.empty(recv_next, dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, got_next, self.next, group=self.group))
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        return got_prev, got_next


def _backward(output, grad, input_tensor):
    """Backward of one micro-batch; returns the gradient w.r.t. the stage input (or None)."""
    with record_function("train.backward"):
        if grad is None:
            output.backward()
        else:
            torch.autograd.backward(output, grad_tensors=grad)
    return None if input_tensor is None else input_tensor.grad


def train_1f1b(forward_step: Callable, num_microbatches: int, activation_shape: Callable,
               comm: StageComm | None) -> list:
    """Run forward and backward of every micro-batch with the 1F1B schedule.

    Warm-up: stage s runs min(P - s - 1, M) forwards. Steady: one forward then one backward per
    micro-batch. Cool-down: the remaining backwards. At most P - s activations are alive on stage s.
    Returns the outputs of forward_step (the losses on the last stage).
    """
    if comm is None or comm.mesh.pp == 1:
        return run_to_end(train_1f1b_steps(forward_step, num_microbatches, activation_shape,
                                           comm))
    p, s = comm.mesh.pp, comm.mesh.pp_rank
    first, last = comm.prev is None, comm.next is None
    num_warmup = min(p - s - 1, num_microbatches)
    inputs, outputs, results = [], [], []

    def run_forward(i, x):
        if x is not None:
            x.requires_grad_()
        out = forward_step(i, x)
        inputs.append(x)
        outputs.append(out)
        results.append(out.detach())
        return out

    def shape(i):
        return activation_shape(i)

    for i in range(num_warmup):
        x, _ = comm.exchange(recv_prev=None if first else shape(i))
        out = run_forward(i, x)
        comm.exchange(send_next=None if last else out)
    num_steady = num_microbatches - num_warmup
    x = None
    if num_steady > 0 and not first:
        x, _ = comm.exchange(recv_prev=shape(num_warmup))
    for j in range(num_steady):
        i = num_warmup + j
        out = run_forward(i, x)
        _, grad = comm.exchange(send_next=None if last else out,
                                recv_next=None if last else shape(j))
        g_in = _backward(outputs.pop(0), grad, inputs.pop(0))
        has_next_fwd = j + 1 < num_steady
        x, _ = comm.exchange(send_prev=g_in,
                             recv_prev=shape(i + 1) if (has_next_fwd and not first) else None)
    for j in range(num_steady, num_microbatches):
        _, grad = comm.exchange(recv_next=None if last else shape(j))
        g_in = _backward(outputs.pop(0), grad, inputs.pop(0))
        comm.exchange(send_prev=g_in)
    return results


def train_1f1b_steps(forward_step: Callable, num_microbatches: int,
                     activation_shape: Callable, comm: StageComm | None):
    """train_1f1b as a unit of parallel.interleave (a generator returning its outputs): without
    a pipeline it yields after each micro-batch's backward is queued (forward, backward, next),
    where another engine's micro-batch may be queued; a pipeline's schedule runs whole, then
    yields once (its transfers pair stages micro-batch by micro-batch)."""
    if comm is not None and comm.mesh.pp > 1:
        outs = train_1f1b(forward_step, num_microbatches, activation_shape, comm)
        yield
        return outs
    outs = []
    for i in range(num_microbatches):
        loss = forward_step(i, None)
        _backward(loss, None, None)
        outs.append(loss.detach())
        yield
    return outs


def forward_only(forward_step: Callable, num_microbatches: int, activation_shape: Callable,
                 comm: StageComm | None) -> list:
    """Forward every micro-batch through the pipeline (no autograd graph is kept).

    Returns forward_step's outputs on the last stage (per-token tensors) and [] elsewhere; use
    `broadcast_from_last_stage` to deliver them to every stage.
    """
    outs = []
    with torch.no_grad():
        for i in range(num_microbatches):
            x = None
            if comm is not None and comm.prev is not None:
                x, _ = comm.exchange(recv_prev=activation_shape(i))
            out = forward_step(i, x)
            if comm is not None and comm.next is not None:
                comm.exchange(send_next=out)
            else:
                outs.append(out)
    return outs


def broadcast_from_last_stage(outs: list[torch.Tensor], sizes: list[int], mesh,
                              dtype=torch.float32, device=None) -> list[torch.Tensor]:
    """Give every stage the last stage's per-micro-batch outputs (1-D, `sizes` elements each) in
    one broadcast over the pipeline group."""
    if mesh is None or mesh.pp == 1:
        return outs
    if mesh.is_last_stage:
        flat = torch.cat([o.reshape(-1).to(dtype) for o in outs])
    else:
        flat = torch.empty(sum(sizes), dtype=dtype, device=device)
    dist.broadcast(flat, src=mesh.pp_ranks[-1], group=mesh.pp_group)
    return list(flat.split(sizes))
