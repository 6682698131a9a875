"""verl's rule scorers, re-implemented to give the same value on every input.

The reference is ``verl/utils/reward_score`` (gsm8k.py, math_reward.py, math_dapo.py,
search_r1_like_qa_em.py). Every quirk that changes a score is kept on purpose, so that
``val/test_score`` here is comparable with verl's published numbers:

- GSM8K looks only at the last 300 characters. strict: the last ``#### <digits/.,>`` (exactly
  one space), commas dropped; flexible: the last run of digits, '.' and ',' (commas kept, a lone
  '.' skipped). The answer is compared with the ground truth as a string: "72." or "72.0" is
  not "72", and ``#### $72`` has no answer.
- MATH (lighteval / MATH-500): the last ``\\boxed{..}``; a ``\\boxed x`` anywhere wins; an
  ``\\fbox{..}`` is found but cannot be unboxed, so it scores 0. Both sides go through the
  hendrycks ``strip_string``, which leaves ``$``, ``\\text{..}``, ``\\mbox`` and thousands
  commas in place; a normalisation step that raises falls back to raw string equality.
- math_dapo (also data_source ``math`` and ``aime*``): the last ``Answer: ...`` line within the
  last 300 characters, Minerva normalisation; +1.0 / -1.0 and ``{"acc": bool, "pred": str}``.
- search-R1 QA: exact match of the last ``<answer>..</answer>`` (SQuAD normalisation) against
  ``ground_truth["target"]``; a hit is worth 1/4 when the text has more than ten answer tags.

Pure functions on text; no printing (verl prints some samples; that changes no score).
"""

from __future__ import annotations

import re
import string
from typing import Any

TAIL_CHARS = 300   # verl scores gsm8k and math_dapo on the last 300 characters only

# ----------------------------------------------------------------------------- gsm8k

_GSM8K_STRICT = re.compile(r"#### (-?[0-9.,]+)")
_GSM8K_FLEXIBLE = re.compile(r"(-?[0-9.,]+)")


def extract_gsm8k_answer(text: str, method: str = "strict") -> str | None:
    """verl's GSM8K answer of ``text`` (its last 300 characters), or None.

    strict: the last ``#### N`` with N a run of digits, '.' and ',' (optionally '-'), commas
    removed. flexible: the last such run anywhere that is not a lone '.' (commas kept).
    """
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k extraction method must be 'strict' or 'flexible', got {method!r}")
    tail = text[-TAIL_CHARS:]
    if method == "strict":
        found = _GSM8K_STRICT.findall(tail)
        return found[-1].replace(",", "") if found else None
    found = _GSM8K_FLEXIBLE.findall(tail)
    if not found:
        return None
    usable = [f for f in found if f != "."]
    return usable[-1] if usable else found[0]


def gsm8k_score(solution_str: str, ground_truth: Any, method: str = "strict",
                format_score: float = 0.0, score: float = 1.0) -> float:
    """``score`` when the extracted answer equals ``ground_truth`` as a string, ``format_score``
    when an answer was extracted but differs, 0.0 when none was."""
    answer = extract_gsm8k_answer(solution_str, method)
    if answer is None:
        return 0.0
    return score if answer == ground_truth else format_score


# ----------------------------------------------------------------------------- MATH (boxed)

def last_boxed_only_string(text: str) -> str | None:
    """The last box of ``text`` as the MATH scorer finds it (see the module docstring)."""
    if "\\boxed " in text:   # checked before any braced box, wherever it stands
        return "\\boxed " + text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    depth = 0
    for end in range(start, len(text)):
        if text[end] == "{":
            depth += 1
        elif text[end] == "}":
            depth -= 1
            if depth == 0:
                return text[start:end + 1]
    return None


def remove_boxed(boxed: str) -> str:
    """The argument of ``\\boxed x`` or ``\\boxed{x}``; ValueError for anything else."""
    if "\\boxed " in boxed:
        if not boxed.startswith("\\boxed "):
            raise ValueError(f"not a '\\boxed ' expression: {boxed[:80]!r}")
        return boxed[len("\\boxed "):]
    if not (boxed.startswith("\\boxed{") and boxed.endswith("}")):
        raise ValueError(f"not a '\\boxed{{}}' expression: {boxed[:80]!r}")
    return boxed[len("\\boxed{"):-1]


def _fix_fracs(s: str) -> str:
    # \frac12 -> \frac{1}{2}, \frac1{2} -> \frac{1}{2}; "\frac" at the very end raises.
    head, *pieces = s.split("\\frac")
    out = [head]
    for piece in pieces:
        if piece[0] == "{":
            out.append("\\frac" + piece)
        elif len(piece) < 2:
            return s
        elif piece[1] == "{":
            out.append("\\frac{" + piece[0] + "}" + piece[1:])
        else:
            out.append("\\frac{" + piece[0] + "}{" + piece[1] + "}" + piece[2:])
    return "".join(out)


def _fix_a_slash_b(s: str) -> str:
    # "3/4" -> \frac{3}{4}, only when both sides are integers written canonically.
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        num, den = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    return f"\\frac{{{num}}}{{{den}}}" if s == f"{num}/{den}" else s


def _remove_right_units(s: str) -> str:
    # "\text{ " marks units in the MATH answers; two of them raise (raw comparison follows).
    if "\\text{ " not in s:
        return s
    left, *rest = s.split("\\text{ ")
    if len(rest) != 1:
        raise ValueError("more than one '\\text{ ' unit")
    return left


def _fix_sqrt(s: str) -> str:
    # \sqrt3 -> \sqrt{3}; "\sqrt" at the very end raises.
    head, *pieces = s.split("\\sqrt")
    return head + "".join("\\sqrt" + p if p[0] == "{" else "\\sqrt{" + p[0] + "}" + p[1:]
                          for p in pieces)


# Plain replacements of strip_string, in order (tfrac/dfrac without the backslash, as verl).
_STRIP_EARLY = (("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"),
                ("\\left", ""), ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", ""))
_STRIP_PERCENT = (("\\\\%", ""), ("\\%", ""), (" .", " 0."), ("{.", "{0."))


def strip_math_string(s: str) -> str:
    """The hendrycks MATH normalisation that verl's MATH scorer applies to both sides."""
    for old, new in _STRIP_EARLY:
        s = s.replace(old, new)
    s = _remove_right_units(s)
    for old, new in _STRIP_PERCENT:
        s = s.replace(old, new)
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:   # "x = 5" -> " 5"
        s = sides[1]
    if "\\sqrt" in s:
        s = _fix_sqrt(s)
    s = _fix_fracs(s.replace(" ", ""))
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _fix_a_slash_b(s)


def math_equiv(answer: Any, truth: Any) -> bool:
    """Equal after strip_math_string; raw equality when normalising either side raises."""
    if answer is None or truth is None:
        return answer is None and truth is None
    try:
        return strip_math_string(answer) == strip_math_string(truth)
    except Exception:   # noqa: BLE001 - verl falls back to raw equality on any error
        return answer == truth


def math_score(solution_str: str, ground_truth: Any) -> float:
    """verl's lighteval/MATH score: 1.0 when the last box equals the ground truth, else 0.0."""
    try:
        boxed = last_boxed_only_string(solution_str)
        if boxed is not None and math_equiv(remove_boxed(boxed), ground_truth):
            return 1.0
    except Exception:   # noqa: BLE001 - verl scores any failure 0.0
        pass
    return 0.0


# ----------------------------------------------------------------------------- math_dapo

_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
# Minerva normalisation (Lewkowycz et al. 2022) as verl's math_dapo applies it: replacements
# first, then removals, in this order.
_MINERVA_REPLACE = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""),
                    ("mbox", "text"), (",\\text{and}", ","), ("\\text{and}", ","),
                    ("\\text{m}", "\\text{}"))
_MINERVA_REMOVE = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots",
    "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds",
    "meters", "meals", "edges", "students", "childrentickets", "multiples", "\\text{s}",
    "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}",
    "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots")
_MINERVA_REGEX = (
    (re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), r"$\3$"),   # keep the first $...$ only
    (re.compile(r"(\\text\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\textbf\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\overline\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\boxed\{)(.*)(\})"), r"\2"),
    (re.compile(r"(frac)([^{])(.)"), r"frac{\2}{\3}"),   # \fracab -> \frac{a}{b}
    (re.compile(r"(sqrt)([^{])"), r"sqrt{\2}"),          # \sqrta -> \sqrt{a}
)


def normalize_final_answer(answer: str) -> str:
    """verl's math_dapo normalisation of a final answer (right of the last '=')."""
    answer = answer.split("=")[-1]
    for old, new in _MINERVA_REPLACE:
        answer = answer.replace(old, new)
    for text in _MINERVA_REMOVE:
        answer = answer.replace(text, "")
    for pattern, repl in _MINERVA_REGEX:
        answer = pattern.sub(repl, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def math_dapo_score(solution_str: str, ground_truth: str) -> dict[str, Any]:
    """verl's math_dapo: ``{"score": +1.0 / -1.0, "acc": bool, "pred": str}`` from the last
    ``Answer:`` line of the last 300 characters (``[INVALID]`` when there is none)."""
    found = _ANSWER_LINE.findall(solution_str[-TAIL_CHARS:])
    pred = normalize_final_answer(found[-1] if found else "[INVALID]")
    correct = pred == normalize_final_answer(ground_truth)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


# ----------------------------------------------------------------------------- search-R1 QA

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_qa_answer(text: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(c for c in text.lower() if c not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def search_r1_score(solution_str: str, ground_truth: Any, format_score: float = 0.0,
                    score: float = 1.0) -> float:
    """Exact match of the last ``<answer>`` against any of ``ground_truth["target"]``."""
    found = _ANSWER_TAG.findall(solution_str)
    if not found:
        return 0.0
    targets = ground_truth["target"]
    targets = [targets] if isinstance(targets, str) else targets
    answer = normalize_qa_answer(found[-1].strip())
    if not any(normalize_qa_answer(t) == answer for t in targets):
        return format_score
    many_tags = max(solution_str.count("<answer>"), solution_str.count("</answer>")) > 10
    return score / 4 if many_tags else score
