"""Mixture-of-experts MLP: Hugging Face's Qwen3-MoE and Mixtral sparse blocks, tensor parallel
inside every expert, the experts shared out over an expert-parallel group.

Routing (both families): router logits = x·Wᵣᵀ, probabilities = softmax in fp32, the top-k of
them per token, renormalised to sum 1 (Mixtral always; Qwen3-MoE with norm_topk_prob). Qwen3-MoE
casts the weights back to the activations' dtype before they scale the expert outputs; Mixtral
scales in fp32 and rounds the product. Each routed expert is a SwiGLU MLP; a token's output is
the weighted sum of its k experts' outputs. No token is dropped (no capacity limit).

Parameters: this rank's experts stacked, two per layer (HF 5.x's in-memory layout, sharded):
experts.gate_up_proj [E_local, 2·I/tp, H] (expert e's rank shard [gate_r; up_r], as the dense
MLP's gate_up_proj, models.decoder.MLP) and experts.down_proj [E_local, H, I/tp]. Each expert
keeps the [out, in] orientation of nn.Linear, so the grouped GEMM reads the stacked tensors
transposed as views (the column-major operand the CUDA kernel takes) and the loop indexes them:
no per-call copy. Outside the layer every expert keeps its own name (expert_views:
experts.{e}.gate_up_proj.weight, e the global id): the HF mapping (models.hf.param_plan), the
reshard plan and the vLLM stream work per expert on views of the stacked parameters, while the
optimizer buckets the stacked parameters themselves. The router weight [E, H] is whole on every
TP rank.

Tensor parallelism: the input is gathered from the sequence shards (or copied to the TP region),
every rank routes all tokens the same way and computes its slice of every expert's hidden units;
the partial outputs are summed over TP (reduce-scattered back to sequence shards under SP). A
rank's router gradient comes from its own slices only, so it is summed over TP as the q/k-norm
weights' are (`sequence_parallel` marks it for that sum).

Expert parallelism (ep_group of ep ranks, parallel.layout): this rank holds experts
[r·E/ep, (r+1)·E/ep) only (experts.first = r·E/ep; their views named by global id), and the
router whole. Each rank routes its own tokens; the rows for another rank's experts go there and
back by all-to-all (parallel.experts), inside the EP group of this TP rank: every TP rank of a
replica routes the same tokens the same way, so each sends the same rows, its experts' TP slices
compute their partial outputs, and the TP sum after the combine is the dense path's. The
sync-free form (rollout) needs every expert: the generation model has no EP.

The local experts run as two grouped GEMMs over the rows sorted by expert (torch._grouped_mm on
the stacked parameters; Megatron's GroupedMLP) where torch has the kernel for the dtype, device
and widths (grouped_mm_runs), else one call per expert. Without EP the group ends come from a
binary search over the sorted expert ids and stay on the device: no host synchronisation, so the
rollout's CUDA graphs and compiled steps (sync_free) take this form too and run only the routed
experts' FLOPs; where the grouped GEMM does not run they fall back to every expert over every
token, weighted by the routing.

Router losses (training, off by default as in Megatron): the load-balancing loss and the z-loss
per layer, their gradients started from the layer output (no path to the trainer's loss), their
values summed for the step's metrics (actor/moe/*).
"""
from __future__ import annotations

import re

import torch
from torch import nn

from hybridengine.models.features import activation
from hybridengine.parallel.experts import combine, dispatch
from hybridengine.parallel.tensor import copy_to_tp, divide, gather_from_sp, group_rank, \
    group_size, reduce_from_tp, reduce_scatter_to_sp


_STACKED = re.compile(r"(.+\.mlp\.experts\.)(gate_up_proj|down_proj)")
_VIEW = re.compile(r"(.+\.mlp\.experts\.)(\d+)\.(gate_up_proj|down_proj)\.weight")


def is_expert_param(name: str) -> bool:
    """A stacked routed-experts parameter (not replicated over an EP group), by its Decoder
    name (layers.L.mlp.experts.gate_up_proj / down_proj)."""
    return _STACKED.fullmatch(name) is not None


def expert_view_name(name: str, expert: int) -> str:
    """The per-expert name of global expert `expert` in stacked parameter `name`."""
    m = _STACKED.fullmatch(name)
    return f"{m.group(1)}{expert}.{m.group(2)}.weight"


def stacked_name(name: str) -> tuple[str, int] | None:
    """(stacked parameter name, global expert id) of a per-expert name; None for others."""
    m = _VIEW.fullmatch(name)
    return None if m is None else (m.group(1) + m.group(3), int(m.group(2)))


def expert_views(named, first: int = 0):
    """(name, tensor) pairs with each stacked expert tensor [n, ...] replaced by its n views
    [...] named per expert, global ids first … first + n − 1 (the names models.hf.param_plan
    maps to HF tensors); other pairs pass unchanged. Views, no copy."""
    for name, t in named:
        if is_expert_param(name):
            yield from ((expert_view_name(name, first + i), t[i]) for i in range(t.shape[0]))
        else:
            yield name, t


def stack_views(views: list[torch.Tensor]) -> torch.Tensor | None:
    """Equal-shaped views spaced evenly in one storage (consecutive experts) as one stacked
    [n, ...] view of it, no copy; None when they are not."""
    first = views[0]
    step = views[1].storage_offset() - first.storage_offset() if len(views) > 1 else \
        first.numel()
    for i, v in enumerate(views):
        if v.shape != first.shape or v.stride() != first.stride() or v.dtype != first.dtype \
                or v.device != first.device or v.untyped_storage().data_ptr() != \
                first.untyped_storage().data_ptr() or \
                v.storage_offset() != first.storage_offset() + i * step:
            return None
    return first.as_strided((len(views), *first.shape), (step, *first.stride()),
                            first.storage_offset())


class StackedExperts(nn.Module):
    """Experts [first, first + num) of this EP rank, each a SwiGLU TP shard of I/tp hidden
    units, stacked (module doc): gate_up_proj [num, 2·I/tp, H], down_proj [num, H, I/tp]."""

    def __init__(self, first: int, num: int, hidden: int, ffn_per_rank: int, dtype, device):
        super().__init__()
        self.first, self.ffn_per_rank = first, ffn_per_rank
        self.gate_up_proj = nn.Parameter(torch.empty(num, 2 * ffn_per_rank, hidden,
                                                     dtype=dtype, device=device))
        self.down_proj = nn.Parameter(torch.empty(num, hidden, ffn_per_rank, dtype=dtype,
                                                  device=device))
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)

    def __len__(self) -> int:
        return self.gate_up_proj.shape[0]

    def run(self, i: int, x: torch.Tensor, act) -> torch.Tensor:
        """Local expert i over rows x [n, H] (its weights indexed: views, no copy)."""
        gate, up = nn.functional.linear(x, self.gate_up_proj[i]).split(self.ffn_per_rank, -1)
        return nn.functional.linear(act(gate) * up, self.down_proj[i])


class MoEMLP(nn.Module):
    def __init__(self, cfg, group, sp: bool, dtype, device, ep_group=None):
        super().__init__()
        self.group, self.sequence_parallel, self.ep_group = group, sp, ep_group
        tp, ep = group_size(group), group_size(ep_group)
        if cfg.num_experts % ep:
            raise ValueError(f"num_experts={cfg.num_experts} is not divisible by "
                             f"expert_model_parallel_size={ep}")
        self.num_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.weights_in_fp32 = cfg.model_type == "mixtral"
        ffn = divide(cfg.moe_intermediate_size, tp, "moe_intermediate_size")
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False, dtype=dtype,
                              device=device)
        nn.init.normal_(self.gate.weight, std=0.02)
        self.gate.weight.sequence_parallel = tp > 1
        self.ffn_per_rank = ffn
        local = cfg.num_experts // ep
        self.experts = StackedExperts(group_rank(ep_group) * local, local, cfg.hidden_size, ffn,
                                      dtype, device)
        self.act = activation(cfg.hidden_act)
        self.tp = tp
        # router losses (training only; 0: off), set by the training engine from the run's
        # config; loss_scale: 1 / the micro-batches x replicas a step's gradients sum over.
        # The sums: each training forward's detached losses, for the step's metrics.
        self.aux_loss_coef = self.z_loss_coef = 0.0
        self.register_buffer("loss_scale", torch.ones((), dtype=torch.float32, device=device),
                             persistent=False)
        self.register_buffer("loss_sums", torch.zeros(3, dtype=torch.float64, device=device),
                             persistent=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(router logits [T, E], top-k weights [T, k], top-k expert ids [T, k])."""
        logits = self.gate(x)
        # fp32 as HF does for 16/32-bit activations; float64 kept (tests compare gradients)
        probs = torch.softmax(logits, dim=-1,
                              dtype=torch.promote_types(logits.dtype, torch.float32))
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, (weights if self.weights_in_fp32 else weights.to(x.dtype)), experts

    # The rollout sets it where its decode step runs in CUDA graphs or compiled: nothing may
    # ask the host for the tokens per expert (the loop does), which a captured graph cannot do
    sync_free = False

    def forward(self, x: torch.Tensor, real_rows: torch.Tensor | None = None) -> torch.Tensor:
        """real_rows: [T] bool, the rows (of the gathered input, as routed) that are tokens, not
        padding (the sequence-parallel pad, a CP shard's; None: all are): the router losses
        count those only, as HF's with an attention mask."""
        if self.sync_free and group_size(self.ep_group) > 1:
            raise RuntimeError("the sync-free MoE form needs every expert on this rank (no EP)")
        x = gather_from_sp(x, self.group) if self.sequence_parallel else copy_to_tp(x, self.group)
        logits, weights, experts = self.route(x)
        if self.sync_free and not grouped_mm_runs(x, self.ffn_per_rank):
            out = self._every_expert(x, weights, experts)
        else:       # sync-free where the grouped GEMM runs and there is no EP
            out = self._routed(x, weights, experts)
        if (self.aux_loss_coef or self.z_loss_coef) and self.training and \
                torch.is_grad_enabled():
            out = _AddLossGradient.apply(out, self._router_loss(logits, experts, real_rows))
        return reduce_scatter_to_sp(out, self.group) if self.sequence_parallel \
            else reduce_from_tp(out, self.group)

    def _router_loss(self, logits, experts, real_rows=None) -> torch.Tensor:
        """coef-weighted load-balancing loss (Switch Transformer, as HF's Qwen3-MoE / Mixtral
        for one layer: E·Σₑ fₑ·Pₑ, fₑ the tokens routed to e per token over the k slots, Pₑ
        the mean router probability) plus z-loss (ST-MoE: mean logsumexp(logits)²), scaled for
        the gradient sums: every TP rank computes the same on the same tokens, and the router's
        and the input's gradients are summed over TP."""
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        probs = torch.softmax(logits, dim=-1)
        # each row's weight in the means: 1 for a token, 0 for padding
        real = torch.ones(logits.shape[0], dtype=probs.dtype, device=probs.device) \
            if real_rows is None else real_rows.to(probs.dtype)
        tokens = real.sum().clamp_min(1)          # a CP shard may hold padding alone
        counts = torch.zeros(self.num_experts, dtype=probs.dtype, device=probs.device)
        counts.scatter_add_(0, experts.reshape(-1),
                            real.repeat_interleave(experts.shape[-1]))
        mean_probs = (probs * real[:, None]).sum(0) / tokens      # sums, not a TF32-able GEMV
        balance = self.num_experts * (counts / tokens * mean_probs).sum()
        z = (torch.logsumexp(logits, dim=-1).square() * real).sum() / tokens
        with torch.no_grad():
            self.loss_sums += torch.stack([balance, z, torch.ones_like(z)]).detach()
        loss = self.aux_loss_coef * balance + self.z_loss_coef * z
        return loss * self.loss_scale / self.tp

    def _every_expert(self, x, weights, experts) -> torch.Tensor:
        """Every expert over every token, scaled by the token's routing weight (0 where not
        routed): no host synchronisation, num_experts / top_k times the expert FLOPs; the
        sync-free form where the grouped GEMM does not run. The same sum, in the same expert
        order, as the loop."""
        dense = torch.zeros(x.shape[0], self.num_experts, dtype=weights.dtype, device=x.device)
        dense.scatter_(1, experts, weights)
        out = torch.zeros_like(x)
        for e in range(len(self.experts)):
            out = out + (self.experts.run(e, x, self.act) * dense[:, e:e + 1]).to(x.dtype)
        return out

    def _routed(self, x, weights, experts) -> torch.Tensor:
        """Each expert over the tokens routed to it, grouped or one after another (module doc);
        under EP, over the rows every rank of the EP group routed to it (parallel.experts)."""
        # the (token, slot) pairs sorted by expert: each expert reads one contiguous block
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        inverse = torch.empty_like(order).scatter_(
            0, order, torch.arange(order.numel(), device=order.device))
        # each expert's end in the sorted ids by binary search: on the device (bincount's CUDA
        # kernel asks the host for the largest id first)
        ends = torch.searchsorted(flat[order], torch.arange(self.num_experts, device=x.device),
                                  right=True)
        routed = _PermuteRows.apply(x, order, inverse, self.top_k)
        if group_size(self.ep_group) > 1:
            sent = dispatch(routed, torch.diff(ends, prepend=ends.new_zeros(1)), self.ep_group)
            rows, counts = sent.rows, sent.expert_counts
            ends = torch.cumsum(torch.tensor(counts, device=x.device), 0)
        else:
            sent, rows = None, routed
        if grouped_mm_runs(rows, self.ffn_per_rank):
            y = self._grouped(rows, ends.to(torch.int32))
        else:
            y = self._loop(rows, torch.diff(ends, prepend=ends.new_zeros(1)).tolist()
                           if sent is None else counts)
        if sent is not None:
            y = combine(y, sent)
        # back in (token, slot) order, each token's k rows side by side: a weighted sum over
        # them, where a scatter-add by token would take atomics (and their nondeterminism)
        pairs = _UnpermuteRows.apply(y, order, inverse)
        pairs = (pairs * weights.reshape(-1, 1)).to(x.dtype)
        return pairs.view(-1, self.top_k, x.shape[-1]).sum(1)

    def _loop(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """rows grouped by local expert, counts[e] of them each: one expert call per group."""
        outs, start = [], 0
        for e, n in enumerate(counts):
            if n:
                outs.append(self.experts.run(e, rows[start:start + n], self.act))
            start += n
        return torch.cat(outs) if outs else rows[:0]

    def _grouped(self, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """The same as _loop in two grouped GEMMs (offsets: the groups' int32 ends, on the
        device). The stacked [E, out, in] parameters are read transposed, [E, in, out] views of
        the parameters themselves: the column-major operand the CUDA kernel takes, no copy;
        gradients land in the stacked parameters."""
        experts = self.experts
        h = torch._grouped_mm(rows, experts.gate_up_proj.transpose(-2, -1), offs=offsets)
        gate, up = h.split(experts.ffn_per_rank, dim=-1)
        return torch._grouped_mm(self.act(gate) * up, experts.down_proj.transpose(-2, -1),
                                 offs=offsets)


def grouped_mm_runs(x: torch.Tensor, ffn: int) -> bool:
    """Whether torch's grouped GEMM takes x [rows, hidden] into experts of ffn units: CPU in
    fp32/bf16, CUDA in bf16 on sm90 and newer (its CUTLASS kernel, which reads the offsets on
    the device: CUDA-graph capturable; torch's fallback for older GPUs syncs), rows of both
    widths 16-byte aligned; float64 (the gradient tests), odd widths and older GPUs take the
    loop (or, sync-free, every expert)."""
    if not hasattr(torch, "_grouped_mm") or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    if (x.shape[-1] * x.element_size()) % 16 or (ffn * x.element_size()) % 16 or not ffn:
        return False
    if x.is_cuda:
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] >= 9
    return x.device.type == "cpu"


class _PermuteRows(torch.autograd.Function):
    """rows[i] = x[order[i] // k]: the (token, slot) pairs' rows in expert order. Backward
    gathers instead of scattering: token t's k row gradients sit at inverse[t·k + j] (inverse
    = order's inverse permutation), summed without atomics."""

    @staticmethod
    def forward(ctx, x, order, inverse, k):
        ctx.save_for_backward(inverse)
        ctx.k = k
        return x[order // k]

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad[inverse].view(-1, ctx.k, grad.shape[-1]).sum(1), None, None, None


class _UnpermuteRows(torch.autograd.Function):
    """pairs[p] = y[inverse[p]]: rows in expert order back in (token, slot) order; the
    backward is the permutation itself (grad[order]), no scatter."""

    @staticmethod
    def forward(ctx, y, order, inverse):
        ctx.save_for_backward(order)
        return y[inverse]

    @staticmethod
    def backward(ctx, grad):
        (order,) = ctx.saved_tensors
        return grad[order], None, None


class _AddLossGradient(torch.autograd.Function):
    """Identity on the layer output; its backward also starts the gradient of a side loss
    (Megatron's MoEAuxLossAutoScaler): the router losses need no path to the trainer's loss."""

    @staticmethod
    def forward(ctx, out, loss):
        ctx.save_for_backward(loss)
        return out

    @staticmethod
    def backward(ctx, grad):
        (loss,) = ctx.saved_tensors
        return grad, torch.ones_like(loss)
