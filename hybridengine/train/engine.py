"""TrainEngine: one model role (actor, critic or reference) on one training layout.

Composes the pieces below it: the Decoder stage of this rank (models), the 1F1B and forward-only
schedules (parallel.pipeline) and the distributed optimizer (parallel.optimizer). It knows nothing
about RL: a caller hands it packed micro-batches and a loss function.

    engine.train_step(microbatches, loss_fn) -> metrics   (one optimizer step)
    engine.forward_only(microbatches)        -> per-token outputs on every rank
    engine.park(["optimizer"]) / unpark(...) -> its parts in host memory between uses

A MicroBatch is a PackedInput plus per-token tensors of its real (unpadded) tokens, e.g.
`targets` (the next token of each position, any value at a sequence's last position), masks,
advantages. Every rank of a model replica (all TP and PP ranks of one DP rank) and every CP rank
is given the same micro-batches; DP ranks get different ones, the same number each. CP ranks
each run a share of the tokens (train.context_split) and see the whole micro-batch's outputs.

Outputs per token on the last stage: {"logprob", "entropy"} of `targets` (at a temperature) for a
language model, {"values"} for a critic. loss_fn(outputs, mb) -> (loss, metrics) returns the
micro-batch's share of the batch loss (the DP reduction sums gradients).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import record_function

from hybridengine.kernels.wgrad import load_wgrad_kernel
from hybridengine.models.attention import PackedInput
from hybridengine.models.decoder import Decoder, ModelConfig
from hybridengine.models.hf import is_tp_replicated, load_decoder, save_hf
from hybridengine.models.moe import is_expert_param
from hybridengine.models.lora import (LoRAConfig, add_lora, is_lora_replicated,
                                      load_peft_adapter, save_peft_adapter)
from hybridengine.train.compile_layers import compile_decoder_layers
from hybridengine.train.context_split import CPView, split_for_cp
from hybridengine.train.cuda_graphs import BodyGraphs, unsupported as graphs_unsupported
from hybridengine.train.offload import HostParking
from hybridengine.train.optimizer import DistributedOptimizer, LRSchedule
from hybridengine.parallel.interleave import run_to_end
from hybridengine.parallel.pipeline import StageComm, broadcast_from_last_stage, forward_only, \
    train_1f1b_steps
from hybridengine.parallel.wgrad_accumulation import fuse_wgrad_accumulation


# What a TrainEngine can park in host memory: its weights, its gradient buckets (dead between
# updates: freed, not copied) and its optimizer state (fp32 master weights, Adam moments).
PARTS = ("params", "grads", "optimizer")


@dataclass
class MicroBatch:
    packed: PackedInput
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        """Real tokens (without the sequence-parallel pad)."""
        return self.packed.num_tokens - self.packed.num_pad

    def to(self, device, non_blocking: bool = False) -> "MicroBatch":
        """On `device`. non_blocking to CUDA: the host tensors are pinned first, so the host
        does not wait for the copies, which queue behind the device's work (a pageable copy
        makes the host wait for all of it: the device then idles while the host catches up)."""
        device = torch.device(device)
        async_copy = non_blocking and device.type == "cuda"

        def move(t):
            return t.pin_memory().to(device, non_blocking=True) if async_copy else t.to(device)
        p = self.packed
        packed = PackedInput(move(p.input_ids), move(p.position_ids), move(p.cu_seqlens),
                             p.max_seqlen, p.num_pad, p.host_bounds)
        return MicroBatch(packed, {k: move(v) for k, v in self.tensors.items()})


@dataclass
class OptimConfig:
    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    grad_clip: float | None = 1.0
    warmup_steps: int = 0
    total_steps: int = 0
    schedule: str = "constant"
    min_lr_ratio: float = 0.0
    use_distributed_optimizer: bool = True
    bucket_mb: float = 40.0
    host_step: bool = False         # fp32 master + Adam moments on the host, update on the CPU


class TrainEngine:
    def __init__(self, model_dir, mesh, *, sequence_parallel: bool = True,
                 value_head: bool = False, dtype=torch.float32, device="cpu",
                 optim: OptimConfig | None = None, temperature: float = 1.0,
                 compile_layers: bool = False, recompute: bool = False,
                 lora: LoRAConfig | None = None,
                 router_losses: tuple[float, float] = (0.0, 0.0), cuda_graphs: bool = False,
                 offload: tuple[str, ...] = (), wgrad_fusion: bool = False):
        self.mesh, self.dtype, self.device = mesh, dtype, torch.device(device)
        self.model_dir, self.temperature = model_dir, temperature
        if isinstance(model_dir, ModelConfig):      # benchmarks: random weights, no files
            self.model = Decoder(model_dir, mesh.tp_group, sequence_parallel, mesh.pp_rank,
                                 mesh.pp, value_head, dtype, self.device, mesh.ep_group)
        else:
            self.model = load_decoder(model_dir, mesh, sequence_parallel=sequence_parallel,
                                      value_head=value_head, dtype=dtype, device=self.device)
        self.cfg = self.model.cfg
        self.cfg.check_cp(mesh.tp, mesh.cp, mesh.layout.cp_attention)
        self.lora = lora
        if lora is not None:        # the base frozen: the optimizer holds the adapters only
            add_lora(self.model, lora.rank, lora.alpha, lora.target_modules)
            if lora.adapter_path is not None:
                load_peft_adapter(self.model, lora.adapter_path, lora)
            if self.model.value_head is not None:   # a critic's head trains (PEFT's
                self.model.value_head.requires_grad_(True)     # modules_to_save)
        self.model.recompute_layers = recompute     # activation recomputation in train_step
        # MoE layers' load-balancing and z-loss coefficients (models.moe)
        self.moe_layers = [layer.mlp for layer in self.model.layers
                           if hasattr(layer.mlp, "aux_loss_coef")]
        for moe in self.moe_layers:
            moe.aux_loss_coef, moe.z_loss_coef = router_losses
        if compile_layers and self.device.type == "cuda":
            compile_decoder_layers(self.model)
        self.comm = StageComm(mesh, dtype, self.device) if mesh.pp > 1 else None
        # the two copies of a tied embedding (first and last stage) sum their gradients
        # (every stage; a LoRA model's embedding is frozen: nothing to sum)
        tied = self.cfg.tie_word_embeddings and mesh.pp > 1 and not value_head and lora is None
        self.embedding_group = mesh.embedding_group if tied else None
        self.optimizer = None
        if optim is not None:
            self.optimizer = self._build_optimizer(optim)
        else:
            self.model.requires_grad_(False)
        # Megatron's gradient_accumulation_fusion (parallel.wgrad_accumulation): the linear
        # layers' weight gradients go into the optimizer's fp32 buckets from their GEMM
        self.wgrad_fused = fuse_wgrad_accumulation(self.model) \
            if wgrad_fusion and self.optimizer is not None else 0
        if self.wgrad_fused and self.device.type == "cuda":
            load_wgrad_kernel(dtype)    # the op's C++ CUDA kernel (kernels.wgrad)
        # train.cuda_graphs: the training micro-batches' decoder body replayed from graphs
        # (offload: the PARTS the trainer parks between phases; weights or gradients that move
        # every step would have the graphs captured again every step)
        self.offload, self.graphs, self.graphs_off = tuple(offload), None, None
        if cuda_graphs and self.optimizer is not None:
            # why not, where not (the trainer's start report prints it: rl.training_graphs)
            self.graphs_off = graphs_unsupported(
                self.cfg, tp=mesh.tp, pp=mesh.pp, cp=mesh.cp, dtype=dtype,
                device_type=self.device.type, recompute=recompute, lora=lora is not None,
                offload=offload)
            if self.graphs_off is None:
                self.graphs = BodyGraphs(self.model, self.device)
        self._parking: dict[str, HostParking] = {}

    # --- setup --------------------------------------------------------------------------------
    def _build_optimizer(self, o: OptimConfig) -> DistributedOptimizer:
        tp, tied_copy = self.mesh.tp, self.embedding_group is not None and self.mesh.is_last_stage

        def counted(name, p):
            if name == "lm_head.weight" and tied_copy:
                return False            # the first stage's embedding counts for both copies
            replicated = is_lora_replicated(p) if ".lora." in name else \
                is_tp_replicated(name, self.cfg, tp)
            return self.mesh.tp_rank == 0 or not replicated
        schedule = LRSchedule(o.lr, total_steps=o.total_steps, warmup_steps=o.warmup_steps,
                              warmup_style=o.schedule, min_lr_ratio=o.min_lr_ratio)
        # CP ranks hold replicas of the weights, their gradients partial sums: reduced with DP's;
        # under EP an expert's replicas are its expert-data-parallel group (parallel.layout)
        ep = self.mesh.ep > 1
        return DistributedOptimizer(
            list(self.model.named_parameters()), self.mesh.dp_cp_group, self.mesh.mp_group,
            self.mesh.tp_group, lr=schedule, betas=o.betas, eps=o.eps,
            weight_decay=o.weight_decay, grad_clip=o.grad_clip,
            use_distributed_optimizer=o.use_distributed_optimizer, bucket_mb=o.bucket_mb,
            grad_reduce="sum", count_in_grad_norm=counted, host_step=o.host_step,
            is_expert=(lambda n, p: is_expert_param(n)) if ep else None,
            edp_group=self.mesh.edp_group, ep_group=self.mesh.ep_group)

    # --- host offload -------------------------------------------------------------------------
    def _parts(self, part: str) -> HostParking:
        if part not in self._parking:
            opt = self.optimizer
            if part not in PARTS or (part != "params" and opt is None):
                raise ValueError(f"cannot offload {part!r}: this engine has "
                                 f"{PARTS if opt is not None else PARTS[:1]}")
            tensors = {"params": lambda: self.model.parameters(),
                       "grads": lambda: [b.grad for b in opt.buckets],
                       "optimizer": lambda: [] if opt.host_step else [   # already on host
                           t for b in opt.buckets for t in (b.master, b.exp_avg, b.exp_avg_sq)]
                       }[part]
            self._parking[part] = HostParking(tensors(), keep_values=part != "grads", name=part)
        return self._parking[part]

    def park(self, parts, skip=()) -> float:
        """Move `parts` (of PARTS) to host memory, except storages shared with tensors in `skip`.
        Returns seconds."""
        return sum(self._parts(p).park(skip) for p in parts)

    def unpark(self, parts) -> float:
        """Bring `parts` back to the device. Returns seconds."""
        return sum(self._parts(p).unpark() for p in parts if p in self._parking)

    def parked_bytes(self) -> int:
        """Device bytes of this engine parked in host memory (or freed) now."""
        return sum(p.parked_bytes for p in self._parking.values())

    def host_bytes(self) -> int:
        """Host bytes this engine's parking holds (freed gradients hold none)."""
        return sum(p.host_bytes for p in self._parking.values())

    def require(self, *parts: str) -> None:
        """Raise instead of touching a parked part (its storage holds no bytes)."""
        parked = [p for p in parts if p in self._parking and self._parking[p].parked]
        if parked:
            raise RuntimeError(f"{', '.join(parked)} of this engine are offloaded to host memory;"
                               f" unpark() them before this phase")

    # --- one stage's forward ------------------------------------------------------------------
    def _cp_views(self, mbs: list[MicroBatch]) -> list[CPView | None]:
        """Each micro-batch's share of this CP rank (None without context parallelism)."""
        if self.mesh.cp == 1:
            return [None] * len(mbs)
        return [split_for_cp(mb.packed, self.mesh, self._sp_size) for mb in mbs]

    @property
    def _sp_size(self) -> int:
        """The ranks a sequence-parallel activation is split over (1: replicated)."""
        return self.mesh.tp if self.model.sp else 1

    def _activation_shape(self, mbs, views):
        def shape(i):
            packed = mbs[i].packed if views[i] is None else views[i].packed
            return torch.Size((packed.num_tokens // self._sp_size, self.cfg.hidden_size))
        return shape

    def _stage_outputs(self, mb: MicroBatch, hidden_in, view: CPView | None = None):
        """Run this stage; on the last stage return the per-token outputs of the real tokens
        (under CP: of the whole micro-batch, gathered over the CP group)."""
        if view is not None:
            hidden = self.model(view.packed, hidden_in, attn_ctx=view.attention)
            finish = view.gather
        else:
            graphed = self.graphs is not None and torch.is_grad_enabled() and self.model.training
            hidden = self.graphs(mb.packed) if graphed else self.model(mb.packed, hidden_in)
            finish = mb.packed.strip
        if not self.mesh.is_last_stage:
            return hidden
        if self.model.value_head is not None:
            return {"values": finish(self.model.values(hidden))}
        targets = view.take(mb.tensors["targets"]) if view is not None else \
            torch.nn.functional.pad(mb.tensors["targets"], (0, mb.packed.num_pad))
        # a micro-batch may name the positions it reads ("logprob_rows": RL's responses); the
        # head runs on those only (under CP every local position: the split permutes them)
        rows = mb.tensors.get("logprob_rows") if view is None else None
        logp, ent = self.model.logprob_entropy(hidden, targets, self.temperature, rows)
        return {"logprob": finish(logp), "entropy": finish(ent)}

    # --- public -------------------------------------------------------------------------------
    def train_step(self, microbatches: list[MicroBatch], loss_fn, before_step=None,
                   metrics_on_device: bool = False) -> dict:
        """One optimizer step (train_steps run alone)."""
        return run_to_end(self.train_steps(microbatches, loss_fn, before_step, metrics_on_device))

    def train_steps(self, microbatches: list[MicroBatch], loss_fn, before_step=None,
                    metrics_on_device: bool = False):
        """A unit of parallel.interleave, yielding between micro-batches (train_1f1b_steps).
        Forward/backward over all micro-batches (1F1B), gradient sync, one optimizer step.
        Returns loss_fn's metrics averaged over micro-batches and DP ranks (on every rank), plus
        grad_norm, lr and whether the update was applied.

        before_step(): host work (the next mini-batch's packing) run once the backward is queued
        and before the optimizer step, whose gradient norm (read on the host without
        metrics_on_device) makes the host wait for the device:
        done here it overlaps the device's backward instead of leaving the device idle after
        the step. metrics_on_device: loss_fn's metrics, grad_norm and stepped as 0-d device
        tensors (the caller reads them once for all its steps) instead of floats (a host sync
        per step), the optimizer's non-finite guard decided on the device."""
        self.require(*PARTS)
        opt = self.optimizer
        opt.zero_grad()
        if self.graphs is not None:
            self.graphs.begin_step([b.grad for b in opt.buckets],
                                   [mb.packed for mb in microbatches])
        metrics: list[dict] = []
        self.model.train()
        views = self._cp_views(microbatches)
        for moe in self.moe_layers:         # the router losses: a mean over micro-batches and
            moe.loss_scale.fill_(1.0 / (len(microbatches) * self.mesh.dp * self.mesh.cp))
            moe.loss_sums.zero_()           # replicas, as the gradients are summed over both

        def forward_step(i, x):
            with record_function("train.forward"):
                out = self._stage_outputs(microbatches[i], x, views[i])
            if not self.mesh.is_last_stage:
                return out
            with record_function("train.loss"):
                loss, m = loss_fn(out, microbatches[i])
            # Kept as device tensors: a float() here would make the host wait for every
            # micro-batch's forward, and the GPU idle while the host then queues the backward.
            metrics.append({k: v.detach() if isinstance(v, torch.Tensor) else v
                            for k, v in m.items()})
            return loss
        yield from train_1f1b_steps(forward_step, len(microbatches),
                                    self._activation_shape(microbatches, views), self.comm)
        if before_step is not None:
            with record_function("train.before_step"):
                before_step()
        with record_function("train.grad_sync"):
            self._sync_tied_embedding_grads()
            opt.finish_grad_sync()
        lr = opt.current_lr
        with record_function("train.optimizer"):
            # the LR schedule advances per trainer step (caller); with metrics_on_device the
            # update is decided on the device too: no host wait between optimizer steps
            grad_norm, stepped = opt.step(on_device=metrics_on_device)
        with record_function("train.metrics"):
            out = self._share_metrics(metrics, on_device=metrics_on_device)
        out.update(grad_norm=grad_norm, lr=lr,
                   stepped=stepped if isinstance(stepped, torch.Tensor) else float(stepped),
                   **self._router_metrics())
        return out

    def _router_metrics(self) -> dict:
        """moe/load_balancing_loss and moe/z_loss: means over the step's MoE layers, micro-batches
        and replicas (every rank of TP computes the same); none without router losses."""
        if not any(m.aux_loss_coef or m.z_loss_coef for m in self.moe_layers):
            return {}
        sums = torch.stack([m.loss_sums for m in self.moe_layers]).sum(0)
        for group, size in ((self.mesh.pp_group, self.mesh.pp), (self.mesh.dp_cp_group,
                                                                 self.mesh.dp * self.mesh.cp)):
            if size > 1:
                dist.all_reduce(sums, group=group)
        balance, z, n = sums.tolist()
        return {"moe/load_balancing_loss": balance / n, "moe/z_loss": z / n}

    def _sync_tied_embedding_grads(self):
        if self.embedding_group is None:
            return
        p = self.model.embed_tokens.weight if self.mesh.is_first_stage \
            else self.model.lm_head.weight
        dist.all_reduce(p.main_grad, group=self.embedding_group)

    def _share_metrics(self, metrics: list[dict], on_device: bool = False) -> dict:
        """Mean over micro-batches and DP ranks of the last stage's metrics, on every rank (CP
        ranks computed the same ones): floats, or with on_device 0-d float64 device tensors."""
        keys = sorted(metrics[0]) if metrics else []
        if self.mesh.pp > 1:
            obj = [keys]
            dist.broadcast_object_list(obj, src=self.mesh.pp_ranks[-1], group=self.mesh.pp_group)
            keys = obj[0]
        vals = torch.stack([_mean([m[k] for m in metrics], self.device) for k in keys]) \
            if metrics and keys else torch.zeros(len(keys), dtype=torch.float64, device=self.device)
        if self.mesh.pp > 1:
            dist.broadcast(vals, src=self.mesh.pp_ranks[-1], group=self.mesh.pp_group)
        if self.mesh.dp > 1:
            dist.all_reduce(vals, group=self.mesh.dp_group)
            vals /= self.mesh.dp
        return dict(zip(keys, vals.unbind() if on_device else vals.tolist()))

    @torch.no_grad()
    def forward_only(self, microbatches: list[MicroBatch]) -> list[dict[str, torch.Tensor]]:
        """Per-token outputs of every micro-batch, on every rank of the replica."""
        self.require("params")
        self.model.eval()
        views = self._cp_views(microbatches)
        outs = forward_only(lambda i, x: self._stage_outputs(microbatches[i], x, views[i]),
                            len(microbatches), self._activation_shape(microbatches, views),
                            self.comm)
        keys = ["values"] if self.model.value_head is not None else ["logprob", "entropy"]
        sizes = [mb.num_tokens for mb in microbatches]
        result = [dict() for _ in microbatches]
        for k in keys:
            flat = broadcast_from_last_stage([o[k] for o in outs], sizes, self.mesh,
                                             device=self.device)
            for r, t in zip(result, flat):
                r[k] = t
        return result

    def save_hf(self, out_dir, dtype=None) -> None:
        """The role's weights as an HF directory (collective over the mesh). LoRA: a PEFT adapter
        directory (models.lora.save_peft_adapter) and, with save_merged, the merged model as a
        full HF directory in its merged/ folder."""
        self.require("params")
        if self.lora is None or self.model.value_head is not None:   # a critic: merged
            save_hf(self.model, out_dir, self.mesh, src_dir=self.model_dir, dtype=dtype)
            return
        save_peft_adapter(self.model, out_dir, self.lora, str(self.model_dir), self.mesh, dtype)
        if self.lora.save_merged:
            save_hf(self.model, Path(out_dir) / "merged", self.mesh, src_dir=self.model_dir,
                    dtype=dtype)


def _mean(values: list, device) -> torch.Tensor:
    """float64 mean of per-micro-batch metric values (0-d tensors or numbers) on `device`."""
    if all(isinstance(v, torch.Tensor) for v in values):
        return torch.stack([v.reshape(()).to(device, torch.float64) for v in values]).mean()
    return torch.tensor(sum(float(v) for v in values) / len(values), dtype=torch.float64,
                        device=device)
