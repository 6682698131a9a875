"""Loading the configuration: verl's key tree, OmegaConf overrides, one-line errors.

`load_config(argv)` starts from configs/ppo_trainer.yaml, merges each `--config FILE` (a partial
tree) in order, then the `key=value` overrides (OmegaConf dotlist syntax: `a.b=[x,y]`, `a=null`,
`a=${b}`; a Hydra-style leading `+` or `++` is tolerated); on CUDA the device defaults
(configs/cuda_defaults.yaml, config.device_defaults) go between the defaults and the run's own
layers. It returns a resolved, struct-mode DictConfig (reading a missing key raises) whose every
leaf has the type of its default.

Errors are one line each: an unknown key names the nearest known key; a wrong type names key,
value and expected type; an unknown choice lists the choices; a YAML syntax error gives file, line
and column. Every error of the command line and files is reported at once (`ConfigError`, one
line each), not one per attempt. Keys that verl users pass but that mean nothing here (FSDP
knobs, Ray, HDFS, ...) are dropped with one warning line listing them.
"""
from __future__ import annotations

import difflib
import fnmatch
import logging
from pathlib import Path
from typing import Any, Iterator

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hybridengine.config.device_defaults import CUDA_DEFAULTS_FILE, device_layers
from hybridengine.config.choices import choices
from hybridengine.config.errors import raise_all

logger = logging.getLogger("hybridengine.config")

DEFAULTS_FILE = Path(__file__).resolve().parents[2] / "configs" / "ppo_trainer.yaml"

# key prefixes of the actor, rollout and reference sections
ACTOR, ROLLOUT, REF = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout.", "actor_rollout_ref.ref."
_A, _R, _F = ACTOR, ROLLOUT, REF

# Kind and nullability of keys whose default cannot tell (null defaults, path-or-list);
# every other key has the kind of its default value.
SPECS: dict[str, tuple[str, bool]] = {
    "data.train_files": ("files", False),
    **dict.fromkeys((_A + "megatron.optimizer_offload", "critic.megatron.optimizer_offload"),
                    ("optimizer_offload", False)),
    **dict.fromkeys((_A + "megatron.param_offload", _A + "megatron.grad_offload",
                     _F + "megatron.param_offload", "critic.megatron.param_offload",
                     "critic.megatron.grad_offload"), ("offload", False)),
    "data.val_files": ("files", True),
    "custom_reward_function.weights": ("dict[str,float]", True),
    _A + "loss_scale_factor": ("float", True),
    **dict.fromkeys(("algorithm.rollout_correction.rollout_is", "algorithm.rollout_correction.rollout_rs",
                     "algorithm.rollout_correction.rollout_rs_threshold"), ("str", True)),
    **dict.fromkeys(("actor_rollout_ref.model.target_modules", "critic.model.target_modules"),
                    ("list[str]", False)),
    **dict.fromkeys(("actor_rollout_ref.model.lora_alpha", "critic.model.lora_alpha"),
                    ("float", False)),
    **dict.fromkeys(("actor_rollout_ref.model.lora_adapter_path", "critic.model.lora_adapter_path"),
                    ("str", True)),
    **dict.fromkeys(("actor_rollout_ref.model.path", "critic.model.path", "custom_reward_function.path",
                     "trainer.resume_from_path"), ("str", True)),
    **dict.fromkeys((_A + "optim.min_lr_ratio", "critic.optim.min_lr_ratio",
                     "trainer.hybrid_engine.reshard_direct_min_mb", "trainer.device_memory_gb",
                     "trainer.host_memory_gb"),
                    ("float", True)),
    **dict.fromkeys(("data.val_batch_size", _A + "ppo_micro_batch_size_per_gpu",
                     _R + "log_prob_micro_batch_size_per_gpu", _F + "log_prob_micro_batch_size_per_gpu",
                     "critic.ppo_micro_batch_size_per_gpu", "critic.forward_micro_batch_size_per_gpu",
                     "trainer.total_training_steps", "trainer.n_gpus_per_node"), ("int", True)),
}


def __getattr__(name: str):
    """CHOICES: config.choices.choices(), built at first use."""
    if name == "CHOICES":
        return choices()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# verl spellings of our keys (older or Megatron-trainer names).
ALIASES = {
    _A + "optim.warmup_style": _A + "optim.lr_scheduler_type",
    "critic.optim.warmup_style": "critic.optim.lr_scheduler_type",
    _A + "optim.clip_grad": _A + "grad_clip",
    "critic.optim.clip_grad": "critic.grad_clip",
    # verl passes Megatron's TransformerConfig fields through override_transformer_config; the
    # one we have a key for is taken, the rest of that section is ignored (IGNORED)
    _A + "megatron.override_transformer_config.gradient_accumulation_fusion":
        _A + "megatron.gradient_accumulation_fusion",
    "critic.megatron.override_transformer_config.gradient_accumulation_fusion":
        "critic.megatron.gradient_accumulation_fusion",
}
# the sections above an aliased key that are not ours: read into, for the alias
_ALIAS_SECTIONS = frozenset(k.rsplit(".", i)[0] for k in ALIASES for i in range(1, k.count(".")))

# verl keys with no meaning here (fnmatch patterns on the key or a prefix of it): dropped, warned.
IGNORED = (
    "ray_init", "*.strategy", "*.fsdp_config", "*.checkpoint", "*.profile",
    "*.profiler", "*.load_weight", "*.data_loader_seed", "*.use_remove_padding", "*.external_lib",
    "*.override_config", "*.gradient_checkpointing_kwargs",
    "*.use_liger", "*.use_fused_kernels", "*.use_shm", "*.tokenizer_path",
    "*.megatron.use_dist_checkpointing", "*.megatron.dist_checkpointing_path", "*.megatron.seed",
    "*.megatron.override_transformer_config", "*.megatron.use_mbridge",
    "data.tokenizer", "data.return_raw_input_ids", "data.filter_overlong_prompts_workers",
    "data.image_key", "data.video_key", "data.custom_cls", "data.dataloader_num_workers",
    "actor_rollout_ref.hybrid_engine", _R + "mode", _R + "chat_scheduler", _R + "load_format",
    _R + "max_num_batched_tokens", _R + "max_model_len", _R + "disable_log_stats",
    _R + "enable_chunked_prefill", _R + "engine_kwargs", _R + "multi_turn", _R + "layer_name_map",
    _R + "calculate_log_probs", "critic.rollout_n", "critic.kl_ctrl",
    "reward_model.strategy", "reward_model.model", "reward_model.micro_batch_size*",
    "reward_model.max_length", "reward_model.use_dynamic_bsz", "reward_model.forward_max_token_len_per_gpu",
    "reward_model.launch_reward_fn_async", "reward_model.megatron", "reward_model.overlong_buffer.log",
    "trainer.default_hdfs_dir", "trainer.balance_batch",
    "trainer.log_val_generations", "trainer.rollout_data_dir", "trainer.validation_data_dir",
    "trainer.del_local_ckpt_after_load", "trainer.max_*_ckpt_to_keep",
    "trainer.ray_wait_register_center_timeout",
)
# Parallel features we lack: accepted (and dropped) only at their neutral value.
NEUTRAL_ONLY = {"virtual_pipeline_model_parallel_size": None}

_KIND_NAMES = {"int": "an integer", "float": "a number", "bool": "true/false", "str": "a string",
               "list[str]": "a list of strings", "list[float]": "a list of numbers",
               "files": "a path or a list of paths", "dict[str,float]": "a mapping of names to numbers",
               "offload": "true, false or auto",
               "optimizer_offload": "true, false, host_step or auto"}
# Keys whose value is a mapping with free keys: one leaf, not a config section.
MAPPING_KEYS = frozenset(k for k, (kind, _) in SPECS.items() if kind.startswith("dict["))


# ----------------------------------------------------------------------------- loading


def load_config(argv: list[str]) -> DictConfig:
    """Defaults <- each --config FILE (in order) <- key=value overrides (in order, after all
    files, wherever they stand in argv); typed, resolved, struct mode. Every error of argv and
    the files is collected before raising (`raise_all`)."""
    errors: list[Exception] = []
    files, dotlist = _parse_argv(argv, errors)
    defaults = OmegaConf.load(DEFAULTS_FILE)
    leaves = dict(_flat(OmegaConf.to_container(defaults, resolve=True)))
    sections = {key.rsplit(".", i)[0] for key in leaves for i in range(1, key.count(".") + 1)}
    ignored: list[str] = []
    trees = []
    for file in files:
        try:
            trees.append(_accept(_load_yaml(file), f"{file}: ", leaves, sections, ignored, errors))
        except (ValueError, FileNotFoundError) as e:
            errors.append(e)
    for item in dotlist:
        try:
            tree = OmegaConf.to_container(OmegaConf.from_dotlist([item]), resolve=False)
        except OmegaConfBaseException as e:
            errors.append(ValueError(f"bad override {item!r}: {_first_line(e)}"))
            continue
        trees.append(_accept(tree, "", leaves, sections, ignored, errors))
    raise_all(errors)
    # the device's defaults (device_defaults) under the run's own layers
    cfg = OmegaConf.merge(defaults, *device_layers(_device(defaults, trees)), *trees)
    if ignored:
        names = ", ".join(dict.fromkeys(ignored))
        logger.warning("ignoring verl keys that have no meaning in hybridengine: %s", names)
    try:
        resolved = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:
        raise ValueError(f"config interpolation failed: {_first_line(e)}") from None
    for key, value in list(_flat(resolved)):   # the keys of `leaves`: _accept admitted no other
        try:
            _set(resolved, key, _typed(key, value, leaves[key]))
        except ValueError as e:
            errors.append(e)
    raise_all(errors)
    out = OmegaConf.create(resolved)
    OmegaConf.set_struct(out, True)
    return out


def describe_layers(argv: list[str]) -> str:
    """The config layers argv puts in force, in merge order: `defaults (configs/ppo_trainer.yaml)
    + configs/tiny.yaml + 2 command-line overrides` (argv as load_config reads it)."""
    files, dotlist = _parse_argv(argv, [])
    repo = DEFAULTS_FILE.parents[1]
    shown = [str(f.resolve().relative_to(repo)) if f.resolve().is_relative_to(repo) else str(f)
             for f in files]
    layers = [f"defaults (configs/{DEFAULTS_FILE.name})", *shown]
    if device_layers(_device(OmegaConf.load(DEFAULTS_FILE), _raw_trees(files, dotlist))):
        layers.insert(1, f"CUDA defaults (configs/{CUDA_DEFAULTS_FILE.name})")
    if dotlist:
        layers.append(f"{len(dotlist)} command-line override{'s' * (len(dotlist) != 1)}")
    return " + ".join(layers)


def _device(defaults: DictConfig, trees: list[dict]):
    """trainer.device as the run's layers leave it; None where they cannot say (errors that
    load_config reports)."""
    try:
        return OmegaConf.select(OmegaConf.merge(defaults, *trees), "trainer.device",
                                throw_on_resolution_failure=False)
    except OmegaConfBaseException:
        return None


def _raw_trees(files: list[Path], dotlist: list[str]) -> list[dict]:
    """The run's layers as written, those that parse (describe_layers: no errors raised)."""
    trees = []
    for file in files:
        try:
            trees.append(_load_yaml(file))
        except (ValueError, FileNotFoundError):
            pass
    for item in dotlist:
        try:
            trees.append(OmegaConf.to_container(OmegaConf.from_dotlist([item])))
        except OmegaConfBaseException:
            pass
    return trees


def _parse_argv(argv: list[str], errors: list[Exception]) -> tuple[list[Path], list[str]]:
    files, dotlist = [], []
    args = iter(argv)
    for arg in args:
        if arg == "--config" or arg.startswith("--config="):
            path = arg.partition("=")[2] or next(args, "")
            if path:
                files.append(Path(path))
            else:
                errors.append(ValueError("--config needs a YAML file path"))
        elif arg.startswith("~"):
            errors.append(ValueError(f"override {arg!r}: deleting keys is not supported"))
        elif arg.startswith("-"):
            errors.append(ValueError(f"unknown argument {arg!r}; expected --config FILE or "
                                     f"key=value overrides"))
        elif "=" in arg and arg.lstrip("+").partition("=")[0]:
            dotlist.append(arg.lstrip("+"))   # Hydra's +key=value / ++key=value
        else:
            errors.append(ValueError(f"argument {arg!r} is not a key=value override"))
    return files, dotlist


def _load_yaml(file: Path) -> dict:
    if not file.is_file():
        raise FileNotFoundError(f"--config file {file} does not exist")
    try:
        tree = OmegaConf.to_container(OmegaConf.load(file), resolve=False)
    except yaml.MarkedYAMLError as e:
        raise ValueError(f"{file}: invalid YAML: {_yaml_problem(e)}") from None
    except (yaml.YAMLError, OmegaConfBaseException) as e:
        raise ValueError(f"{file}: invalid YAML: {_first_line(e)}") from None
    if not isinstance(tree, dict):
        raise ValueError(f"{file}: expected a mapping of config keys at the top level")
    return tree


def _yaml_problem(error: yaml.MarkedYAMLError) -> str:
    """`line 4, column 8: did not find expected ',' or ']' (while parsing a flow sequence
    from line 3, column 6)`: PyYAML's marks are 0-based."""
    def at(mark) -> str:
        return f"line {mark.line + 1}, column {mark.column + 1}"
    mark = error.problem_mark or error.context_mark
    text = f"{at(mark)}: " if mark else ""
    text += error.problem or error.context or type(error).__name__
    if error.context and error.problem:
        text += f" ({error.context}" + (f" from {at(error.context_mark)}"
                                         if error.context_mark else "") + ")"
    return text


def _flat(tree: dict, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted leaf key, value) pairs; an empty mapping counts as a leaf."""
    for name, value in tree.items():
        if isinstance(value, dict) and value and prefix + str(name) not in MAPPING_KEYS:
            yield from _flat(value, f"{prefix}{name}.")
        else:
            yield prefix + str(name), value


def _accept(tree: dict, where: str, leaves: dict, sections: set, ignored: list,
            errors: list, kept: dict | None = None, prefix: str = "") -> dict:
    """The part of an override tree that is ours (aliases renamed), as a tree from the root;
    ignorable keys are appended to `ignored`; anything else is an error (appended to `errors`,
    its key left out) naming the nearest key."""
    kept = {} if kept is None else kept
    for name, value in tree.items():
        key = ALIASES.get(prefix + str(name), prefix + str(name))
        try:
            if key in leaves:
                if not (isinstance(value, str) and "${" in value):
                    _typed(key, value, leaves[key])  # early: a mapping cannot merge into a list
                _set(kept, key, value)
            elif key in _ALIAS_SECTIONS and isinstance(value, dict):
                _accept(value, where, leaves, sections, ignored, errors, kept, key + ".")
            elif key in sections:
                if not isinstance(value, dict):
                    raise ValueError(f"{where}{key}={value!r}: {key} is a config section, "
                                     f"not a value")
                _accept(value, where, leaves, sections, ignored, errors, kept, key + ".")
            elif _ignorable(key, value, where):
                ignored.extend(k for k, _ in _flat({key: value}))
            else:
                full_key = next(_flat({key: value}))[0]
                raise ValueError(f"{where}unknown config key {full_key!r} "
                                 f"(nearest known key: {_nearest(full_key, leaves)!r})")
        except ValueError as e:
            errors.append(e)
    return kept


def _nearest(key: str, leaves: dict) -> str:
    # a known key extending the unknown one is the likeliest intent (verl's deprecated
    # ppo_micro_batch_size -> ppo_micro_batch_size_per_gpu); else the closest spelling
    extensions = sorted((k for k in leaves if k.startswith(key)), key=len)
    return extensions[0] if extensions else difflib.get_close_matches(key, list(leaves), n=1, cutoff=0.0)[0]


def _ignorable(key: str, value: Any, where: str) -> bool:
    name = key.rpartition(".")[2]
    if name in NEUTRAL_ONLY:
        if value != NEUTRAL_ONLY[name]:
            raise ValueError(f"{where}{key}={value!r} is not supported (only {NEUTRAL_ONLY[name]!r})")
        return True
    parts = key.split(".")
    prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return any(fnmatch.fnmatchcase(p, pattern) for p in prefixes for pattern in IGNORED)


def _typed(key: str, value: Any, default: Any) -> Any:
    """`value` checked (and widened: int -> float, scalar -> str, str -> [str]) against the
    kind of `key`; one-line ValueError otherwise."""
    kind, nullable = SPECS.get(key) or (_kind_of(default), default is None)
    if value is None:
        if nullable:
            return None
        raise ValueError(f"{key}=null: expected {_KIND_NAMES[kind]}")
    if kind.startswith("list[") and isinstance(value, list):
        item_kind = kind[5:-1]
        # list items are not stringified: [console, 5] is a mistake, not a name
        items = [(v if isinstance(v, str) else None) if item_kind == "str" else _coerce(v, item_kind)
                 for v in value]
        if any(v is None for v in items):
            raise ValueError(f"{key}={value!r}: expected {_KIND_NAMES[kind]}")
        return items
    coerced = _coerce(value, kind)
    if coerced is None:
        or_null = " or null" if nullable else ""
        raise ValueError(f"{key}={value!r}: expected {_KIND_NAMES[kind]}{or_null}, "
                         f"got {type(value).__name__}")
    allowed = choices().get(key)
    if allowed is not None and coerced not in allowed:
        raise ValueError(f"{key}={coerced!r}: choose one of {', '.join(allowed)}")
    return coerced


def _coerce(value: Any, kind: str) -> Any:
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "int":
        return value if isinstance(value, int) and not isinstance(value, bool) else None
    if kind == "float":
        return float(value) if is_number else None
    if kind == "bool":
        return value if isinstance(value, bool) else None
    if kind == "str":
        return value if isinstance(value, str) else (str(value) if is_number else None)
    if kind == "list[str]":
        return [value] if isinstance(value, str) else None
    if kind == "offload":                 # false | true | auto (rl.memory decides)
        return value if isinstance(value, bool) or value == "auto" else None
    if kind == "optimizer_offload":       # ... | host_step (the Adam step on the CPU)
        return value if isinstance(value, bool) or value in ("auto", "host_step") else None
    if kind == "files":
        ok = isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))
        return value if ok else None
    if kind == "dict[str,float]":
        ok = isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, (int, float))
                                             and not isinstance(v, bool) for k, v in value.items())
        return {k: float(v) for k, v in value.items()} if ok else None
    return None


def _kind_of(default: Any) -> str:
    if isinstance(default, list):
        return f"list[{_kind_of(default[0])}]" if default else "list[str]"
    for kind, typ in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if isinstance(default, typ):
            return kind
    raise TypeError(f"no type for a default of {default!r}: add the key to SPECS")


def _set(tree: dict, key: str, value: Any) -> None:
    *parents, last = key.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[last] = value


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
