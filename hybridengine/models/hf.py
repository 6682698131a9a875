"""Hugging Face checkpoints <-> sharded Decoder parameters.

`param_plan` states, for one parameter of one (tp_rank, pipeline stage) shard, which slices of
which HF tensors it is made of. Loading reads exactly those slices from the safetensors files
(safetensors' get_slice: a rank never reads the full tensor). Saving runs the plan backwards: each
pipeline stage gathers its TP shards and its first DP/TP rank writes that stage's tensors into one
safetensors file of a sharded HF checkpoint; rank 0 adds config, index and tokenizer files and
renames the temp directory into place, so a crash never leaves a half-written checkpoint.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from hybridengine.models.lora import base_weights
from hybridengine.models.decoder import Decoder, ModelConfig
# the config side (one module of its own; these names stay importable from here)
from hybridengine.models.hf_config import SUPPORTED, check_model_dir, hf_config_dict, \
    read_model_config
from hybridengine.models.moe import expert_view_name, expert_views, is_expert_param
from hybridengine.parallel.tensor import all_gather_dim0, group_rank, group_size, \
    padded_vocab_size

__all__ = ["SUPPORTED", "check_model_dir", "read_model_config", "param_plan", "load_hf_weights",
           "save_hf", "load_decoder", "is_tp_replicated", "first_expert", "SafetensorsDir",
           "Piece"]
VOCAB_PARAMS = ("embed_tokens.weight", "lm_head.weight")   # vocab-parallel rows (tp-padded)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "merges.txt", "special_tokens_map.json", "added_tokens.json",
                   "generation_config.json", "chat_template.jinja")


@dataclass(frozen=True)
class Piece:
    """Slice [start, stop) on `hf_dim` of HF tensor `name`; pieces concatenate on `local_dim`."""

    name: str
    hf_dim: int
    start: int
    stop: int
    local_dim: int = 0


_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


def param_plan(local_name: str, cfg: ModelConfig, tp: int, tp_rank: int,
               layer_start: int = 0) -> list[Piece]:
    """The HF slices that make up parameter `local_name` of a Decoder shard."""
    h, d = cfg.hidden_size, cfg.head_dim
    if local_name in ("embed_tokens.weight", "lm_head.weight"):
        rows = padded_vocab_size(cfg.vocab_size, tp) // tp  # rows per rank of the tp-padded vocabulary
        start = tp_rank * rows
        src = "lm_head.weight" if (local_name == "lm_head.weight"
                                   and not cfg.tie_word_embeddings) else "model.embed_tokens.weight"
        stop = min(start + rows, cfg.vocab_size)
        return [Piece(src, 0, start, stop)] if stop > start else []
    if local_name == "norm.weight":
        return [Piece("model.norm.weight", 0, 0, h)]
    if local_name in ("value_head.weight", "value_head.bias"):
        return [Piece("score." + local_name.rsplit(".", 1)[1], 0, 0, 1)]
    m = _LAYER.fullmatch(local_name)
    if not m:
        raise KeyError(f"no HF mapping for parameter {local_name!r}")
    prefix, rest = f"model.layers.{int(m.group(1)) + layer_start}.", m.group(2)
    q, kv, ffn = cfg.num_heads * d // tp, cfg.num_kv_heads * d // tp, cfg.intermediate_size // tp
    if rest.startswith("self_attn.qkv_proj."):
        kind = rest.rsplit(".", 1)[1]
        return [Piece(f"{prefix}self_attn.{p}_proj.{kind}", 0, tp_rank * n, (tp_rank + 1) * n)
                for p, n in (("q", q), ("k", kv), ("v", kv))]
    if rest == "self_attn.o_proj.weight":
        return [Piece(prefix + "self_attn.o_proj.weight", 1, tp_rank * q, (tp_rank + 1) * q, 1)]
    if rest.startswith("mlp.gate.") or rest.startswith("mlp.experts."):
        return _expert_plan(prefix, rest, cfg, tp, tp_rank)
    if rest == "mlp.gate_up_proj.weight":
        return [Piece(f"{prefix}mlp.{p}_proj.weight", 0, tp_rank * ffn, (tp_rank + 1) * ffn)
                for p in ("gate", "up")]
    if rest == "mlp.down_proj.weight":
        return [Piece(prefix + "mlp.down_proj.weight", 1, tp_rank * ffn, (tp_rank + 1) * ffn, 1)]
    if rest in ("input_layernorm.weight", "post_attention_layernorm.weight",
                "pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"):
        return [Piece(prefix + rest, 0, 0, h)]
    if rest in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
        return [Piece(prefix + rest, 0, 0, d)]     # one [head_dim] weight for every head
    raise KeyError(f"no HF mapping for parameter {local_name!r}")


_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_up_proj|down_proj)\.weight")
# Mixtral's block_sparse_moe names: w1 gate, w3 up, w2 down
_MOE_NAMES = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2")}


def _expert_plan(prefix: str, rest: str, cfg: ModelConfig, tp: int, tp_rank: int) -> list[Piece]:
    """The router (whole on every rank) and each expert's SwiGLU, split over TP as the dense
    MLP is (models.moe)."""
    block, gate, up, down = _MOE_NAMES.get(cfg.model_type, ("mlp", "gate_proj", "up_proj",
                                                            "down_proj"))
    if rest == "mlp.gate.weight":
        return [Piece(f"{prefix}{block}.gate.weight", 0, 0, cfg.num_experts)]
    m = _EXPERT.fullmatch(rest)
    if not m:
        raise KeyError(f"no HF mapping for parameter {prefix}{rest!r}")
    at, ffn = f"{prefix}{block}.experts.{m.group(1)}.", cfg.moe_intermediate_size // tp
    if m.group(2) == "gate_up_proj":
        return [Piece(f"{at}{p}.weight", 0, tp_rank * ffn, (tp_rank + 1) * ffn)
                for p in (gate, up)]
    return [Piece(f"{at}{down}.weight", 1, tp_rank * ffn, (tp_rank + 1) * ffn, 1)]


def is_tp_replicated(local_name: str, cfg: ModelConfig, tp: int) -> bool:
    """True for parameters every TP rank holds whole (norms, value head); a stacked experts
    parameter is split as each of its experts is."""
    if is_expert_param(local_name):
        local_name = expert_view_name(local_name, 0)
    return tp == 1 or param_plan(local_name, cfg, tp, 0) == param_plan(local_name, cfg, tp, 1)


class SafetensorsDir:
    """Read-only view of the tensors of an HF directory (single file or sharded with an index)."""

    def __init__(self, model_dir: str | os.PathLike):
        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                self.where = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as e:
                raise ValueError(f"corrupt index file {index}: {e}") from e
        else:
            files = sorted(self.dir.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"model directory {self.dir} has no *.safetensors files")
            self.where = {}
            for f in files:
                for k in self._open(f.name).keys():
                    self.where[k] = f.name
        self._handles: dict[str, object] = {}

    def _open(self, fname: str):
        path = self.dir / fname
        if not path.is_file():
            raise FileNotFoundError(f"safetensors file {path} (named in the index) is missing")
        try:
            return safe_open(str(path), framework="pt")
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise ValueError(f"corrupt safetensors file {path}: {e}") from e

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def read(self, piece: Piece) -> torch.Tensor:
        if piece.name not in self.where:
            raise KeyError(f"checkpoint {self.dir} lacks tensor {piece.name!r}")
        fname = self.where[piece.name]
        if fname not in self._handles:
            self._handles[fname] = self._open(fname)
        sl = self._handles[fname].get_slice(piece.name)
        idx = [slice(None)] * len(sl.get_shape())
        idx[piece.hf_dim] = slice(piece.start, piece.stop)
        return sl[tuple(idx)]


def first_expert(model: Decoder) -> int:
    """Global id of this EP rank's first expert (models.moe: E/ep consecutive experts)."""
    ep = group_size(model.ep_group)
    return group_rank(model.ep_group) * (model.cfg.num_experts // ep) if ep > 1 else 0


def load_hf_weights(model: Decoder, model_dir: str | os.PathLike, tp_rank: int = 0) -> None:
    """Fill every parameter of `model` (one TP/PP shard) from an HF directory, checking shapes
    (stacked experts through their per-expert views, models.moe)."""
    st = SafetensorsDir(model_dir)
    tp = group_size(model.tp_group)
    with torch.no_grad():
        for name, param in expert_views(model.named_parameters(), first_expert(model)):
            if name.startswith("value_head.") and "score.weight" not in st:
                param.zero_()  # a critic starting from a language model: a fresh value head
                continue
            pieces = param_plan(name, model.cfg, tp, tp_rank, model.layer_start)
            parts = [st.read(p) for p in pieces]
            _check_piece_shapes(name, param, pieces, parts, model_dir)
            local_dim = pieces[0].local_dim if pieces else 0
            full = torch.cat(parts, dim=local_dim) if parts else param.new_zeros((0,))
            param.zero_()
            target = param.narrow(local_dim, 0, full.shape[local_dim]) if parts else None
            if target is not None:
                target.copy_(full)


def _check_piece_shapes(name, param, pieces, parts, model_dir):
    local_dim = pieces[0].local_dim if pieces else 0
    got = sum(t.shape[local_dim] for t in parts)
    other = [s for i, s in enumerate(param.shape) if i != local_dim]
    for p, t in zip(pieces, parts):
        t_other = [s for i, s in enumerate(t.shape) if i != local_dim]
        if t.shape[p.hf_dim] != p.stop - p.start or t_other != other:
            raise ValueError(f"tensor {p.name!r} in {model_dir} has shape {tuple(t.shape)}, which "
                             f"does not fit parameter {name} {tuple(param.shape)}")
    if got > param.shape[local_dim]:
        raise ValueError(f"checkpoint {model_dir} gives {got} rows for {name}, expected "
                         f"<= {param.shape[local_dim]}")


def _gather_full(model: Decoder, name: str, param: torch.Tensor) -> dict[str, torch.Tensor]:
    """All-gather a parameter over TP and reassemble the HF tensors it is made of (stacked
    experts: this EP rank's, one by one)."""
    if is_expert_param(name):
        return {k: t for n, view in expert_views([(name, param)], first_expert(model))
                for k, t in _gather_full(model, n, view).items()}
    tp = group_size(model.tp_group)
    if tp > 1 and is_tp_replicated(name, model.cfg, tp):
        tp = 1                      # norms, value head: every rank holds the whole tensor
    shards = [param.detach()]
    if tp > 1:
        local_dim = param_plan(name, model.cfg, tp, 0, model.layer_start)[0].local_dim
        moved = param.detach().transpose(0, local_dim).contiguous()
        gathered = all_gather_dim0(moved, model.tp_group)
        shards = [s.transpose(0, local_dim) for s in gathered.chunk(tp, dim=0)]
    parts: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for r, shard in enumerate(shards):
        offset = 0
        for p in param_plan(name, model.cfg, tp, r, model.layer_start):
            n = p.stop - p.start
            parts.setdefault(p.name, []).append((p.hf_dim, shard.narrow(p.local_dim, offset, n)))
            offset += n
    return {k: torch.cat([t for _, t in v], dim=v[0][0]) for k, v in parts.items()}


def _gather_experts(model: Decoder, name: str, param: torch.Tensor):
    """[(name, tensor)]: the parameter itself, or for stacked experts one view per expert of
    every EP rank (the stacked parameters of the EP group, rank-major = global expert order,
    in one all-gather)."""
    if not is_expert_param(name):
        return [(name, param.detach())]
    every = all_gather_dim0(param.detach(), model.ep_group) \
        if group_size(model.ep_group) > 1 else param.detach()
    return list(expert_views([(name, every)]))


def save_hf(model: Decoder, out_dir: str | os.PathLike, mesh=None, src_dir=None,
            dtype: torch.dtype | None = None) -> None:
    """Write a complete HF model directory from any (tp, pp, dp, cp, ep) layout (collective
    over the mesh's world group; `mesh` None: one process).

    Pipeline stage s's first rank writes model-0000{s+1}-of-0000{pp}.safetensors; global rank 0
    writes config.json, the index and tokenizer files (copied from `src_dir`), then renames the
    temp directory onto `out_dir`.
    """
    out = Path(out_dir)
    tmp = out.parent / f".{out.name}.tmp"
    pp, pp_rank = (mesh.pp, mesh.pp_rank) if mesh else (1, 0)
    writer = mesh is None or (mesh.tp_rank == 0 and mesh.dp_rank == 0 and mesh.cp_rank == 0)
    rank, world = (mesh.rank, mesh.world_group) if mesh else (0, None)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(world)
    tensors: dict[str, torch.Tensor] = {}
    for name, param in base_weights(model):       # LoRA: the merged weights (models.lora)
        if name == "lm_head.weight" and model.cfg.tie_word_embeddings:
            continue  # the tied copy on the last stage; the first stage writes the embedding
        for full_name, whole in _gather_experts(model, name, param):
            for k, t in _gather_full(model, full_name, whole).items():
                tensors[k] = t.to(dtype or t.dtype).contiguous().cpu()
    fname = f"model-{pp_rank + 1:05d}-of-{pp:05d}.safetensors"
    if writer:
        save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
        (tmp / f"{fname}.keys.json").write_text(json.dumps(sorted(tensors)))
    _barrier(world)
    if rank == 0:
        _finish_dir(model, tmp, out, pp, src_dir, dtype)
    _barrier(world)


def _finish_dir(model: Decoder, tmp: Path, out: Path, pp: int, src_dir, dtype) -> None:
    weight_map, total = {}, 0
    for s in range(pp):
        fname = f"model-{s + 1:05d}-of-{pp:05d}.safetensors"
        keys_file = tmp / f"{fname}.keys.json"
        for k in json.loads(keys_file.read_text()):
            weight_map[k] = fname
        keys_file.unlink()
        total += (tmp / fname).stat().st_size
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    _write_config(model, tmp, src_dir, dtype)
    for f in TOKENIZER_FILES:
        if src_dir and (Path(src_dir) / f).is_file():
            shutil.copy2(Path(src_dir) / f, tmp / f)
    old = out.parent / f".{out.name}.old"
    if out.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def _write_config(model: Decoder, tmp: Path, src_dir, dtype) -> None:
    cfg = model.cfg
    if src_dir and (Path(src_dir) / "config.json").is_file():
        conf = json.loads((Path(src_dir) / "config.json").read_text())
    else:
        conf = hf_config_dict(cfg)
    if model.value_head is not None:
        family = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral",
                  "gemma2": "Gemma2", "gemma3_text": "Gemma3Text"}[cfg.model_type]
        conf.update(architectures=[f"{family}ForTokenClassification"], num_labels=1)
    if dtype is not None:
        conf["dtype"] = str(dtype).removeprefix("torch.")
    (tmp / "config.json").write_text(json.dumps(conf, indent=2))


def _barrier(group) -> None:
    if group is not None:
        dist.barrier(group=group)


def load_decoder(model_dir: str | os.PathLike, mesh=None, sequence_parallel: bool = False,
                 value_head: bool = False, dtype: torch.dtype | None = None,
                 device=None) -> Decoder:
    """Build this rank's Decoder shard for `mesh` (None: one process) and load its HF weights."""
    cfg = read_model_config(model_dir)
    tp_group, tp_rank = (mesh.tp_group, mesh.tp_rank) if mesh else (None, 0)
    pp, pp_rank = (mesh.pp, mesh.pp_rank) if mesh else (1, 0)
    model = Decoder(cfg, tp_group, sequence_parallel, pp_rank, pp, value_head, dtype, device,
                    getattr(mesh, "ep_group", None))
    load_hf_weights(model, model_dir, tp_rank)
    return model
