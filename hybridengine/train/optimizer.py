"""Gradient sync over data parallel in flat buckets, and a distributed AdamW (ZeRO-1); the LR
schedule is in lr_schedule.py.

Gradients
    Every trainable parameter gets `p.main_grad`, a view into a flat fp32 bucket buffer. A
    post-accumulate-grad hook adds `p.grad` into it and frees `p.grad`, so gradients accumulate in
    fp32 across micro-batches and bf16 gradients never pile up. Gradient syncs other than DP and
    sequence parallelism (the tied embedding across first and last pipeline stage) must act on
    `p.main_grad`, after the last backward and before `finish_grad_sync`. (tensor.py's
    `sync_sequence_parallel_grads` reads `p.grad`: with this optimizer pass `tp_group` instead.)

Reduction over DP (`grad_reduce`) — the loss-scaling contract
    "sum"  gradients are summed over DP ranks. Right when each rank's loss is already its share of
           the global loss: the RL losses (hybridengine.rl.losses) divide by a normaliser summed
           over every micro-batch of every DP rank, so back-propagate them unscaled.
    "mean" gradients are averaged over DP ranks (torch DDP / Megatron convention). Right when each
           rank's loss is a mean over its own data; identical to "sum" with the loss divided by dp.
    Micro-batch losses are back-propagated as they are in both modes: any 1/num_micro_batches is
    part of the loss.

Buckets and ZeRO-1
    Parameters, in reverse order (roughly the order backward finishes them), are packed into
    buckets of about `bucket_mb` MB of fp32 gradient, starts aligned to 64 elements, each bucket
    padded to a multiple of dp. With `use_distributed_optimizer` DP rank r owns the slice
    [r·n/dp, (r+1)·n/dp) of each n-element bucket: fp32 master weights and Adam moments exist
    for that slice only; gradients are reduce-scattered, and after the update the slices are
    all-gathered in the parameters' dtype back into the parameters. Without it every rank owns the
    whole bucket and gradients are all-reduced. Master weights are copied from the parameters at
    construction: build the optimizer after the weights are loaded. Buffers are fp32 for bf16 and
    fp32 parameters (on CPU the master is still a separate copy) and fp64 for fp64 parameters.

Expert parameters (expert parallelism, parallel.layout)
    An EP rank's experts are not replicated over DP but over its expert-data-parallel group
    (dp·cp/ep replicas; their gradients already hold every rank's tokens, brought by the
    all-to-all's backward): parameters with is_expert(name, p) go into buckets of their own,
    reduced (and ZeRO-sharded) over `edp_group`, the rest over `dp_group`. grad_reduce="mean"
    divides both by dp (a rank's expert gradient sums all dp ranks' tokens). In the grad norm the
    expert part is also summed over `ep_group` (each EP rank holds different experts).

step()
    grad norm = sqrt(Σ g²) over this rank's slice, summed over dp (ZeRO only: otherwise every DP
    rank holds the whole reduced gradient) and then over the model-parallel group; parameters for
    which count_in_grad_norm(name, p) is False (TP-replicated copies on tp_rank > 0, the tied
    lm_head copy on the last stage) are left out so nothing is counted twice. Clipping as
    torch.nn.utils.clip_grad_norm_ (coef = max_norm / (norm + 1e-6), capped at 1). A non-finite
    norm skips the update and returns stepped=False. The update is torch.optim.AdamW's (decoupled
    weight decay, bias correction), with no weight decay where no_decay(name, p) (default: 1-D
    parameters, i.e. biases and norm weights). Unused parameters get zero gradients (moments and
    weight decay still apply), as in Megatron. With `host_step` master weights and moments live in
    host memory and the update runs on the CPU, overlapped with the copies (host_step.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from hybridengine.train.host_step import HostStep
from hybridengine.train.lr_schedule import LRSchedule
from hybridengine.train.optimizer_checks import check_args, check_layout
from hybridengine.parallel.tensor import (all_gather_flat, all_reduce, group_rank, group_size,
                                          reduce_scatter_dim0)

ParamFilter = Callable[[str, nn.Parameter], bool]
_ALIGN = 64          # elements: bucket views start on 256-byte (fp32) boundaries


def default_no_decay(name: str, param: nn.Parameter) -> bool:
    """Biases and norm weights (every parameter with fewer than 2 dims) get no weight decay."""
    return param.dim() < 2


@dataclass
class _Entry:
    """One parameter's place in its bucket: elements [start, start + numel)."""

    name: str
    param: nn.Parameter
    start: int
    counted: bool
    decay: bool

    @property
    def stop(self) -> int:
        return self.start + self.param.numel()


@dataclass
class _Bucket:
    entries: list[_Entry]
    numel: int                          # padded to a multiple of dp
    grad: torch.Tensor                  # fp32 [numel]
    group: object = None                # its replicas: dp, or expert-dp for expert buckets
    sharded: bool = False               # ZeRO-1 over `group`
    expert: bool = False
    shard_start: int = 0                # this rank's slice [shard_start, shard_start + shard_numel)
    shard_numel: int = 0
    master: torch.Tensor = None         # fp32 [shard_numel]
    exp_avg: torch.Tensor = None
    exp_avg_sq: torch.Tensor = None
    norm_views: list[torch.Tensor] = field(default_factory=list)    # counted grad runs
    decay_views: list[torch.Tensor] = field(default_factory=list)   # decayed master runs

    @property
    def shard_grad(self) -> torch.Tensor:
        return self.grad[self.shard_start:self.shard_start + self.shard_numel]

    def runs(self, keep: Callable[[_Entry], bool]) -> list[tuple[int, int]]:
        """Maximal runs [lo, hi) of this rank's slice, in slice coordinates, covering consecutive
        entries with keep(entry). Alignment gaps inside a run hold zeros and are harmless."""
        lo_s, hi_s = self.shard_start, self.shard_start + self.shard_numel
        runs: list[list[int]] = []
        prev_kept = False
        for e in self.entries:
            lo, hi = max(e.start, lo_s), min(e.stop, hi_s)
            if lo >= hi:
                continue
            if keep(e) and prev_kept:
                runs[-1][1] = hi - lo_s
            elif keep(e):
                runs.append([lo - lo_s, hi - lo_s])
            prev_kept = keep(e)
        return [(a, b) for a, b in runs]


def _build_buckets(params, bucket_mb, num_shards, count_fn, no_decay_fn) -> list[_Bucket]:
    max_numel = int(bucket_mb * 2**20 / 4) if bucket_mb and bucket_mb > 0 else None
    groups: list[list[_Entry]] = []
    key, size = None, 0
    for name, p in reversed(params):
        start = -(-size // _ALIGN) * _ALIGN
        if not groups or (p.dtype, p.device) != key or (
                max_numel is not None and size > 0 and start + p.numel() > max_numel):
            groups.append([])
            key, start = (p.dtype, p.device), 0
        groups[-1].append(_Entry(name, p, start, count_fn(name, p), not no_decay_fn(name, p)))
        size = start + p.numel()
    buckets = []
    for entries in groups:
        used = entries[-1].stop
        numel = -(-used // (num_shards * _ALIGN)) * num_shards * _ALIGN
        # fp32 for bf16/fp16/fp32 parameters; fp64 parameters (tests) keep fp64 throughout
        dtype = torch.promote_types(entries[0].param.dtype, torch.float32)
        grad = torch.zeros(numel, dtype=dtype, device=entries[0].param.device)
        buckets.append(_Bucket(entries, numel, grad))
    return buckets


class DistributedOptimizer:
    """AdamW over fp32 master weights with DP gradient sync in buckets (module docstring).

    params: (name, parameter) pairs of this rank's model shard, same order on every DP rank.
    dp_group / mp_group / tp_group: process groups (None = group of one); mp_group holds the tp·pp
    ranks of one replica (grad norm); tp_group sums the grads of `sequence_parallel` parameters;
    is_expert / edp_group / ep_group: expert parameters and their groups (module docstring).
    """

    def __init__(self, params, dp_group=None, mp_group=None, tp_group=None, *,
                 lr: float | LRSchedule = 1e-6, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, grad_clip: float | None = 1.0,
                 use_distributed_optimizer: bool = True, bucket_mb: float | None = 40.0,
                 grad_reduce: str = "sum", count_in_grad_norm: ParamFilter | None = None,
                 no_decay: ParamFilter | None = None, host_step: bool = False,
                 is_expert: ParamFilter | None = None, edp_group=None, ep_group=None):
        params = [(n, p) for n, p in params if p.requires_grad]
        check_args(params, betas, eps, weight_decay, grad_reduce)
        self.schedule = lr if isinstance(lr, LRSchedule) else LRSchedule(float(lr))
        self.betas, self.eps, self.weight_decay = betas, eps, weight_decay
        self.grad_clip, self.grad_reduce = grad_clip, grad_reduce
        self.dp_group, self.mp_group, self.tp_group = dp_group, mp_group, tp_group
        self.dp = group_size(dp_group)
        self.zero = use_distributed_optimizer and self.dp > 1
        self.num_steps = 0          # successful updates (Adam bias correction)
        self.schedule_step = 0      # LR schedule position, advanced by step_schedule()
        self._synced = False
        self.ep_group = ep_group
        expert = {n for n, p in params if is_expert is not None and is_expert(n, p)}
        self.buckets = []
        for part, group, is_exp in (([x for x in params if x[0] not in expert], dp_group, False),
                                    ([x for x in params if x[0] in expert], edp_group, True)):
            sharded = use_distributed_optimizer and group_size(group) > 1
            built = _build_buckets(part, bucket_mb, group_size(group) if sharded else 1,
                                   count_in_grad_norm or (lambda n, p: True),
                                   no_decay or default_no_decay) if part else []
            for b in built:
                b.group, b.sharded, b.expert = group, sharded, is_exp
            self.buckets += built
        self._sp_params = [p for _, p in params if getattr(p, "sequence_parallel", False)]
        self.host_step = HostStep(self) if host_step else None
        for b in self.buckets:
            self._init_bucket(b, group_size(b.group) if b.sharded else 1,
                              group_rank(b.group) if b.sharded else 0)
            if self.host_step is not None:
                self.host_step.adopt(b)     # state to the host bucket by bucket
        self._hooks = [self._attach(b, e) for b in self.buckets for e in b.entries]

    # --- setup --------------------------------------------------------------------------------
    def _init_bucket(self, b: _Bucket, num_shards: int, shard_rank: int) -> None:
        b.shard_numel = b.numel // num_shards
        b.shard_start = shard_rank * b.shard_numel
        b.master = torch.zeros(b.shard_numel, dtype=b.grad.dtype, device=b.grad.device)
        lo_s, hi_s = b.shard_start, b.shard_start + b.shard_numel
        with torch.no_grad():
            for e in b.entries:
                lo, hi = max(e.start, lo_s), min(e.stop, hi_s)
                if lo < hi:
                    b.master[lo - lo_s:hi - lo_s].copy_(
                        e.param.detach().reshape(-1)[lo - e.start:hi - e.start])
        b.exp_avg, b.exp_avg_sq = torch.zeros_like(b.master), torch.zeros_like(b.master)
        b.norm_views = [b.shard_grad[lo:hi] for lo, hi in b.runs(lambda e: e.counted)]
        b.decay_views = [b.master[lo:hi] for lo, hi in b.runs(lambda e: e.decay)]

    @staticmethod
    def _attach(b: _Bucket, e: _Entry):
        p = e.param
        if hasattr(p, "main_grad"):
            raise ValueError(f"parameter {e.name} already belongs to a DistributedOptimizer; "
                             f"call release() on the old one first")
        p.main_grad = b.grad[e.start:e.stop].view_as(p)

        def accumulate(param: torch.Tensor) -> None:
            param.main_grad.add_(param.grad)
            param.grad = None
        return p.register_post_accumulate_grad_hook(accumulate)

    def release(self) -> None:
        """Remove the hooks and `main_grad` views (the parameters go back to plain autograd)."""
        for h in self._hooks:
            h.remove()
        for b in self.buckets:
            for e in b.entries:
                del e.param.main_grad
        self._hooks = []

    # --- gradients ----------------------------------------------------------------------------
    def zero_grad(self) -> None:
        for b in self.buckets:
            b.grad.zero_()
            for e in b.entries:
                e.param.grad = None
        self._synced = False

    def finish_grad_sync(self) -> None:
        """After the last micro-batch's backward: sum sequence-parallel grads over TP, then reduce
        each bucket over DP (reduce-scatter with ZeRO-1, else all-reduce). Collective."""
        if self._synced:
            raise RuntimeError("finish_grad_sync called twice without zero_grad() in between")
        if self._sp_params and group_size(self.tp_group) > 1:
            flat = torch.cat([p.main_grad.reshape(-1) for p in self._sp_params])
            all_reduce(flat, self.tp_group)
            offset = 0
            for p in self._sp_params:
                p.main_grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        for b in self.buckets:
            if self.grad_reduce == "mean" and self.dp > 1:
                b.grad.div_(self.dp)
            if b.sharded:
                b.shard_grad.copy_(reduce_scatter_dim0(b.grad, b.group))
            else:
                all_reduce(b.grad, b.group)
        self._synced = True

    def grad_norm(self) -> float:
        """Global L2 norm of the reduced gradient over TP/PP/DP (counted parameters only)."""
        device = self.buckets[0].grad.device
        total, experts = (torch.zeros((), dtype=torch.float64, device=device) for _ in "de")
        for b in self.buckets:
            for v in b.norm_views:
                (experts if b.expert else total).add_(torch.dot(v, v).double())
        if self.zero:
            all_reduce(total, self.dp_group)
        if any(b.expert for b in self.buckets):     # this EP rank's experts, then all of them
            if any(b.sharded for b in self.buckets if b.expert):
                all_reduce(experts, self.buckets[-1].group)
            total += all_reduce(experts, self.ep_group)
        all_reduce(total, self.mp_group)
        return math.sqrt(total.item())

    # --- update -------------------------------------------------------------------------------
    @property
    def current_lr(self) -> float:
        return self.schedule.get_lr(self.schedule_step)

    def step_schedule(self) -> None:
        """Advance the LR schedule by one (verl: once per trainer step, after the updates)."""
        self.schedule_step += 1

    @torch.no_grad()
    def step(self, lr: float | None = None) -> tuple[float, bool]:
        """Sync grads if not done yet, clip, AdamW on this rank's slices, publish the new params.

        lr: overrides the schedule's current_lr for this update. Returns (grad_norm, stepped):
        stepped is False, and nothing changes, when the norm is NaN or inf. Collective.
        """
        if not self._synced:
            self.finish_grad_sync()
        norm = self.grad_norm()
        if not math.isfinite(norm):
            return norm, False
        if self.grad_clip is not None and self.grad_clip > 0:
            coef = self.grad_clip / (norm + 1e-6)
            if coef < 1.0:
                for b in self.buckets:
                    b.shard_grad.mul_(coef)
        self.num_steps += 1
        lr = self.current_lr if lr is None else lr
        self.publish_params(self.host_step.step(lr) if self.host_step else self._adamw(lr))
        return norm, True

    def _adamw(self, lr: float, buckets=None) -> None:
        # Same arithmetic, in the same order, as torch.optim.AdamW's single-tensor path.
        beta1, beta2 = self.betas
        bias_correction1 = 1 - beta1 ** self.num_steps
        bias_correction2_sqrt = (1 - beta2 ** self.num_steps) ** 0.5
        step_size = lr / bias_correction1
        for b in self.buckets if buckets is None else buckets:      # host_step: chunks
            if self.weight_decay != 0:
                for v in b.decay_views:
                    v.mul_(1 - lr * self.weight_decay)
            grad = b.shard_grad
            b.exp_avg.lerp_(grad, 1 - beta1)
            b.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = (b.exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(self.eps)
            b.master.addcdiv_(b.exp_avg, denom, value=-step_size)

    @torch.no_grad()
    def publish_params(self, shards: list[torch.Tensor] | None = None) -> None:
        """Write the master weights (or `shards`, this rank's slices on the device) into the
        parameters (all-gather over DP under ZeRO-1), in their dtype. Collective under ZeRO-1."""
        if shards is None:
            shards = self.host_step.stage() if self.host_step else [b.master for b in self.buckets]
        for b, shard in zip(self.buckets, shards):
            dtype = b.entries[0].param.dtype
            full = shard        # without ZeRO the slice is the whole bucket
            if b.sharded:
                full = torch.empty(b.numel, dtype=dtype, device=shard.device)
                all_gather_flat(full, shard.to(dtype), b.group)
            if full.dtype != dtype:
                full = full.to(dtype)
            # One multi-tensor copy per bucket instead of a kernel launch per parameter.
            torch._foreach_copy_([e.param.view(-1) for e in b.entries],
                                 [full[e.start:e.stop] for e in b.entries])

    # --- state --------------------------------------------------------------------------------
    def memory_bytes(self) -> int:
        """Bytes of optimizer state on this rank: fp32 master weights and both Adam moments."""
        return sum(t.numel() * t.element_size() for b in self.buckets
                   for t in (b.master, b.exp_avg, b.exp_avg_sq))

    def _layout(self) -> list[dict]:
        return [{"numel": b.numel, "shard_start": b.shard_start, "shard_numel": b.shard_numel,
                 "params": [[e.name, list(e.param.shape), e.start] for e in b.entries]}
                for b in self.buckets]

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        """(tensors, meta) of this rank: plain tensors for safetensors (live buffers, not copies)
        and JSON-able meta, including the bucket layout that load_state_dict checks."""
        tensors = {}
        for i, b in enumerate(self.buckets):
            tensors.update({f"bucket{i}.master": b.master, f"bucket{i}.exp_avg": b.exp_avg,
                            f"bucket{i}.exp_avg_sq": b.exp_avg_sq})
        meta = {"num_steps": self.num_steps, "schedule_step": self.schedule_step,
                "zero": self.zero, "dp": self.dp, "buckets": self._layout()}
        return tensors, meta

    @torch.no_grad()
    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict,
                        publish: bool = True) -> None:
        """Restore a state_dict() saved by the same layout, bit-exact. With `publish` the
        parameters are rebuilt from the restored master weights (publish_params, collective under
        ZeRO-1): the model needs no separate weight checkpoint to resume."""
        if (meta.get("zero"), meta.get("dp")) != (self.zero, self.dp):
            raise ValueError(f"optimizer checkpoint has zero={meta.get('zero')} dp={meta.get('dp')}"
                             f", this run zero={self.zero} dp={self.dp}: same layout required")
        check_layout(meta.get("buckets", []), self._layout())
        for i, b in enumerate(self.buckets):
            for key in ("master", "exp_avg", "exp_avg_sq"):
                name, dst = f"bucket{i}.{key}", getattr(b, key)
                src = tensors.get(name)
                if src is None or src.shape != dst.shape:
                    got = None if src is None else list(src.shape)
                    raise ValueError(f"optimizer tensor {name}: checkpoint shape {got}, "
                                     f"expected {list(dst.shape)}")
                dst.copy_(src)
        self.num_steps, self.schedule_step = int(meta["num_steps"]), int(meta["schedule_step"])
        if publish:
            self.publish_params()
