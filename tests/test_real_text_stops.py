"""Real text that stops at lengths of its own choosing: the pretrained stories260K writes a story
and ends it where llama2.c's TinyStories data ends one, with BOS (the next story's start; its
generation_config.json lists [EOS, BOS]). A random model with EOS ignored never finishes a
sequence early, so this is where the built-in engine's stops, freed slots and freed blocks meet
real lengths: greedy equals transformers' `generate` token for token, and the paged layout
(blocks freed as stories end, a cache small enough to preempt) equals the static one, sampled."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridengine.models.hf import load_decoder
from hybridengine.rl.rollout import stop_token_ids
from hybridengine.rollout.engine import Engine
from hybridengine.rollout.rollout_config import RolloutConfig
from hybridengine.rollout.sampling import SamplingParams
from model_utils import STORIES

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_TOKENS = 420                # stories end after ~180-420 tokens; the cap bounds a stray
TRAIN = Path(STORIES).parents[1] / "data" / "stories_keywords" / "train.jsonl"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(STORIES)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    rows = [json.loads(line) for line in TRAIN.read_text().splitlines()[:4]]
    return [tokenizer(r["prompt"][0]["content"]).input_ids for r in rows]


@pytest.fixture(scope="module")
def model():
    return load_decoder(STORIES)


def _generate(model, prompts, params, **kw):
    engine = Engine(model, RolloutConfig(max_num_seqs=16, max_model_len=512,
                                         max_prefill_tokens=512, **kw))
    return engine.generate(prompts, params), engine


def test_stop_ids_are_the_story_boundary(tokenizer):
    assert stop_token_ids(tokenizer, STORIES) == (1, 2)


def test_greedy_stories_stop_where_transformers_stops(model, prompts, tokenizer):
    stops = stop_token_ids(tokenizer, STORIES)
    got, _ = _generate(model, prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                      stop_token_ids=stops))
    hf = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32)
    for p, r in zip(prompts, got):
        out = hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False,
                          pad_token_id=0)[0, len(p):].tolist()
        assert r.token_ids == out, (len(r.token_ids), len(out))
        assert r.finish_reason == "stop" and r.token_ids[-1] in stops
    lengths = [len(r.token_ids) for r in got]
    assert max(lengths) < MAX_TOKENS and len(set(lengths)) == len(lengths), lengths


@pytest.mark.parametrize("cache", ["ample", "small"])
def test_sampled_stories_paged_equals_static(model, prompts, tokenizer, cache):
    stops = stop_token_ids(tokenizer, STORIES)
    params = SamplingParams(n=4, temperature=1.0, max_tokens=MAX_TOKENS, stop_token_ids=stops,
                            seed=3)
    ref, _ = _generate(model, prompts, params)
    # blocks of 4: a prompt of ~10 tokens fills 2 that its samples share; small: 160 blocks,
    # room for two stories at once of the 16
    kw = dict(kv_cache_tokens=161 * 4) if cache == "small" else {}
    got, engine = _generate(model, prompts, params, kv_layout="paged", block_size=4, **kw)
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    assert max(abs(a - b) for r, q in zip(got, ref) for a, b in zip(r.logprobs, q.logprobs)) < 1e-4
    lengths = [len(r.token_ids) for r in got]
    stopped = [r for r in got if r.finish_reason == "stop"]
    assert len(stopped) >= len(got) - 1 and all(r.token_ids[-1] in stops for r in stopped)
    assert max(lengths) - min(lengths) > 50, lengths       # lengths of the model's own choosing
    s = engine.stats
    assert s["num_prefix_cached_tokens"] > 0               # the 4 samples share their prompt
    assert (s["num_preemptions"] > 0) == (cache == "small")


@pytest.mark.parametrize("kv_layout", ["static", "paged"])
def test_sampled_stories_dense_prefill_equals_varlen(model, prompts, tokenizer, monkeypatch,
                                                     kv_layout):
    """The dense prefill attention, its prompts (11-13 tokens) padded to dense_width's 16 rows,
    writes the same cache and samples the same stories, ended at EOS at their own lengths, as
    the static layout's varlen prefill; in either KV layout (the paged one's prompts hold no
    full block, so no cached prefix: its prefill takes the dense form too)."""
    import hybridengine.rollout.attention as rollout_attention
    import hybridengine.rollout.paged_context as paged_context
    widths = []
    dense_fn = rollout_attention.padded_causal_attention
    for module in (rollout_attention, paged_context):
        monkeypatch.setattr(module, "padded_causal_attention", lambda q, k, v, n, w, *a:
                            widths.append(w) or dense_fn(q, k, v, n, w, *a))
    stops = stop_token_ids(tokenizer, STORIES)
    params = SamplingParams(n=4, temperature=1.0, max_tokens=MAX_TOKENS, stop_token_ids=stops,
                            seed=5)
    ref, _ = _generate(model, prompts, params, prefill_attention="varlen")
    assert not widths
    got, _ = _generate(model, prompts, params, prefill_attention="dense", kv_layout=kv_layout)
    assert widths and set(widths) == {16} and max(map(len, prompts)) < 16
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    assert max(abs(a - b) for r, q in zip(got, ref) for a, b in zip(r.logprobs, q.logprobs)) < 1e-4
    stopped = [len(r.token_ids) for r in got if r.finish_reason == "stop"]
    # 9 of the 16 end at EOS (220-418 tokens, all different), the rest at the cap
    assert len(stopped) >= 8 and len(set(stopped)) == len(stopped)
