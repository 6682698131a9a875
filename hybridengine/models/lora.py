"""LoRA on the decoder (parallel.lora): which HF modules an adapter may target, where each sits
in the fused tensor-parallel layers, the adapters' HF (PEFT) names, and the PEFT adapter
directory a checkpoint holds (save_peft_adapter: `peft.PeftModel.from_pretrained(base, dir)`).

    add_lora(model, rank=8, alpha=16, target_modules="all-linear")

freezes the base (no gradients: the optimizer then holds the adapters only) and attaches the
adapters; `lora_state_dict(model)` names this rank's adapter tensors as PEFT does
(`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`).
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from hybridengine.parallel.lora import LoRA, LoRATarget, merged_weight
from hybridengine.parallel.tensor import all_gather_dim0, group_rank, group_size

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
LINEAR_MODULES = ATTENTION + MLP
# the fused Decoder layer that holds each HF module's rows or columns (add_lora's slots)
FUSED_LAYER = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
               "o_proj": "o_proj", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
               "down_proj": "down_proj"}


@dataclass(frozen=True)
class LoRAConfig:
    """A role's adapters: rank, alpha (scaling alpha / rank), the targeted HF modules."""
    rank: int
    alpha: float
    target_modules: tuple[str, ...] = ("all-linear",)
    save_merged: bool = True        # checkpoints: also W + s·B·A as a full HF dir, merged/
    adapter_path: str | None = None     # start from this PEFT adapter (load_peft_adapter)

    @classmethod
    def of_model(cls, model) -> LoRAConfig | None:
        """A role's adapters from its model section (verl's keys), None without (lora_rank 0)."""
        if model.lora_rank <= 0:
            return None
        return cls(model.lora_rank, model.lora_alpha, tuple(model.target_modules),
                   model.lora_save_merged, model.lora_adapter_path)


def resolve_targets(target_modules) -> tuple[str, ...]:
    """verl's target_modules: "all-linear" or a list of HF module names."""
    names = (target_modules,) if isinstance(target_modules, str) else tuple(target_modules)
    if names == ("all-linear",):
        return LINEAR_MODULES
    bad = [n for n in names if n not in LINEAR_MODULES]
    if bad or not names:
        raise ValueError(f"target_modules={list(names)}: each one of "
                         f"{', '.join(LINEAR_MODULES)}, or all-linear")
    return names


def add_lora(model, rank: int, alpha: float, target_modules="all-linear",
             seed: int = 0) -> None:
    """Freeze `model` (a models.decoder.Decoder stage) and attach LoRA adapters of `rank`,
    scaling alpha / rank, to the targeted modules of each of its layers. Adapters are seeded
    by global layer index, so every layout (tp, pp) holds the same ones."""
    if rank <= 0:
        raise ValueError(f"lora_rank={rank}: a positive rank")
    if model.cfg.num_experts:
        raise ValueError(f"lora_rank={rank}: LoRA adapters are not supported for "
                         f"mixture-of-experts models (model_type={model.cfg.model_type!r})")
    targets = set(resolve_targets(target_modules))
    model.requires_grad_(False)
    for layer in model.layers:
        idx, attn, mlp = layer.self_attn.layer_idx, layer.self_attn, layer.mlp
        q, kv = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        ffn = mlp.ffn_per_rank
        fused = [(attn.qkv_proj, "column", [("q_proj", 0, q), ("k_proj", q, kv),
                                            ("v_proj", q + kv, kv)]),
                 (attn.o_proj, "row", [("o_proj", 0, 0)]),
                 (mlp.gate_up_proj, "column", [("gate_proj", 0, ffn), ("up_proj", ffn, ffn)]),
                 (mlp.down_proj, "row", [("down_proj", 0, 0)])]
        for slot, (linear, kind, parts) in enumerate(fused):
            chosen = [LoRATarget(n, off, rows) for n, off, rows in parts if n in targets]
            if not chosen:
                continue
            out = linear.weight.shape[0]
            linear.lora = LoRA(kind, chosen, linear.weight.shape[1], out, rank, alpha,
                               linear.group, seed=(seed * 1_000_003 + idx) * 8 + slot,
                               dtype=linear.weight.dtype, device=linear.weight.device)


def lora_state_dict(model) -> dict[str, object]:
    """This rank's adapter tensors under PEFT's names (shards, as the rank holds them)."""
    out = {}
    for layer in model.layers:
        idx = layer.self_attn.layer_idx
        for owner, linear in (("self_attn", layer.self_attn.qkv_proj),
                              ("self_attn", layer.self_attn.o_proj),
                              ("mlp", layer.mlp.gate_up_proj), ("mlp", layer.mlp.down_proj)):
            lora: LoRA | None = linear.lora
            if lora is None:
                continue
            for t in lora.targets:
                prefix = f"base_model.model.model.layers.{idx}.{owner}.{t.name}"
                out[f"{prefix}.lora_A.weight"] = lora.A[t.name]
                out[f"{prefix}.lora_B.weight"] = lora.B[t.name]
    return out


def adapted_layers(model) -> dict:
    """{Decoder weight name: its linear layer} for every layer that carries adapters."""
    return {f"{name}.weight": m for name, m in model.named_modules()
            if getattr(m, "lora", None) is not None}


def base_weights(model):
    """(name, tensor) of the model's base parameters, each adapted weight merged (W + s·B·A, a
    new tensor: W itself never changes) and the adapter tensors left out: what the rollout's
    generation weights and an HF export read. Without adapters: named_parameters() itself."""
    adapted = adapted_layers(model)
    for name, p in model.named_parameters():
        if ".lora." in name:
            continue
        yield name, (merged_weight(adapted[name]).detach() if name in adapted else p)


def is_lora_replicated(param) -> bool:
    """An adapter matrix every TP rank holds whole (parallel.lora marks them)."""
    return bool(getattr(param, "sequence_parallel", False))


def _shard_dim(name: str) -> int | None:
    """The dimension along which TP ranks split the adapter matrix `name` (a lora_state_dict
    key), None when every rank holds it whole (parallel.lora: B of a column layer is split by
    rows, A of a row layer by columns)."""
    row_layer = name.split(".")[-3] in ("o_proj", "down_proj")
    if ".lora_B." in name and not row_layer:
        return 0
    if ".lora_A." in name and row_layer:
        return 1
    return None


def _full(name: str, t: torch.Tensor, tp_group) -> torch.Tensor:
    """The whole adapter matrix from this rank's part."""
    t, dim = t.detach(), _shard_dim(name)
    if dim is None:
        return t
    return all_gather_dim0(t.transpose(0, dim).contiguous(), tp_group).transpose(0, dim)


def save_peft_adapter(model, out_dir: str | os.PathLike, lora: LoRAConfig,
                      base_model: str | None, mesh=None, dtype: torch.dtype | None = None) -> None:
    """Write a PEFT LoRA adapter directory (adapter_config.json, adapter_model.safetensors with
    PEFT's names, whole matrices) from any (tp, pp, dp) layout; collective over the mesh's world
    (None: one process). Each stage's first rank writes its layers' part; global rank 0 joins
    the parts into one file and renames the temp directory onto out_dir."""
    out = Path(out_dir)
    tmp = out.parent / f".{out.name}.tmp"
    rank, world = (mesh.rank, mesh.world_group) if mesh else (0, None)
    pp, pp_rank = (mesh.pp, mesh.pp_rank) if mesh else (1, 0)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    if world is not None:
        dist.barrier(group=world)
    tensors = {n: _full(n, p, model.tp_group).to(dtype or p.dtype).contiguous().cpu()
               for n, p in lora_state_dict(model).items()}
    if mesh is None or (mesh.tp_rank == 0 and mesh.dp_rank == 0 and mesh.cp_rank == 0):
        save_file(tensors, str(tmp / f"part-{pp_rank}.safetensors"))
    if world is not None:
        dist.barrier(group=world)
    if rank == 0:
        joined = {}
        for s in range(pp):
            joined.update(load_file(str(tmp / f"part-{s}.safetensors")))
            (tmp / f"part-{s}.safetensors").unlink()
        save_file(joined, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        targets = list(resolve_targets(list(lora.target_modules)))
        (tmp / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank,
            "lora_alpha": lora.alpha, "target_modules": targets, "lora_dropout": 0.0,
            "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
            "init_lora_weights": True, "use_rslora": False, "use_dora": False,
            "modules_to_save": None, "base_model_name_or_path": base_model}, indent=2) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    if world is not None:
        dist.barrier(group=world)


def load_peft_adapter(model, adapter_dir: str | os.PathLike, lora: LoRAConfig) -> None:
    """Set the model's adapters (add_lora first) from a PEFT LoRA directory, each rank taking
    its part of the whole matrices. Its rank, alpha and targets must be the run's (one-line
    ValueError naming both otherwise)."""
    d = Path(adapter_dir)
    try:
        config = json.loads((d / "adapter_config.json").read_text())
        tensors = load_file(str(d / "adapter_model.safetensors"))
    except (OSError, ValueError) as e:
        raise ValueError(f"lora_adapter_path={d}: not a PEFT LoRA directory "
                         f"(adapter_config.json, adapter_model.safetensors): {e}") from None
    theirs = (config.get("r"), float(config.get("lora_alpha", 0)),
              sorted(resolve_targets(config.get("target_modules") or [])))
    ours = (lora.rank, float(lora.alpha), sorted(resolve_targets(list(lora.target_modules))))
    if theirs != ours:
        raise ValueError(f"lora_adapter_path={d}: its r, lora_alpha, target_modules {theirs} "
                         f"differ from the run's {ours}")
    tp, rank = group_size(model.tp_group), group_rank(model.tp_group)
    with torch.no_grad():
        for name, p in lora_state_dict(model).items():
            if name not in tensors:
                raise ValueError(f"lora_adapter_path={d}: no tensor {name}")
            full, dim = tensors[name], _shard_dim(name)
            if dim is not None:
                full = full.chunk(tp, dim=dim)[rank]
            if full.shape != p.shape:
                raise ValueError(f"lora_adapter_path={d}: {name} is {tuple(full.shape)}, this "
                                 f"model's {tuple(p.shape)}")
            p.copy_(full)
