"""Rule rewards on decoded text, a registry keyed by ``data_source``, custom reward functions.

Contract (verl-compatible): a reward function is called as
``fn(data_source=..., solution_str=..., ground_truth=..., extra_info=...)`` and returns a float
or a dict holding at least ``"score"`` (other keys are per-sample extras such as ``"acc"``).
``score_batch`` applies one to a batch of decoded responses and returns
``(scores, extras)`` where ``extras`` maps each extra key to a list aligned with ``scores``.

Built-in tasks:
- gsm8k: the answer after ``####`` (strict), or the last number in the text when there is no
  ``####`` (flexible); numbers compared numerically ("1,000" == "1000.00").
- math: the last ``\\boxed{...}`` / ``\\fbox{...}``, compared after the MATH-style string
  normalisation (``\\left``/``\\right``, units, ``\\dfrac``, ``x =`` prefix, spaces, ...).
- keyword: fraction of the ground-truth words present in the response (whole word, any case).

The text knows nothing about tokens: the caller decodes responses first.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import re
from collections.abc import Callable, Sequence
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

RewardFn = Callable[..., "float | dict[str, Any]"]

# ----------------------------------------------------------------------------- gsm8k

# A number as models write it: optional sign, optional '$', thousands commas, decimals.
_NUMBER = r"-?\$?(?:\d[\d,]*(?:\.\d+)?|\.\d+)"
_STRICT_RE = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")
_FLEXIBLE_RE = re.compile(_NUMBER)


def _clean_number(text: str) -> str:
    return text.replace(",", "").replace("$", "").strip()


def extract_gsm8k_answer(text: str, method: str = "strict") -> str | None:
    """The final answer of a GSM8K-style text, commas and '$' removed, or None.

    strict: the last ``#### <number>``. flexible: as strict, else the last number in the text.
    """
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k extraction method must be 'strict' or 'flexible', got {method!r}")
    matches = _STRICT_RE.findall(text)
    if matches:
        return _clean_number(matches[-1])
    if method == "flexible":
        numbers = _FLEXIBLE_RE.findall(text)
        if numbers:
            return _clean_number(numbers[-1])
    return None


def _as_decimal(text: str) -> Decimal | None:
    try:
        value = Decimal(text)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def numbers_equal(a: str, b: str) -> bool:
    """Numeric equality of two number strings ("72" == "72.00" == "7.2e1"), else string equality."""
    a, b = _clean_number(a), _clean_number(b)
    da, db = _as_decimal(a), _as_decimal(b)
    if da is not None and db is not None:
        return da == db
    return a == b


def _gsm8k_ground_truth(ground_truth: Any) -> str:
    """The ground truth number: a number string, a number, or a full GSM8K answer with ``####``."""
    text = str(ground_truth)
    if "####" in text:
        answer = extract_gsm8k_answer(text, "strict")
        if answer is None:
            raise ValueError(f"gsm8k ground truth has '####' but no number after it: "
                             f"{text[-80:]!r}")
        return answer
    return _clean_number(text)


def gsm8k_score(solution_str: str, ground_truth: Any, method: str = "strict",
                format_score: float = 0.0, score: float = 1.0) -> float:
    """``score`` if the extracted answer equals the ground truth, ``format_score`` if an answer was
    extracted but is wrong, 0.0 if none was extracted."""
    answer = extract_gsm8k_answer(solution_str, method)
    if answer is None:
        return 0.0
    return score if numbers_equal(answer, _gsm8k_ground_truth(ground_truth)) else format_score


# ----------------------------------------------------------------------------- math

def last_boxed_only_string(text: str) -> str | None:
    """The last ``\\boxed{...}`` / ``\\fbox{...}`` (braces balanced) or ``\\boxed x`` in text."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    if text.startswith("\\boxed ", start):
        # "\boxed 5$": the argument runs to the closing '$' (or the end).
        return "\\boxed " + text[start + len("\\boxed "):].split("$")[0]
    open_brace = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    if not text.startswith("{", open_brace):
        return None  # e.g. "\boxed\frac12": not a form the MATH answers use
    depth = 0
    for i in range(open_brace, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i + 1]
    return None


def remove_boxed(boxed: str) -> str:
    """The argument of ``\\boxed{x}``, ``\\fbox{x}`` or ``\\boxed x``."""
    for head in ("\\boxed ", "\\boxed{", "\\fbox{"):
        if boxed.startswith(head):
            body = boxed[len(head):]
            return body if head.endswith(" ") else body[:-1]
    raise ValueError(f"not a boxed expression: {boxed[:80]!r}")


def extract_boxed_answer(text: str) -> str | None:
    """The content of the last box in text, or None when there is no complete box."""
    boxed = last_boxed_only_string(text)
    return None if boxed is None else remove_boxed(boxed)


_TEXT_WRAPPERS = re.compile(r"\\(?:text|textbf|textrm|mbox|mathrm|mathbf)\{([^{}]*)\}")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_INT_SLASH_INT = re.compile(r"(-?\d+)/(\d+)")


def _fix_fracs(s: str) -> str:
    # \frac12 -> \frac{1}{2}; \frac1{2} -> \frac{1}{2}; \frac{1}2 -> \frac{1}{2}
    s = re.sub(r"\\frac([0-9a-zA-Z])([0-9a-zA-Z])", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac([0-9a-zA-Z])\{", r"\\frac{\1}{", s)
    return re.sub(r"\\frac\{([^{}]*)\}([0-9a-zA-Z])", r"\\frac{\1}{\2}", s)


def normalize_math_answer(s: str) -> str:
    """MATH-style canonical form of an answer string (the classic ``strip_string`` steps)."""
    s = s.strip().replace("\n", "").replace("\\!", "")
    s = s.replace("\\\\", "\\").replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "").replace("$", "")
    # Units are written "\text{ cm}" (leading space): drop them before unwrapping other \text{}.
    s = s.split("\\text{ ")[0].split("\\mbox{ ")[0]
    s = _TEXT_WRAPPERS.sub(r"\1", s)
    s = s.replace("\\%", "").replace("%", "")
    for thin_space in ("\\,", "\\;", "\\:", "\\ ", "{,}"):
        s = s.replace(thin_space, "" if thin_space == "{,}" else " ")
    s = s.strip().rstrip(".").strip()
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    # "x = 5" -> "5", but only for a short left-hand side (keeps "f(x)=..." and equations).
    parts = s.split("=")
    if len(parts) == 2 and len(parts[0].strip()) <= 2:
        s = parts[1]
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)
    s = s.replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    match = _INT_SLASH_INT.fullmatch(s)
    if match:
        s = f"\\frac{{{match.group(1)}}}{{{match.group(2)}}}"
    return s


def math_answers_equal(a: str, b: str) -> bool:
    """Equal after normalisation, or equal as numbers ("5.0" == "5")."""
    na, nb = normalize_math_answer(a), normalize_math_answer(b)
    if na == nb:
        return True
    da, db = _as_decimal(na), _as_decimal(nb)
    return da is not None and db is not None and da == db


def math_score(solution_str: str, ground_truth: Any) -> float:
    """1.0 if the last box in the response matches the ground truth, else 0.0.

    ground_truth: the answer string, or a full solution whose last box is the answer.
    """
    answer = extract_boxed_answer(solution_str)
    if answer is None:
        return 0.0
    truth = str(ground_truth)
    if "\\boxed" in truth or "\\fbox" in truth:
        truth = extract_boxed_answer(truth) or truth
    return 1.0 if math_answers_equal(answer, truth) else 0.0


# ----------------------------------------------------------------------------- keyword

def _keywords(ground_truth: Any) -> list[str]:
    words = [ground_truth] if isinstance(ground_truth, str) else list(ground_truth)
    words = [str(w).strip() for w in words]
    if not words or not all(words):
        raise ValueError(f"keyword ground truth must be a non-empty word or list of words, "
                         f"got {ground_truth!r}")
    return words


def keyword_score(solution_str: str, ground_truth: Any) -> float:
    """Fraction of the ground-truth words found in the response, whole word, case-insensitive."""
    words = _keywords(ground_truth)
    found = sum(
        re.search(r"(?<!\w)" + re.escape(w) + r"(?!\w)", solution_str, re.IGNORECASE) is not None
        for w in words)
    return found / len(words)


# ----------------------------------------------------------------------------- registry

def _gsm8k_result(solution_str: str, ground_truth: Any) -> dict[str, float]:
    score = gsm8k_score(solution_str, ground_truth)
    return {"score": score, "acc": float(score == 1.0)}


def _math_result(solution_str: str, ground_truth: Any) -> dict[str, float]:
    score = math_score(solution_str, ground_truth)
    return {"score": score, "acc": score}


def _keyword_result(solution_str: str, ground_truth: Any) -> dict[str, float]:
    score = keyword_score(solution_str, ground_truth)
    return {"score": score, "acc": float(score == 1.0)}


TASKS: dict[str, Callable[[str, Any], dict[str, float]]] = {
    "gsm8k": _gsm8k_result,
    "math": _math_result,
    "keyword": _keyword_result,
}

DATA_SOURCES: dict[str, str] = {
    "openai/gsm8k": "gsm8k",
    "lighteval/MATH": "math",
    "DigitalLearningGmbH/MATH-lighteval": "math",
    "HuggingFaceH4/MATH-500": "math",
    "math": "math",
    "keyword": "keyword",
}


def default_compute_score(data_source: str, solution_str: str, ground_truth: Any,
                          extra_info: dict | None = None) -> dict[str, float]:
    """The built-in reward for ``data_source``: ``{"score": float, "acc": 0.0 or 1.0}``."""
    task = DATA_SOURCES.get(data_source)
    if task is None:
        raise ValueError(f"no built-in reward for data_source {data_source!r}; known: "
                         f"{sorted(DATA_SOURCES)} (or set custom_reward_function.path)")
    return TASKS[task](solution_str, ground_truth)


def load_custom_reward(path: str | Path, name: str = "compute_score") -> RewardFn:
    """Function ``name`` from the Python file at ``path`` (imported from that file only)."""
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise FileNotFoundError(f"custom reward file not found: {path}")
    digest = hashlib.sha1(str(file).encode()).hexdigest()[:12]
    # A unique name keeps two reward files with the same stem from replacing each other.
    spec = importlib.util.spec_from_file_location(f"hybridengine_custom_reward_{digest}", file)
    if spec is None or spec.loader is None:
        raise ValueError(f"custom reward file is not an importable Python file: {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if fn is None:
        raise AttributeError(f"custom reward function {name!r} not found in {path}")
    if not callable(fn):
        raise TypeError(f"custom reward {name!r} in {path} is not callable")
    return fn


# ----------------------------------------------------------------------------- batch scoring

class RewardError(RuntimeError):
    """A reward function failed on one sample; the message names the sample and data_source."""


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


def score_batch(responses: Sequence[str], data_sources: Sequence[str],
                ground_truths: Sequence[Any], extra_infos: Sequence[dict | None] | None = None,
                fn: RewardFn | None = None) -> tuple[list[float], dict[str, list[Any]]]:
    """Score each decoded response; ``fn`` defaults to ``default_compute_score``.

    Returns ``(scores, extras)``: extras holds every key of dict results (e.g. "score", "acc"),
    one entry per sample, so every dict result must carry the same keys.
    """
    num_samples = len(responses)
    extra_infos = [None] * num_samples if extra_infos is None else extra_infos
    lengths = {len(data_sources), len(ground_truths), len(extra_infos)}
    if lengths != {num_samples}:
        raise ValueError(f"score_batch needs equal lengths: responses {num_samples}, data_sources "
                         f"{len(data_sources)}, ground_truths {len(ground_truths)}, "
                         f"extra_infos {len(extra_infos)}")
    fn = default_compute_score if fn is None else fn
    scores: list[float] = []
    extras: dict[str, list[Any]] = {}
    for i in range(num_samples):
        source = data_sources[i]
        try:
            result = fn(data_source=source, solution_str=responses[i],
                        ground_truth=ground_truths[i], extra_info=extra_infos[i])
        except Exception as e:
            # extra_info.index is the row's index in its data file: the sample a user can find
            info = extra_infos[i] if isinstance(extra_infos[i], dict) else {}
            row = f", extra_info.index={info['index']}" if "index" in info else ""
            raise RewardError(f"reward function failed on sample {i} (data_source={source!r}"
                              f"{row}): {type(e).__name__}: {e}") from e
        score, sample_extras = _split_result(result, i, source)
        if i > 0 and set(sample_extras) != set(extras):
            raise RewardError(f"reward for sample {i} (data_source={source!r}) has extra keys "
                              f"{sorted(sample_extras)}, earlier samples {sorted(extras)}")
        for key, value in sample_extras.items():
            extras.setdefault(key, []).append(value)
        scores.append(score)
    return scores, extras
