"""Our lenient rule rewards (gsm8k_lenient, math_lenient) and keyword, the data_source routing,
custom reward files, score_batch. verl's exact scorers: tests/test_rewards_verl.py.

GSM8K strings are real: tests/fixtures/gsm8k_sample.jsonl holds rows 0-9, 345, 367, 462, 497,
5715, 5844, 6189 of openai/grade-school-math train.jsonl (MIT, see fixtures/GSM8K_LICENSE).
Expected values are written by hand from our lenient semantics (a superset of verl's hits).
"""

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from hybridengine.rl.rewards import (
    DATA_SOURCES, RewardError, default_compute_score, keyword_score, load_custom_reward, score_batch)
from hybridengine.rl.rewards_lenient import (
    extract_boxed_answer, extract_gsm8k_answer_lenient, gsm8k_lenient_score, math_answers_equal,
    math_lenient_score)

FIXTURES = Path(__file__).parent / "fixtures"
MATH500 = Path("/work/shared/data/math500/test.jsonl")
GSM8K_ROWS = [json.loads(line) for line in (FIXTURES / "gsm8k_sample.jsonl").open()]
# The final answers of the fixture rows, read by eye from the file.
GSM8K_FINALS = ["72", "10", "5", "42", "624", "35", "48", "16", "41", "990",
                "1,080", "850,000", "2,250", "10,000", "-7", "-47", "-12"]


def _body(answer: str) -> str:
    """The worked solution without its '#### N' line."""
    return answer[:answer.rindex("####")].rstrip()


# ----------------------------------------------------------------------------- gsm8k

@pytest.mark.parametrize("row, final", list(zip(GSM8K_ROWS, GSM8K_FINALS)))
def test_gsm8k_real_answers_score_one(row, final):
    number = final.replace(",", "")
    assert extract_gsm8k_answer_lenient(row["answer"]) == number
    assert gsm8k_lenient_score(row["answer"], number) == 1.0
    assert gsm8k_lenient_score(row["answer"], final) == 1.0          # "1,080" ground truth
    assert gsm8k_lenient_score(row["answer"], row["answer"]) == 1.0  # full answer as ground truth
    wrong = str(int(number) + 1)
    assert gsm8k_lenient_score(row["answer"], wrong) == 0.0
    assert gsm8k_lenient_score(row["answer"], wrong, format_score=0.1) == 0.1


def test_gsm8k_missing_hashes_strict_vs_flexible():
    answer = GSM8K_ROWS[0]["answer"]  # "... = <<48+24=72>>72 clips altogether in April and May."
    body = _body(answer)
    assert extract_gsm8k_answer_lenient(body, "strict") is None
    assert gsm8k_lenient_score(body, "72") == 0.0
    assert gsm8k_lenient_score(body, "72", format_score=0.1) == 0.0  # nothing extracted: not a format hit
    assert extract_gsm8k_answer_lenient(body, "flexible") == "72"
    assert gsm8k_lenient_score(body, "72", method="flexible") == 1.0
    # Row 1 ends "... she earned 0.2 x 50 = $<<0.2*50=10>>10." -> last number 10.
    assert gsm8k_lenient_score(_body(GSM8K_ROWS[1]["answer"]), "10", method="flexible") == 1.0
    assert extract_gsm8k_answer_lenient("I do not know, sorry.", "flexible") is None
    with pytest.raises(ValueError, match="'strict' or 'flexible'"):
        extract_gsm8k_answer_lenient("#### 1", "loose")


@pytest.mark.parametrize("tail, truth, expected", [
    ("#### 72.0", "72", 1.0),
    ("#### 72.00", "72", 1.0),
    ("#### 72.", "72", 1.0),          # sentence-final period is not part of the number
    ("#### $10", "10", 1.0),
    ("#### $1,080.00", "1080", 1.0),
    ("#### -$7", "-7", 1.0),
    ("#### 0.2", "0.20", 1.0),
    ("#### 1,000", "1000", 1.0),
    ("#### 850,000", "850,000", 1.0),
    ("####-47", "-47", 1.0),           # no space after ####
    ("#### 7", "-7", 0.0),             # sign matters
    ("#### 72.5", "72", 0.0),
    ("#### five", "5", 0.0),           # nothing extracted
])
def test_gsm8k_number_forms(tail, truth, expected):
    response = _body(GSM8K_ROWS[0]["answer"]) + "\n" + tail
    assert gsm8k_lenient_score(response, truth) == expected


def test_gsm8k_last_hashes_wins():
    response = "First try: #### 5\nWait, recount: 48 + 24 = 72\n#### 72"
    assert extract_gsm8k_answer_lenient(response) == "72"
    assert gsm8k_lenient_score(response, "72") == 1.0
    assert gsm8k_lenient_score("#### 72\nno, #### 5", "72", format_score=0.1) == 0.1


# ----------------------------------------------------------------------------- math

def test_boxed_extraction():
    assert extract_boxed_answer(r"so $\boxed{\frac{1}{2}}$.") == r"\frac{1}{2}"
    assert extract_boxed_answer(r"\boxed{1} then \boxed{\left( 3, \frac{\pi}{2} \right)}") \
        == r"\left( 3, \frac{\pi}{2} \right)"
    assert extract_boxed_answer(r"answer: \fbox{42}") == "42"
    assert extract_boxed_answer(r"answer: $\boxed 5$.") == "5"
    assert extract_boxed_answer(r"\boxed{\frac{1}{2}") is None  # unclosed
    assert extract_boxed_answer("no box here") is None
    assert extract_boxed_answer(r"\boxed\frac12") is None  # malformed model output: no answer
    assert math_lenient_score(r"\boxed\frac{1}{2}", r"\frac12") == 0.0


@pytest.mark.parametrize("pred, truth", [
    (r"\frac{1}{2}", r"\dfrac{1}{2}"),
    (r"\frac12", r"\frac{1}{2}"),
    ("1/2", r"\frac{1}{2}"),
    ("0.5", r"\frac{1}{2}"),
    ("(3,\\frac{\\pi}{2})", r"\left( 3, \frac{\pi}{2} \right)"),   # MATH-500 #0
    ("Evelyn", r"\text{Evelyn}"),                                   # #4
    ("90", r"90^\circ"),                                            # #7
    ("5", "x=5"),                                                   # #23
    ("11\\sqrt{2}", r"11\sqrt2"),                                   # #31
    (r"\frac{270}{7}", r"\frac{270}7\text{ degrees}"),              # #166
    ("10080", r"10,\!080"),                                         # #198
    ("18.90", r"\$18.90"),                                          # #459
    ("864", r"864 \mbox{ inches}^2"),                               # #257
    ("50", r"50\%"),
    ("5.", "5"),
    ("5.0", "5"),
])
def test_math_equivalent(pred, truth):
    assert math_answers_equal(pred, truth)
    assert math_lenient_score(f"The answer is $\\boxed{{{pred}}}$.", truth) == 1.0


@pytest.mark.parametrize("pred, truth", [
    (r"\frac{1}{3}", r"\frac{1}{2}"),
    ("0.34", r"\dfrac{17}{50}"),        # no decimal/fraction algebra beyond the 0.5 rule
    ("(3,2)", "(2,3)"),
    ("-5", "5"),
    ("y=2x+4", "y = 2x + 3"),
])
def test_math_not_equivalent(pred, truth):
    assert not math_answers_equal(pred, truth)
    assert math_lenient_score(f"\\boxed{{{pred}}}", truth) == 0.0


def test_math_score_without_box_and_boxed_ground_truth():
    assert math_lenient_score("The answer is 5.", "5") == 0.0
    assert math_lenient_score(r"\boxed{5}", r"Thus the answer is $\boxed{5}$.") == 1.0


@pytest.mark.skipif(not MATH500.exists(), reason="MATH-500 not present")
def test_math500_reference_solutions_score_one():
    rows = [json.loads(line) for line in MATH500.open()]
    assert len(rows) == 500
    assert sum(math_lenient_score(r["solution"], r["answer"]) for r in rows) == 500.0


# ----------------------------------------------------------------------------- keyword

def test_keyword_score():
    assert keyword_score("The cat sat on the mat.", "cat") == 1.0
    assert keyword_score("THE CAT sat.", "cat") == 1.0
    assert keyword_score("We concatenate strings.", "cat") == 0.0  # whole words only
    assert keyword_score("a cat and a bird", ["cat", "dog"]) == 0.5
    assert keyword_score("dog, cat!", np.array(["cat", "dog", "fox"])) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="keyword ground truth"):
        keyword_score("text", [])


# ----------------------------------------------------------------------------- registry

def test_registry_sources():
    gsm8k = GSM8K_ROWS[0]["answer"]
    # verl's types: gsm8k and MATH give floats, math_dapo (data_source "math") a dict
    assert default_compute_score("openai/gsm8k", gsm8k, "72") == 1.0
    assert default_compute_score("openai/gsm8k", gsm8k, "73") == 0.0
    for source in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval",
                   "HuggingFaceH4/MATH-500"):
        assert default_compute_score(source, r"\boxed{\dfrac12}", "0.5") == 1.0
    assert default_compute_score("math", r"\boxed{\dfrac12}", "0.5") == \
        {"score": -1.0, "acc": False, "pred": "[INVALID]"}
    assert default_compute_score("math_lenient", r"\boxed{\dfrac12}", "0.5") == \
        {"score": 1.0, "acc": 1.0}
    assert default_compute_score("gsm8k_lenient", gsm8k, "72.0") == {"score": 1.0, "acc": 1.0}
    assert default_compute_score("keyword", "a cat", ["cat", "dog"]) == {"score": 0.5, "acc": 0.0}
    assert {"gsm8k", "math_boxed", "math_dapo", "keyword", "gsm8k_lenient", "math_lenient"} <= \
        set(DATA_SOURCES.values())


def test_registry_unknown_source():
    with pytest.raises(ValueError, match=r"'my/data'.*openai/gsm8k") as info:
        default_compute_score("my/data", "x", "1")
    assert "\n" not in str(info.value)


# ----------------------------------------------------------------------------- custom + batch

CUSTOM_FN = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    hit = float(solution_str.strip() == ground_truth)
    return {"score": 2.0 * hit - 1.0, "acc": hit, "length": len(solution_str)}

def fails(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "boom":
        raise KeyError("missing thing")
    return 1

def not_a_number(data_source, solution_str, ground_truth, extra_info=None):
    return "high"
'''


@pytest.fixture
def custom_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM_FN)
    return path


def test_custom_reward_in_batch(custom_file):
    path_before = list(sys.path)
    fn = load_custom_reward(custom_file, "compute_score")
    assert sys.path == path_before  # loaded from the file only
    scores, extras = score_batch(["a", " b ", "c"], ["x"] * 3, ["a", "b", "z"], None, fn=fn)
    assert scores == [1.0, 1.0, -1.0]
    assert extras == {"score": [1.0, 1.0, -1.0], "acc": [1.0, 1.0, 0.0], "length": [1, 3, 1]}


def test_custom_reward_errors(custom_file, tmp_path):
    missing = tmp_path / "nope.py"
    with pytest.raises(FileNotFoundError, match="nope.py"):
        load_custom_reward(missing, "compute_score")
    with pytest.raises(AttributeError, match="'score_fn'.*my_reward.py"):
        load_custom_reward(custom_file, "score_fn")
    fails = load_custom_reward(custom_file, "fails")
    with pytest.raises(RewardError, match=r"sample 1 \(data_source='src/b'\).*KeyError") as info:
        score_batch(["ok", "boom"], ["src/a", "src/b"], ["1", "1"], [{}, {}], fn=fails)
    assert isinstance(info.value.__cause__, KeyError)
    with pytest.raises(RewardError, match="sample 0.*not a number"):
        score_batch(["a"], ["s"], ["1"], fn=load_custom_reward(custom_file, "not_a_number"))


def test_score_batch_default_mixed_sources():
    responses = [GSM8K_ROWS[10]["answer"], GSM8K_ROWS[14]["answer"], r"\boxed{x=5}", "cat"]
    sources = ["openai/gsm8k", "openai/gsm8k", "HuggingFaceH4/MATH-500", "keyword"]
    truths = ["1080", "7", "5", ["cat", "dog"]]
    scores, extras = score_batch(responses, sources, truths, [None] * 4)
    assert scores == [1.0, 0.0, 1.0, 0.5]
    # verl's gsm8k and MATH scorers return floats: no extras for those samples
    assert extras == {"score": [None, None, None, 0.5], "acc": [None, None, None, 0.0]}


def test_score_batch_checks():
    with pytest.raises(ValueError, match="ground_truths 1"):
        score_batch(["a", "b"], ["keyword"] * 2, ["a"])
    nan = lambda **_: math.nan  # noqa: E731
    with pytest.raises(RewardError, match="sample 0.*nan"):
        score_batch(["a"], ["s"], ["a"], fn=nan)
    mixed = lambda solution_str, **_: {"score": 1.0} if solution_str == "a" else 0.5  # noqa: E731
    with pytest.raises(RewardError, match="sample 1.*extra keys"):
        score_batch(["a", "b"], ["s", "s"], ["a", "b"], fn=mixed)
    with pytest.raises(RewardError, match="without 'score'"):
        score_batch(["a"], ["s"], ["a"], fn=lambda **_: {"acc": 1.0})


# --- the decoded text rewards read (rl.rollout.decode_texts) ----------------------------------
def _tokenizers():
    from transformers import AutoTokenizer
    from model_utils import STORIES
    qwen = Path(__file__).resolve().parents[2] / "shared" / "models" / "qwen2-tokenizer"
    return [AutoTokenizer.from_pretrained(STORIES)] + \
        ([AutoTokenizer.from_pretrained(qwen)] if qwen.is_dir() else [])


def test_decode_texts_equals_batch_decode_in_one_backend_call(monkeypatch):
    """The Qwen2.5 and stories260K tokenizers: one backend call for the whole batch (never
    transformers' per-sequence batch_decode), and the same strings as batch_decode: random ids
    over the whole vocabulary (special tokens skipped), empty responses, lists and tensors."""
    import random

    import torch

    from hybridengine.rl.rollout import decode_texts
    rng = random.Random(0)
    for tok in _tokenizers():
        ids = [[rng.randrange(len(tok)) for _ in range(rng.randrange(300))] for _ in range(64)]
        ids[3] = []
        ids[5] = [tok.eos_token_id] + ids[5] + [tok.eos_token_id]
        want = tok.batch_decode(ids, skip_special_tokens=True)
        with monkeypatch.context() as m:
            m.setattr(type(tok), "batch_decode", lambda *a, **k: pytest.fail("per sequence"))
            got = decode_texts(tok, ids)
            got_tensors = decode_texts(tok, [torch.tensor(x, dtype=torch.long) for x in ids])
        assert got == got_tensors == want
        assert any(tok.eos_token in t for t in tok.batch_decode(ids[5:6]))   # it was there


def test_decode_texts_keeps_transformers_path_where_it_would_change_the_text():
    """A tokenizer that cleans up tokenization spaces, or overrides _decode, decodes through its
    own batch_decode (whatever that does to the backend's text)."""
    from hybridengine.rl.rollout import decode_texts
    tok = _tokenizers()[0]
    ids = [[5, 6, 7], [8, 9]]

    class Shouting(type(tok)):
        def _decode(self, token_ids, **kw):
            return super()._decode(token_ids, **kw).upper()
    loud = Shouting.from_pretrained(tok.name_or_path)
    assert decode_texts(loud, ids) == [t.upper() for t in tok.batch_decode(ids)]
    calls = []
    tok.clean_up_tokenization_spaces = True
    orig = type(tok).batch_decode
    tok.batch_decode = lambda *a, **k: calls.append(1) or orig(tok, *a, **k)
    assert decode_texts(tok, ids) == orig(tok, ids, skip_special_tokens=True) and calls == [1]
