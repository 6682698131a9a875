"""Hugging Face config.json <-> ModelConfig, per family.

read_model_config parses the config with transformers and keeps what the Decoder models; a switch
it does not model is refused in one line (rather than other logits). hf_config(_dict) writes the
config back from a ModelConfig alone (save_hf without a source directory; the benchmarks' shapes).

Families: llama, qwen2 (q/k/v biases), qwen3 (q/k norms), mistral (Llama with a sliding window
on every layer), gemma2 (models.features: (1 + w) sandwich norms, GeGLU, soft-caps, query scale,
alternating sliding / full layers), gemma3_text (Gemma 2's layout without soft-caps by default,
q/k norms, a RoPE base of its own for sliding layers), qwen3_moe (Qwen3 with routed experts,
models.moe), mixtral (Mistral with routed experts).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from hybridengine.models.attention import SCALED_ROPE_TYPES
from hybridengine.models.decoder import ModelConfig

SUPPORTED = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "qwen3_moe",
             "mixtral")
GEMMA = ("gemma2", "gemma3_text")
LAYER_TYPES = ("sliding_attention", "full_attention")


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def check_model_dir(model_dir: str | os.PathLike) -> Path:
    """`model_dir` as a Path when it is a directory; else one line saying what it is: missing
    (and, when it reads like a Hugging Face hub id, that nothing is downloaded here) or a file."""
    path = Path(model_dir)
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"model path {path} is a file, not a directory: give the directory "
                         f"that holds config.json and the *.safetensors files")
    where = "" if path.is_absolute() else f" (relative to {Path.cwd()})"
    hub = ""
    if _HUB_ID.fullmatch(str(model_dir)):
        hub = (f"; if {model_dir} is a Hugging Face hub id: models are not downloaded here, "
               f"download it first (huggingface-cli download {model_dir} --local-dir DIR) "
               f"and give its local DIR")
    raise FileNotFoundError(f"model directory {path} does not exist{where}{hub}")


def read_model_config(model_dir: str | os.PathLike) -> ModelConfig:
    """ModelConfig from an HF directory's config.json (parsed by transformers)."""
    path = check_model_dir(model_dir)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model directory {path} has no config.json")
    try:
        json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:    # before transformers' vaguer message
        raise ValueError(f"{path / 'config.json'} is not valid JSON: {e}") from None
    from transformers import AutoConfig
    try:
        hf = AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - transformers raises many types; one line for users
        raise ValueError(f"cannot parse {path / 'config.json'}: {str(e).splitlines()[0]}") from e
    if hf.model_type not in SUPPORTED:
        raise ValueError(f"model_type={hf.model_type!r} in {path} is not supported "
                         f"(supported: {', '.join(SUPPORTED)})")
    _check_features(hf, path)
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    local_theta = None
    if hf.model_type == "gemma3_text":          # one rope_parameters per layer type
        local_theta, _ = _rope_config(rope.get("sliding_attention") or {}, hf, path, local=True)
        rope = rope.get("full_attention") or {}
    theta, scaling = _rope_config(rope, hf, path)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    gemma = hf.model_type in GEMMA
    return ModelConfig(
        vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size, num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
        head_dim=head_dim, rms_norm_eps=hf.rms_norm_eps, rope_theta=theta,
        tie_word_embeddings=bool(hf.tie_word_embeddings),
        attention_bias=hf.model_type == "qwen2",       # Qwen2's q/k/v biases, always there
        max_position_embeddings=hf.max_position_embeddings, model_type=hf.model_type,
        qk_norm=hf.model_type in ("qwen3", "gemma3_text", "qwen3_moe"), rope_scaling=scaling,
        **_window_fields(hf, path), **_moe_fields(hf),
        attn_softcap=getattr(hf, "attn_logit_softcapping", None) if gemma else None,
        final_softcap=getattr(hf, "final_logit_softcapping", None) if gemma else None,
        query_pre_attn_scalar=hf.query_pre_attn_scalar if gemma else None,
        hidden_act=(hf.hidden_activation if gemma else getattr(hf, "hidden_act", "silu")),
        rope_local_theta=local_theta)


def _moe_fields(hf) -> dict:
    """ModelConfig's expert fields (models.moe): Qwen3-MoE's names, Mixtral's mapped onto them
    (every layer sparse, experts intermediate_size wide, top-k weights renormalised)."""
    if hf.model_type == "qwen3_moe":
        return dict(num_experts=hf.num_experts, num_experts_per_tok=hf.num_experts_per_tok,
                    moe_intermediate_size=hf.moe_intermediate_size,
                    norm_topk_prob=bool(hf.norm_topk_prob),
                    decoder_sparse_step=hf.decoder_sparse_step,
                    mlp_only_layers=tuple(hf.mlp_only_layers or ()))
    if hf.model_type == "mixtral":
        return dict(num_experts=hf.num_local_experts, num_experts_per_tok=hf.num_experts_per_tok,
                    moe_intermediate_size=hf.intermediate_size)
    return {}


def _window_fields(hf, path: Path) -> dict:
    """sliding_window and layer_types: Mistral slides on every layer (when sliding_window is
    set), Gemma on the layers its layer_types name; Qwen's use_sliding_window is refused."""
    if hf.model_type not in ("mistral", "mixtral", *GEMMA) or \
            getattr(hf, "sliding_window", None) is None:
        return {}
    window = int(hf.sliding_window)
    if window < 1:
        raise ValueError(f"sliding_window={window} in {path} is not supported (>= 1)")
    if hf.model_type in ("mistral", "mixtral"):
        return {"sliding_window": window}
    types = tuple(hf.layer_types)
    if len(types) != hf.num_hidden_layers or set(types) - set(LAYER_TYPES):
        raise ValueError(f"layer_types in {path} must name {hf.num_hidden_layers} layers, each "
                         f"one of {', '.join(LAYER_TYPES)}")
    return {"sliding_window": window, "layer_types": types}


def _check_features(hf, path: Path) -> None:
    """Config switches the Decoder does not model: one line each, rather than other logits."""
    if hf.model_type != "qwen2" and getattr(hf, "attention_bias", False):
        # Llama / Qwen3 put it on o_proj as well, which the Decoder has no bias for
        raise ValueError(f"attention_bias=true in {path} is not supported for "
                         f"model_type={hf.model_type!r}")
    if getattr(hf, "mlp_bias", False):
        raise ValueError(f"mlp_bias=true in {path} is not supported")
    if getattr(hf, "use_sliding_window", False):
        raise ValueError(f"use_sliding_window=true in {path} is not supported")
    if getattr(hf, "router_jitter_noise", 0.0):
        # Mixtral's training-time noise on the router input: sampled logits unlike HF's eval
        raise ValueError(f"router_jitter_noise={hf.router_jitter_noise} in {path} is not "
                         f"supported (0 only)")
    if getattr(hf, "use_bidirectional_attention", False):
        raise ValueError(f"use_bidirectional_attention=true in {path} is not supported")
    act = hf.hidden_activation if hf.model_type in GEMMA else getattr(hf, "hidden_act", "silu")
    expected = "gelu_pytorch_tanh" if hf.model_type in GEMMA else "silu"
    if act != expected:
        raise ValueError(f"hidden activation {act!r} in {path} is not supported for "
                         f"model_type={hf.model_type!r} (only {expected})")


def _rope_config(rope: dict, hf, path: Path,
                 local: bool = False) -> tuple[float, tuple[tuple[str, object], ...]]:
    """(rope_theta, ModelConfig.rope_scaling) from one rope_parameters dict; local (Gemma 3's
    sliding layers): the default RoPE only."""
    rope = dict(rope)
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    theta = float(rope.pop("rope_theta", getattr(hf, "rope_theta", 10000.0)))
    allowed = ("default",) if local else ("default", *SCALED_ROPE_TYPES)
    if rope_type not in allowed:
        where = " for sliding layers" if local else ""
        raise ValueError(f"rope_type={rope_type!r}{where} in {path} is not supported "
                         f"(supported: {', '.join(allowed)})")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor={rope['partial_rotary_factor']} in {path} is "
                         f"not supported (only 1.0)")
    if rope_type == "default":
        return theta, ()
    return theta, tuple(sorted(dict(rope, rope_type=rope_type).items()))


def hf_config_dict(cfg: ModelConfig) -> dict:
    """config.json of `cfg` (hf_config)."""
    return hf_config(cfg).to_dict()


def hf_config(cfg: ModelConfig):
    """transformers' config of `cfg`, its family's class (what the Decoder models; everything
    else at the class's defaults)."""
    from transformers import AutoConfig
    rope = dict(cfg.rope_scaling or {"rope_type": "default"}, rope_theta=cfg.rope_theta)
    extra = {}
    if cfg.model_type in ("mistral", "mixtral"):
        extra = {"sliding_window": cfg.sliding_window}
    if cfg.model_type == "mixtral":
        extra.update(num_local_experts=cfg.num_experts,
                     num_experts_per_tok=cfg.num_experts_per_tok)
    elif cfg.model_type == "qwen3_moe":
        extra = dict(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                     moe_intermediate_size=cfg.moe_intermediate_size,
                     norm_topk_prob=cfg.norm_topk_prob,
                     decoder_sparse_step=cfg.decoder_sparse_step,
                     mlp_only_layers=list(cfg.mlp_only_layers))
    elif cfg.model_type in GEMMA:
        extra = dict(sliding_window=cfg.sliding_window, layer_types=list(cfg.layer_types) or None,
                     attn_logit_softcapping=cfg.attn_softcap,
                     final_logit_softcapping=cfg.final_softcap,
                     query_pre_attn_scalar=cfg.query_pre_attn_scalar,
                     hidden_activation=cfg.hidden_act)
        if cfg.model_type == "gemma3_text":
            local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta}
            rope = {"full_attention": rope, "sliding_attention": local}
    return AutoConfig.for_model(
        cfg.model_type, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters=rope, **extra)
