"""The generation Decoder: a skeleton built once, whose weights each switch points at storage.

The skeleton is a Decoder on the generation-TP group (pp = 1, no sequence parallelism) created on
the meta device, so building it allocates nothing; buffers (RoPE tables) are copied from the
training model. Its vocabulary layers follow the reshard plan's partition (hybrid.plan module
doc): the rows per rank come from the plan and differ from ⌈V/t_g⌉ only when the training tp
does not divide V. Logit widths must therefore be read from the weights (`head_weight`), never
recomputed from padded_vocab_size(V, t_g).
"""
from __future__ import annotations

import torch
from torch import nn

from hybridengine.models.decoder import Decoder, ModelConfig
from hybridengine.models.hf import VOCAB_PARAMS
from hybridengine.models.moe import stack_views, stacked_name
from hybridengine.parallel.mesh import GenMesh


def build_gen_decoder(cfg: ModelConfig, gen_mesh: GenMesh, shapes: dict[str, tuple[int, ...]],
                      like: Decoder) -> Decoder:
    """The skeleton for generation shard gen_mesh.gen_tp_rank; `shapes` are the plan's."""
    model = Decoder(cfg, gen_mesh.gen_tp_group, sequence_parallel=False, device="meta")
    for name, _ in list(model.named_buffers()):
        mod, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(mod), leaf, like.get_buffer(name).detach().clone())
    for name in VOCAB_PARAMS:
        mod_name = name.rsplit(".", 1)[0]
        if hasattr(model, mod_name):
            emb, rows = getattr(model, mod_name), shapes[name][0]
            emb.per_partition, emb.padded_vocab = rows, rows * gen_mesh.gen_tp
            emb.v_start = gen_mesh.gen_tp_rank * rows
            emb.weight = nn.Parameter(torch.empty(shapes[name], device="meta"))
    model.requires_grad_(False)
    return model.eval()


def _set_param(model: nn.Module, name: str, t: torch.Tensor) -> None:
    mod, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(mod), leaf, nn.Parameter(t, requires_grad=False))


def assign_weights(model: Decoder, tensors: dict[str, torch.Tensor]) -> None:
    """Point every parameter of the skeleton at its tensor (no copy; shapes checked). Experts
    come one by one (the plan's per-expert names): a stacked parameter becomes the one view of
    its experts' tensors, which the reshard places back to back (hybrid.program)."""
    tensors = _stacked(tensors)
    params = dict(model.named_parameters())
    if set(params) != set(tensors):
        raise RuntimeError(f"generation shard {sorted(set(tensors) ^ set(params))[:3]} does not "
                           f"match the generation Decoder")
    for name, t in tensors.items():
        if t.shape != params[name].shape:
            raise RuntimeError(f"generation weight {name} {tuple(t.shape)} != "
                               f"{tuple(params[name].shape)}")
        _set_param(model, name, t)


def _stacked(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out, experts = {}, {}
    for name, t in tensors.items():
        key = stacked_name(name)
        if key is None:
            out[name] = t
        else:
            experts.setdefault(key[0], {})[key[1]] = t
    for name, views in experts.items():
        ids = sorted(views)
        out[name] = stack_views([views[e] for e in ids]) if ids == list(range(len(ids))) \
            else None
        if out[name] is None:
            raise RuntimeError(f"the generation experts of {name} are not one stack in memory")
    return out


def release_weights(model: Decoder, names=None) -> None:
    """Point every parameter (or those named) at an empty meta tensor: the storage is freed,
    use fails loudly."""
    wanted = None if names is None else set(names)
    for name, p in list(model.named_parameters()):
        if wanted is None or name in wanted:
            _set_param(model, name, torch.empty(p.shape, dtype=p.dtype, device="meta"))
