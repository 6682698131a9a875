"""LoRA on the decoder (parallel.lora): which HF modules an adapter may target, where each sits
in the fused tensor-parallel layers, and the adapters' HF (PEFT) names.

    add_lora(model, rank=8, alpha=16, target_modules="all-linear")

freezes the base (no gradients: the optimizer then holds the adapters only) and attaches the
adapters; `lora_state_dict(model)` names this rank's adapter tensors as PEFT does
(`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`).
"""
from __future__ import annotations

from dataclasses import dataclass

from hybridengine.parallel.lora import LoRA, LoRATarget, merged_weight

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
LINEAR_MODULES = ATTENTION + MLP


@dataclass(frozen=True)
class LoRAConfig:
    """A role's adapters: rank, alpha (scaling alpha / rank), the targeted HF modules."""
    rank: int
    alpha: float
    target_modules: tuple[str, ...] = ("all-linear",)


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


def base_weights(model):
    """(name, tensor) of the model's base parameters, each adapted weight merged (W + s·B·A, a
    new tensor: W itself never changes) and the adapter tensors left out: what the rollout's
    generation weights and an HF export read. Without adapters: named_parameters() itself."""
    adapted = {f"{name}.weight": m for name, m in model.named_modules()
               if getattr(m, "lora", None) is not None}
    for name, p in model.named_parameters():
        if ".lora." in name:
            continue
        yield name, (merged_weight(adapted[name]).detach() if name in adapted else p)


def is_lora_replicated(param) -> bool:
    """An adapter matrix every TP rank holds whole (parallel.lora marks them)."""
    return bool(getattr(param, "sequence_parallel", False))
