"""Gradient sync over data parallel in flat buckets, and a distributed AdamW (ZeRO-1); the LR
schedule is in lr_schedule.py.

Gradients
    Every trainable parameter gets `p.main_grad`, a view into a flat fp32 bucket buffer. A
    post-accumulate-grad hook adds `p.grad` into it and frees `p.grad`, so gradients accumulate in
    fp32 across micro-batches and bf16 gradients never pile up. (With gradient-accumulation fusion the
    linear layers' backward adds their weights' gradients into `main_grad` itself:
    parallel.wgrad_accumulation; the hook then has nothing to add.) Gradient syncs other than DP and
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
    norm skips the update and returns stepped=False. The update is torch.optim.AdamW(fused=True)'s
    kernel (decoupled weight decay, bias correction; one multi-tensor launch reads and writes each
    state once, where the unfused ops took ~3x the memory traffic), with no weight decay where
    no_decay(name, p) (default: 1-D parameters, i.e. biases and norm weights). Unused parameters
    get zero gradients (moments and weight decay still apply), as in Megatron. With `host_step`
    master weights and moments live in host memory and the update runs on the CPU, overlapped
    with the copies (host_step.py).
    step(on_device=True): the same update, decided on the device: the non-finite guard is the
    kernel's found_inf, the step count a device tensor, and (grad_norm, stepped) come back as 0-d
    device tensors, so the host never waits for the device between optimizer steps (the caller
    reads them with its other metrics). Bit for bit the host-decided step.
"""
from __future__ import annotations

import math

import torch

from hybridengine.train.grad_buckets import (Bucket, Entry, ParamFilter, build_buckets,
                                             cover_runs, default_no_decay, fused_adam_lists)
from hybridengine.train.host_step import HostStep
from hybridengine.train.lr_schedule import LRSchedule
from hybridengine.train.optimizer_checks import check_args, check_layout
from hybridengine.parallel.tensor import (all_gather_flat, all_reduce, group_rank, group_size,
                                          reduce_scatter_dim0)

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
        # successful updates (Adam's bias correction), counted on the gradients' device so that
        # an update decided there (step(on_device=True)) needs no host read
        self._steps = torch.zeros((), dtype=torch.float32, device=next(
            (p.device for _, p in params), torch.device("cpu")))
        self.schedule_step = 0      # LR schedule position, advanced by step_schedule()
        self._synced = False
        self.ep_group = ep_group
        expert = {n for n, p in params if is_expert is not None and is_expert(n, p)}
        self.buckets = []
        for part, group, is_exp in (([x for x in params if x[0] not in expert], dp_group, False),
                                    ([x for x in params if x[0] in expert], edp_group, True)):
            sharded = use_distributed_optimizer and group_size(group) > 1
            built = build_buckets(part, bucket_mb, group_size(group) if sharded else 1,
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
        # the device step's views, built once as norm_views are (parking resizes the storages
        # in place: views stay valid); the host step builds its chunks' views as it goes
        self._adam_lists = None if self.host_step else fused_adam_lists(self.buckets)

    # --- setup --------------------------------------------------------------------------------
    def _init_bucket(self, b: Bucket, num_shards: int, shard_rank: int) -> None:
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
        b.adam_runs = cover_runs(b.runs(lambda e: e.decay), b.shard_numel)

    @staticmethod
    def _attach(b: Bucket, e: Entry):
        p = e.param
        if hasattr(p, "main_grad"):
            raise ValueError(f"parameter {e.name} already belongs to a DistributedOptimizer; "
                             f"call release() on the old one first")
        p.main_grad = b.grad[e.start:e.stop].view_as(p)

        def accumulate(param: torch.Tensor) -> None:
            if param.grad is None:      # a fused linear's backward added it into main_grad
                return                  # already (parallel.wgrad_accumulation)
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
        return math.sqrt(self._grad_norm_sq().item())

    def _grad_norm_sq(self) -> torch.Tensor:
        """grad_norm()**2 as a 0-d float64 tensor on the gradients' device (no host read)."""
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
        return total

    # --- update -------------------------------------------------------------------------------
    @property
    def current_lr(self) -> float:
        return self.schedule.get_lr(self.schedule_step)

    def step_schedule(self) -> None:
        """Advance the LR schedule by one (verl: once per trainer step, after the updates)."""
        self.schedule_step += 1

    @property
    def num_steps(self) -> int:
        """Updates applied so far (a host read of the device count)."""
        return int(self._steps.item())

    @torch.no_grad()
    def step(self, lr: float | None = None, on_device: bool = False):
        """Sync grads if not done yet, clip, AdamW on this rank's slices, publish the new params.

        lr: overrides the schedule's current_lr for this update. Returns (grad_norm, stepped):
        stepped is False, and nothing changes, when the norm is NaN or inf; floats, or with
        on_device (not with host_step) 0-d float64 device tensors, stepped 1.0 or 0.0, the
        update decided on the device without a host read. Collective.
        """
        if not self._synced:
            self.finish_grad_sync()
        norm = self._grad_norm_sq().sqrt()
        lr = self.current_lr if lr is None else lr
        if on_device and self.host_step is None:
            found_inf = (~norm.isfinite()).float()
            self._clip(norm)
            self._steps.add_(1)
            self._adamw(lr, self._adam_lists, [self._steps], found_inf)
            self._steps.sub_(found_inf)
            self.publish_params()
            return norm, 1.0 - found_inf.double()
        norm = norm.item()
        if not math.isfinite(norm):
            return norm, False
        self._clip(norm)
        self._steps.add_(1)
        if self.host_step:
            self.publish_params(self.host_step.step(lr, self._steps.cpu()))
        else:
            self._adamw(lr, self._adam_lists, [self._steps])
            self.publish_params()
        return norm, True

    def _clip(self, norm: float | torch.Tensor) -> None:
        """Gradients times clip_grad_norm_'s coefficient (a device tensor: capped at exactly 1,
        the product is then the gradient itself, bit for bit the host's skipped multiply)."""
        if self.grad_clip is None or self.grad_clip <= 0:
            return
        coef = self.grad_clip / (norm + 1e-6)
        if isinstance(coef, torch.Tensor):
            torch._foreach_mul_([b.shard_grad for b in self.buckets], coef.clamp(max=1.0))
        elif coef < 1.0:
            for b in self.buckets:
                b.shard_grad.mul_(coef)

    def _adamw(self, lr: float, lists: dict[bool, list[list[torch.Tensor]]],
               step: list[torch.Tensor], found_inf=None) -> None:
        """torch's fused AdamW on `lists` (grad_buckets.fused_adam_lists of the buckets; the host
        step: of one chunk): one call for the decayed runs, one for the rest. step: [the 0-d
        count of this update] on the state's device; found_inf: 1.0 leaves everything as it was
        (the kernel returns at once)."""
        beta1, beta2 = self.betas
        for decay, group in lists.items():
            if group[0]:
                torch._fused_adamw_(*group, [], step * len(group[0]), lr=lr, beta1=beta1,
                                    beta2=beta2, weight_decay=self.weight_decay if decay else 0.0,
                                    eps=self.eps, amsgrad=False, maximize=False,
                                    found_inf=found_inf)

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
        self._steps.fill_(int(meta["num_steps"]))
        self.schedule_step = int(meta["schedule_step"])
        if publish:
            self.publish_params()
