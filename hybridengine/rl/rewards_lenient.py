"""Our own lenient rule rewards, kept beside verl's exact ones (rewards_verl.py).

They score more answers as right than verl does, so their numbers are NOT comparable with
verl's tables; select them with data_source (or reward name) ``gsm8k_lenient`` /
``math_lenient``. ``keyword`` is ours only (the embedded default job uses it).

- gsm8k_lenient: ``####`` with any spacing, a '$' and thousands commas allowed, the whole text
  searched, a sentence-final '.' not part of the number, numbers compared numerically
  ("1,000" == "1000.00"); a ground truth may be a full GSM8K answer with ``####``.
- math_lenient: the last ``\\boxed{...}`` / ``\\fbox{...}``; the normalisation also drops
  ``$``, ``\\text{}`` / ``\\mbox{}`` wrappers, ``\\,``-style spaces and thousands commas, and
  compares numbers numerically ("5.0" == "5"); a boxed ground truth is unboxed.
- keyword: fraction of the ground-truth words present in the response (whole word, any case).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

# ----------------------------------------------------------------------------- gsm8k

# A number as models write it: optional sign, optional '$', thousands commas, decimals.
_NUMBER = r"-?\$?(?:\d[\d,]*(?:\.\d+)?|\.\d+)"
_STRICT_RE = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")
_FLEXIBLE_RE = re.compile(_NUMBER)


def _clean_number(text: str) -> str:
    return text.replace(",", "").replace("$", "").strip()


def extract_gsm8k_answer_lenient(text: str, method: str = "strict") -> str | None:
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
        answer = extract_gsm8k_answer_lenient(text, "strict")
        if answer is None:
            raise ValueError(f"gsm8k ground truth has '####' but no number after it: "
                             f"{text[-80:]!r}")
        return answer
    return _clean_number(text)


def gsm8k_lenient_score(solution_str: str, ground_truth: Any, method: str = "strict",
                format_score: float = 0.0, score: float = 1.0) -> float:
    """``score`` if the extracted answer equals the ground truth, ``format_score`` if an answer was
    extracted but is wrong, 0.0 if none was extracted."""
    answer = extract_gsm8k_answer_lenient(solution_str, method)
    if answer is None:
        return 0.0
    return score if numbers_equal(answer, _gsm8k_ground_truth(ground_truth)) else format_score


# ----------------------------------------------------------------------------- math

def _last_box(text: str) -> str | None:
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


def _unbox(boxed: str) -> str:
    """The argument of ``\\boxed{x}``, ``\\fbox{x}`` or ``\\boxed x``."""
    for head in ("\\boxed ", "\\boxed{", "\\fbox{"):
        if boxed.startswith(head):
            body = boxed[len(head):]
            return body if head.endswith(" ") else body[:-1]
    raise ValueError(f"not a boxed expression: {boxed[:80]!r}")


def extract_boxed_answer(text: str) -> str | None:
    """The content of the last box in text, or None when there is no complete box."""
    boxed = _last_box(text)
    return None if boxed is None else _unbox(boxed)


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


def math_lenient_score(solution_str: str, ground_truth: Any) -> float:
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
