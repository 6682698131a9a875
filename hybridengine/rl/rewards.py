"""Rewards on decoded text: verl's routing by ``data_source``, a registry of named rewards, and
batch scoring.

Two contracts:

- per sample (verl's): ``fn(data_source=, solution_str=, ground_truth=, extra_info=)`` returns a
  float or a dict holding at least ``"score"`` (other keys are per-sample extras, e.g. "acc").
  A ``custom_reward_function.path`` file's plain function follows it.
- per batch (ours): a function registered with ``@register_reward_fn("name")`` is called as
  ``fn(outputs, prompts=, ground_truths=, data_sources=, extra_infos=)`` (lists aligned with
  ``outputs``) and returns one float (or one such dict) per output.

``default_compute_score`` routes ``data_source`` exactly as verl's does (``DATA_SOURCES``,
``aime*``) to verl's scorers (rewards_verl.py), plus our own ``keyword``, ``gsm8k_lenient`` and
``math_lenient`` (rewards_lenient.py). ``build_reward`` turns ``custom_reward_function.{path,
name, weights}`` into one ``Reward``; ``score_batch`` applies a reward to a batch and returns
``(scores, extras)``. The text knows nothing about tokens: the caller decodes first.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from hybridengine.rl.rewards_lenient import (   # noqa: F401 - re-exported
    extract_boxed_answer, gsm8k_lenient_score, keyword_score, math_answers_equal,
    math_lenient_score, normalize_math_answer)
from hybridengine.rl.rewards_verl import (   # noqa: F401 - re-exported
    extract_gsm8k_answer, gsm8k_score, math_dapo_score, math_equiv, math_score,
    search_r1_score, strip_math_string)

RewardFn = Callable[..., "float | dict[str, Any]"]
# reward_model.reward_manager: naive scores as they come; dapo adds the overlong penalty
# (rl.rollout, advantages.overlong_penalty)
REWARD_MANAGERS = ("naive", "dapo")
VERL_DEFAULT_NAME = "compute_score"   # custom_reward_function.name's default: the routing


class RewardError(RuntimeError):
    """A reward function failed or returned a bad value; the message names the sample."""


# ----------------------------------------------------------------------------- scorers, routing

def _with_acc(scorer: Callable[[str, Any], float]) -> Callable[[str, Any], dict[str, float]]:
    def scored(solution_str: str, ground_truth: Any) -> dict[str, float]:
        score = scorer(solution_str, ground_truth)
        return {"score": score, "acc": float(score == 1.0)}
    return scored


# name -> scorer(solution_str, ground_truth); return types as verl's (float, math_dapo a dict)
SCORERS: dict[str, Callable[[str, Any], Any]] = {
    "gsm8k": gsm8k_score,
    "gsm8k_flexible": partial(gsm8k_score, method="flexible"),
    "math_boxed": math_score,
    "math_dapo": math_dapo_score,
    "search_r1": search_r1_score,
    "gsm8k_lenient": _with_acc(gsm8k_lenient_score),
    "math_lenient": _with_acc(math_lenient_score),
    "keyword": _with_acc(keyword_score),
}

# Scorers verl routes to that need what we do not ship: routed, but scoring raises.
NOT_INCLUDED = {
    "prime_math": "verl's prime_math grader (sympy + pylatexenc, per-answer timeouts)",
    "prime_code": "code execution in a sandbox (verl's prime_code / sandbox_fusion)",
    "geo3k": "the mathruler package (verl's geo3k)",
}

# data_source -> scorer, in verl's default_compute_score order; then ours.
DATA_SOURCES: dict[str, str] = {
    "openai/gsm8k": "gsm8k",
    **dict.fromkeys(("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval",
                     "HuggingFaceH4/MATH-500"), "math_boxed"),
    **dict.fromkeys(("math_dapo", "math", "math_dapo_reasoning"), "math_dapo"),
    **dict.fromkeys(("numina_aops_forum", "numina_synthetic_math", "numina_amc_aime",
                     "numina_synthetic_amc", "numina_cn_k12", "numina_olympiads"), "prime_math"),
    **dict.fromkeys(("codecontests", "apps", "codeforces", "taco"), "prime_code"),
    "hiyouga/geometry3k": "geo3k",
    **dict.fromkeys(("searchR1_nq", "searchR1_triviaqa", "searchR1_popqa", "searchR1_hotpotqa",
                     "searchR1_2wikimultihopqa", "searchR1_musique", "searchR1_bamboogle"),
                    "search_r1"),
    **{name: name for name in ("gsm8k_lenient", "math_lenient", "keyword")},
}
DATA_SOURCE_PREFIXES = {"aime": "math_dapo"}   # verl: data_source.startswith("aime")


def scorer_name(data_source: str) -> str:
    """The scorer ``default_compute_score`` uses for ``data_source``; one-line errors."""
    name = DATA_SOURCES.get(data_source) or next(
        (n for prefix, n in DATA_SOURCE_PREFIXES.items() if str(data_source).startswith(prefix)),
        None)
    if name is None:
        known = sorted(DATA_SOURCES) + [p + "*" for p in DATA_SOURCE_PREFIXES]
        raise ValueError(f"no built-in reward for data_source {data_source!r}; known: {known} "
                         f"(or set custom_reward_function.path / .name)")
    if name in NOT_INCLUDED:
        raise NotImplementedError(f"data_source {data_source!r} is scored by verl's {name}, which "
                                  f"needs {NOT_INCLUDED[name]}, not part of hybridengine; set "
                                  f"custom_reward_function.path to a scorer")
    return name


def default_compute_score(data_source: str, solution_str: str, ground_truth: Any,
                          extra_info: dict | None = None, **_: Any) -> float | dict[str, Any]:
    """The built-in reward for ``data_source``, valued and typed as verl's (float or dict)."""
    return SCORERS[scorer_name(data_source)](solution_str, ground_truth)


# ----------------------------------------------------------------------------- Reward, registry

def _call_one(fn: RewardFn, i: int, output: str, data_source: str, ground_truth: Any,
              extra_info: Any) -> Any:
    try:
        return fn(data_source=data_source, solution_str=output, ground_truth=ground_truth,
                  extra_info=extra_info)
    except Exception as e:
        # extra_info.index is the row's index in its data file: the sample a user can find
        info = extra_info if isinstance(extra_info, dict) else {}
        row = f", extra_info.index={info['index']}" if "index" in info else ""
        raise RewardError(f"reward function failed on sample {i} (data_source={data_source!r}"
                          f"{row}): {type(e).__name__}: {e}") from e


@dataclass(frozen=True)
class Reward:
    """A named reward over a batch; ``batched`` says which contract ``fn`` follows (module
    docstring). Calling it returns one result (float or dict with "score") per output."""

    name: str
    fn: Callable[..., Any]
    batched: bool
    builtin: bool = False

    def __call__(self, outputs: Sequence[str], *, prompts: Sequence[Any],
                 ground_truths: Sequence[Any], data_sources: Sequence[str],
                 extra_infos: Sequence[Any]) -> list[Any]:
        if not self.batched:
            return [_call_one(self.fn, i, outputs[i], data_sources[i], ground_truths[i],
                              extra_infos[i]) for i in range(len(outputs))]
        try:
            results = list(self.fn(list(outputs), prompts=list(prompts),
                                   ground_truths=list(ground_truths),
                                   data_sources=list(data_sources), extra_infos=list(extra_infos)))
        except RewardError:
            raise
        except Exception as e:
            raise RewardError(f"reward function {self.name!r} failed on a batch of {len(outputs)} "
                              f"(data_sources {sorted(set(map(str, data_sources)))}): "
                              f"{type(e).__name__}: {e}") from e
        if len(results) != len(outputs):
            raise RewardError(f"reward function {self.name!r} returned {len(results)} values for "
                              f"{len(outputs)} outputs")
        return results


def _per_sample(scorer: Callable[[str, Any], Any]) -> RewardFn:
    def score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None):
        return scorer(solution_str, ground_truth)
    return score


_REGISTRY: dict[str, Reward] = {
    "default": Reward("default", default_compute_score, batched=False, builtin=True),
    **{name: Reward(name, _per_sample(scorer), batched=False, builtin=True)
       for name, scorer in SCORERS.items()},
}


def _origin(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def register_reward_fn(name: str) -> Callable[[Callable], Callable]:
    """Decorator: register a batch reward ``fn(outputs, *, prompts, ground_truths, data_sources,
    extra_infos) -> list[float]`` under ``name``; the function is returned unchanged.

    Re-importing the same file re-registers its functions; any other clash is an error.
    """
    if not isinstance(name, str) or not name or name == "score":
        raise ValueError(f"reward name must be a non-empty string other than 'score', got {name!r}")

    def register(fn: Callable) -> Callable:
        old = _REGISTRY.get(name)
        if old is not None and (old.builtin or _origin(old.fn) != _origin(fn)):
            owner = "a built-in reward" if old.builtin else _origin(old.fn)
            raise ValueError(f"reward name {name!r} is already registered ({owner}); "
                             f"register {_origin(fn)} under another name")
        _REGISTRY[name] = Reward(name, fn, batched=True)
        return fn
    return register


def registered_rewards() -> list[str]:
    """The names ``custom_reward_function.name`` / ``.weights`` may use without a file."""
    return sorted(_REGISTRY)


# ----------------------------------------------------------------------------- loading

def _import_file(path: str | Path) -> Any:
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise FileNotFoundError(f"custom reward file not found: {path}")
    digest = hashlib.sha1(str(file).encode()).hexdigest()[:12]
    # A unique name keeps two reward files with the same stem from replacing each other.
    spec = importlib.util.spec_from_file_location(f"hybridengine_custom_reward_{digest}", file)
    if spec is None or spec.loader is None:
        raise ValueError(f"custom reward file is not an importable Python file: {path}")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        raise ValueError(f"custom reward file {path}:{e.lineno}: syntax error: {e.msg}") from None
    except Exception as e:  # noqa: BLE001 - the user's module: any import-time failure, one line
        raise ValueError(f"custom reward file {path} failed to import: "
                         f"{type(e).__name__}: {e}") from e
    return module


def load_custom_reward(path: str | Path, name: str = VERL_DEFAULT_NAME) -> RewardFn:
    """Function ``name`` from the Python file at ``path`` (imported from that file only)."""
    fn = getattr(_import_file(path), name, None)
    if fn is None:
        raise AttributeError(f"custom reward function {name!r} not found in {path}")
    if not callable(fn):
        raise TypeError(f"custom reward {name!r} in {path} is not callable")
    return fn


def _resolve(name: str, module: Any, key: str, path: Any) -> Reward:
    """``name`` as a function of the file (a registered one keeps its batch contract), else
    a registered reward, else (no file) ``compute_score``: verl's routing."""
    if module is not None and hasattr(module, name):
        fn = getattr(module, name)
        if not callable(fn):
            raise ValueError(f"{key}={name!r}: {name} in {path} is not callable")
        registered = next((r for r in _REGISTRY.values() if r.fn is fn), None)
        return registered or Reward(name, fn, batched=False)
    if name in _REGISTRY:
        return _REGISTRY[name]
    if name == VERL_DEFAULT_NAME and module is None:
        return _REGISTRY["default"]
    where = f"not a function in {path} nor a registered reward" if module is not None \
        else "not a registered reward"
    raise ValueError(f"{key}={name!r}: {where}; known: {', '.join(registered_rewards())}")


def _hybrid(parts: list[tuple[Reward, float]]) -> Reward:
    """Weighted sum of rewards; each component's score is reported as an extra of its name."""
    def weighted(outputs: list[str], **context: Any) -> list[dict[str, float]]:
        columns = {}
        for reward, _ in parts:
            results = reward(outputs, **context)
            columns[reward.name] = [_split_result(r, i, context["data_sources"][i])[0]
                                    for i, r in enumerate(results)]
        return [{"score": sum(w * columns[r.name][i] for r, w in parts),
                 **{r.name: columns[r.name][i] for r, _ in parts}} for i in range(len(outputs))]
    name = "hybrid(" + ", ".join(f"{r.name}={w:g}" for r, w in parts) + ")"
    return Reward(name, weighted, batched=True)


def build_reward(path: str | Path | None = None, name: str = VERL_DEFAULT_NAME,
                 weights: Mapping[str, float] | None = None) -> Reward:
    """The reward ``custom_reward_function.{path, name, weights}`` selects.

    path: a file to import (its ``@register_reward_fn`` functions register); name: a function
    of that file or a registered reward (``compute_score`` without a file: verl's routing);
    weights: ``{reward name: weight}`` combined as a weighted sum (then ``name`` stays default).
    """
    module = _import_file(path) if path else None
    if weights is None:
        return _resolve(name, module, "custom_reward_function.name", path)
    if name != VERL_DEFAULT_NAME:
        raise ValueError(f"custom_reward_function.name={name!r} and custom_reward_function.weights "
                         f"are both set: the weights name the rewards to combine")
    weights = dict(weights)
    if not weights:
        raise ValueError("custom_reward_function.weights is empty: give {reward name: weight} "
                         "or null")
    parts = []
    for part, weight in weights.items():
        key = f"custom_reward_function.weights.{part}"
        if part == "score":
            raise ValueError(f"{key}: 'score' is the combined score, not a reward name")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) \
                or not math.isfinite(weight):
            raise ValueError(f"{key}={weight!r}: expected a finite number")
        parts.append((_resolve(part, module, key, path), float(weight)))
    return _hybrid(parts)


# ----------------------------------------------------------------------------- batch scoring

def _split_result(result: Any, index: int, data_source: str) -> tuple[float, dict[str, Any]]:
    if isinstance(result, dict):
        if "score" not in result:
            raise RewardError(f"reward for sample {index} (data_source={data_source!r}) is a dict "
                              f"without 'score': keys {sorted(result)}")
        extras = result
        result = result["score"]
    else:
        extras = {}
    try:
        score = float(result)
    except (TypeError, ValueError):
        raise RewardError(f"reward for sample {index} (data_source={data_source!r}) is not a "
                          f"number: {result!r}") from None
    if not math.isfinite(score):
        raise RewardError(f"reward for sample {index} (data_source={data_source!r}) is {score}")
    return score, extras


def _align_extras(per_sample: list[dict[str, Any]],
                  data_sources: Sequence[str]) -> dict[str, list[Any]]:
    """Extras as lists aligned with the samples. One data_source's samples must report the same
    keys (one scorer per source); a key another source lacks is None there (verl's gsm8k returns
    a float, its math_dapo a dict)."""
    keys_of: dict[str, set[str]] = {}
    keys: dict[str, None] = {}
    for i, (extras, source) in enumerate(zip(per_sample, data_sources)):
        seen = keys_of.setdefault(source, set(extras))
        if set(extras) != seen:
            raise RewardError(f"reward for sample {i} (data_source={source!r}) has extra keys "
                              f"{sorted(extras)}, earlier samples of that data_source {sorted(seen)}")
        keys.update(dict.fromkeys(extras))
    return {key: [extras.get(key) for extras in per_sample] for key in keys}


def score_batch(responses: Sequence[str], data_sources: Sequence[str],
                ground_truths: Sequence[Any], extra_infos: Sequence[dict | None] | None = None,
                fn: Reward | RewardFn | None = None, prompts: Sequence[str] | None = None,
                ) -> tuple[list[float], dict[str, list[Any]]]:
    """Score each decoded response with ``fn``: a ``Reward``, a per-sample function (verl's
    contract), or None for ``default_compute_score``. ``prompts`` (decoded) reach batch rewards.

    Returns ``(scores, extras)``: extras holds every key of dict results (e.g. "score", "acc"),
    one entry per sample (None where that sample's reward lacks the key, see _align_extras).
    """
    num_samples = len(responses)
    extra_infos = [None] * num_samples if extra_infos is None else extra_infos
    prompts = [None] * num_samples if prompts is None else prompts
    lengths = {len(data_sources), len(ground_truths), len(extra_infos), len(prompts)}
    if lengths != {num_samples}:
        raise ValueError(f"score_batch needs equal lengths: responses {num_samples}, data_sources "
                         f"{len(data_sources)}, ground_truths {len(ground_truths)}, "
                         f"extra_infos {len(extra_infos)}, prompts {len(prompts)}")
    reward = fn if isinstance(fn, Reward) else Reward(
        VERL_DEFAULT_NAME, default_compute_score if fn is None else fn, batched=False)
    results = reward(responses, prompts=prompts, ground_truths=ground_truths,
                     data_sources=data_sources, extra_infos=extra_infos)
    split = [_split_result(r, i, data_sources[i]) for i, r in enumerate(results)]
    return [s for s, _ in split], _align_extras([e for _, e in split], data_sources)
