"""The engine with the paged KV cache (RolloutConfig.kv_layout="paged") against the static
layout, token for token: greedy and seeded sampling with n > 1 (samples share their prompt's
blocks), equal prompts in one batch (prefix-cache hits within a prefill), a cache so small that
sequences are preempted and recomputed, finished flags read one step late (the CUDA schedule);
eager and graph-shaped (the CUDA-graph path without capture: bucket padding, fixed-width
tables in static buffers), and compiled (aot_eager; inductor on the CPU for the decode step).
Log-probs agree within 1e-5 (a recomputed or prefix-hit prefill rounds differently from decode
steps). ~40 s on CPU (the compiled cases ~25 of them; more with a cold inductor cache)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hybridengine.hybrid.generator import Generator
from hybridengine.models.hf import load_decoder
from hybridengine.rollout.engine import Engine
from hybridengine.rollout.block_manager import BlockAllocator, BlockTables
from hybridengine.rollout.paged_scheduler import PagedScheduler
from hybridengine.rollout.rollout_config import CompileMode, RolloutConfig
from hybridengine.rollout.sampling import SamplingParams
from hybridengine.rollout.scheduler import Sequence
from model_utils import save_tiny

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_LEN = 40
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
SAMPLED = SamplingParams(n=3, temperature=0.9, top_p=0.95, top_k=20, max_tokens=24, seed=7)
# 14 blocks of 4 (+1 scratch): one max_len sequence takes 10
SMALL = dict(kv_cache_tokens=15 * 4)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_decoder(save_tiny(tmp_path_factory.mktemp("q") / "qwen2", "qwen2", tied=False))


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    out = [torch.randint(3, 97, (n,), generator=g).tolist() for n in [5, 11, 3, 8, 1, 14, 9]]
    return out + [out[1], out[5]]          # equal prompts in one batch


def _generate(model, prompts, params, lag=0, graph_shaped=False, **kw):
    engine = Engine(model, RolloutConfig(max_num_seqs=kw.pop("max_num_seqs", 32),
                                         max_model_len=MAX_LEN, max_prefill_tokens=128, **kw))
    engine.steps_in_flight = lag
    engine.runner.static_shapes = graph_shaped   # the CUDA-graph shapes, without capture
    return engine.generate(prompts, params), engine


def _assert_same(got, ref):
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    assert [r.finish_reason for r in got] == [r.finish_reason for r in ref]
    assert [(r.prompt_index, r.sample_index) for r in got] == \
        [(r.prompt_index, r.sample_index) for r in ref]
    gap = max(abs(a - b) for r, q in zip(got, ref)
              for x, y in ((r.logprobs, q.logprobs), (r.sampled_logprobs, q.sampled_logprobs))
              for a, b in zip(x, y))
    assert gap < 1e-5, gap


@pytest.fixture(scope="module")
def static_refs(model, prompts):
    greedy, _ = _generate(model, prompts, GREEDY)
    # a token that ends some greedy outputs early and not others
    stop = next(t for t in greedy[0].token_ids[2:]
                if any(t not in r.token_ids for r in greedy[1:]))
    stopped = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=(stop,))
    return {"greedy": (GREEDY, greedy),
            "stop": (stopped, _generate(model, prompts, stopped)[0]),
            "sampled": (SAMPLED, _generate(model, prompts, SAMPLED)[0])}


@pytest.mark.parametrize("case", ["greedy", "stop", "sampled"])
@pytest.mark.parametrize("budget", ["ample", "small"])
@pytest.mark.parametrize("lag", [0, 1])
@pytest.mark.parametrize("graph_shaped", [False, True], ids=["eager", "graph_shaped"])
def test_paged_equals_static(model, prompts, static_refs, case, budget, lag, graph_shaped):
    params, ref = static_refs[case]
    kw = SMALL if budget == "small" else {}
    got, engine = _generate(model, prompts, params, lag=lag, kv_layout="paged", block_size=4,
                            graph_shaped=graph_shaped, **kw)
    _assert_same(got, ref)
    runner = engine.runner
    assert runner.backend == "sdpa" and runner.width == 10 and runner.slot_tables.shape == (33, 10)
    s = engine.stats
    assert s["kv_layout"] == "paged" and not s["cuda_graphs"]
    # equal prompts (and the n samples' later admissions) hit the prefix cache
    assert s["num_prefix_cached_tokens"] > 0
    if budget == "small":
        assert s["num_blocks"] == 14 and s["num_preemptions"] > 0
        # what the trainer logs (hybrid.generator.SlotUse from Engine.stats)
        use = Generator._slot_use(SimpleNamespace(backend="builtin"), engine, len(prompts))
        assert use.metrics()["rollout/preemptions"] == s["num_preemptions"]
    else:
        assert s["num_blocks"] == 32 * 10 and s["num_preemptions"] == 0
    if case == "stop":
        assert {r.finish_reason for r in got} == {"stop", "length"}


def test_compiled_paged_steps_equal_static(model, prompts, static_refs):
    """compile and compile_prefill (aot_eager: dynamo's graphs and guards) on one engine:
    graph-shaped greedy and sampled runs with preemption and prefix hits (the three prefill
    forms: varlen, past a cached prefix, a lone group with its dummy), then eager-shaped (the
    tables at the engine's width, max_k keys); every prefill stays compiled."""
    engine = Engine(model, RolloutConfig(max_num_seqs=32, max_model_len=MAX_LEN,
                                         max_prefill_tokens=128, kv_layout="paged",
                                         block_size=4, compile=CompileMode.AOT_EAGER,
                                         compile_prefill=CompileMode.AOT_EAGER, **SMALL))
    engine.steps_in_flight = 1
    runner = engine.runner
    assert runner.compiled and runner.prefill_compiled
    for graph_shaped, case in ((True, "greedy"), (True, "sampled"), (False, "sampled")):
        params, ref = static_refs[case]
        runner.static_shapes = graph_shaped
        _assert_same(engine.generate(prompts, params), ref)
        assert engine.stats["num_preemptions"] > 0 and engine.stats["num_prefix_cached_tokens"]
    params, ref = static_refs["greedy"]
    _assert_same(engine.generate(prompts[:1], params), ref[:1])            # one group
    assert runner.prefill_compiled, "a compiled prefill fell back to eager"
    assert runner.buckets[0] == 2                          # no bucket of size 1


def test_inductor_compiles_the_graph_shaped_paged_decode_on_cpu(model, prompts, static_refs):
    """The graph-shaped paged decode step through inductor (its CPU code), with preemption:
    the static layout's greedy tokens."""
    params, ref = static_refs["greedy"]
    got, engine = _generate(model, prompts[:4], params, lag=1, graph_shaped=True,
                            kv_layout="paged", block_size=4, compile=CompileMode.INDUCTOR,
                            kv_cache_tokens=11 * 4)
    _assert_same(got, ref[:4])
    assert engine.stats["num_preemptions"] > 0


def test_few_rows_run_in_waves_and_default_block_size(model, prompts, static_refs):
    params, ref = static_refs["sampled"]
    got, engine = _generate(model, prompts, params, max_num_seqs=4, kv_layout="paged")
    _assert_same(got, ref)
    s = engine.stats
    assert s["num_slots"] == s["max_concurrent"] == 4 and s["num_waited"] > 0
    assert engine.runner.block_size == 16


def test_generate_again_and_after_free_cache(model, prompts, static_refs):
    """The prefix cache is emptied at each generate (the weights may have changed)."""
    params, ref = static_refs["greedy"]
    engine = Engine(model, RolloutConfig(max_num_seqs=8, max_model_len=MAX_LEN,
                                         max_prefill_tokens=128, kv_layout="paged",
                                         block_size=4, **SMALL))
    _assert_same(engine.generate(prompts, params), ref)
    with torch.no_grad():                    # new weights: cached K/V would be stale
        for p in model.parameters():
            p.mul_(1.5)
    try:
        scaled_ref, _ = _generate(model, prompts, params)
        _assert_same(engine.generate(prompts, params), scaled_ref)
    finally:
        with torch.no_grad():
            for p in model.parameters():
                p.div_(1.5)
    engine.free_cache()
    assert engine.runner.cache is None and engine.runner.allocator is None
    _assert_same(engine.generate(prompts, params), ref)


def test_bad_settings_one_line_errors(model):
    with pytest.raises(ValueError, match=r"^kv_layout='rows' is not one of static, paged$"):
        RolloutConfig(kv_layout="rows")
    with pytest.raises(ValueError, match=r"^block_size=0 must be an int >= 1$"):
        RolloutConfig(block_size=0)
    engine = Engine(model, RolloutConfig(max_model_len=MAX_LEN, kv_layout="paged",
                                         block_size=4, kv_cache_tokens=10 * 4))
    with pytest.raises(ValueError, match=r"kv_cache_tokens=40 holds 9 blocks .* < 10, one "
                                         r"sequence of max_model_len=40 tokens"):
        engine.generate([[1, 2]], GREEDY)


def test_scheduler_shares_blocks_keeps_rows_and_requeues_oldest_first():
    tables = BlockTables(BlockAllocator(5, 4))
    sched = PagedScheduler(tables, num_rows=4, max_prefill_tokens=64)
    prompt = [1, 2, 3, 4, 5, 6]                       # a full block and a tail of 2
    for j in range(3):
        sched.add(Sequence(j, 0, prompt, 10, 0))
    sched.add(Sequence(3, 1, [7] * 3, 10, 0))
    (group, other) = sched.schedule_prefill()
    assert [s.seq_id for s in group.seqs] == [0, 1, 2] and group.start == 0
    assert tables.tables[0][0] == tables.tables[1][0] == tables.tables[2][0]
    assert tables.allocator.num_free == 0 and [s.slot for s in other.seqs] == [3]
    for s in sched.decode_rows():                     # every tail block full
        for _ in range(4 - s.num_cached % 4):
            s.num_cached += 1
            tables.append_slot(s.seq_id)
    assert sched.must_preempt()
    out = sched.preempt()
    # the youngest first; sample 2 frees its own blocks only (its siblings hold the prompt's)
    assert [s.seq_id for s in out] == [3, 2] and sched.num_preemptions == 2
    assert tables.allocator.num_free == 2 and not sched.must_preempt()
    sched.requeue(out, [[9], [8, 8]])
    assert [s.seq_id for s in sched.waiting] == [2, 3]     # the oldest first, rows kept
    assert [s.slot for s in sched.waiting] == [2, 3] and sched.rows.num_free == 0
    tables.check()


def test_trainer_with_the_paged_layout_takes_the_static_run_s_step(tmp_path):
    """actor_rollout_ref.rollout.kv_layout=paged in a GRPO step (4 prompts x 4 samples sharing
    their prompt blocks): the same responses, hence the same rewards and losses, as static."""
    from test_lora import _lora_trainer
    from hybridengine.rl.tracking import read_metrics
    rows = {}
    for layout in ("static", "paged"):
        trainer = _lora_trainer(tmp_path / layout, "actor_rollout_ref.model.lora_rank=0",
                                f"actor_rollout_ref.rollout.kv_layout={layout}",
                                "actor_rollout_ref.rollout.block_size=4",
                                "trainer.total_training_steps=1", "trainer.logger=['console']")
        trainer.fit()
        rows[layout] = [r for r in read_metrics(tmp_path / layout / "metrics.jsonl")
                        if "actor/pg_loss" in r][0]
    keys = ("response_length/mean", "critic/score/mean", "actor/pg_loss", "actor/entropy")
    assert [rows["paged"][k] for k in keys] == [rows["static"][k] for k in keys]
    assert rows["paged"]["rollout/preemptions"] == 0


def test_bench_rollout_takes_the_paged_layout_samples_and_response_lengths(capsys):
    """tools/bench_rollout.py --kv-layout paged --n 2 --response-lengths lognormal:MEAN:SIGMA
    (CPU smoke run): per-prompt budgets from the log-normal, n samples each, the paged stats."""
    import json
    from tool_utils import load_tool
    bench = load_tool("bench_rollout")
    lengths = bench.response_lengths("lognormal:4:0.8", 64, 8)
    assert min(lengths) >= 1 and max(lengths) <= 8 and len(set(lengths)) > 3
    bench.main(["--tiny", "--kv-layout", "paged", "--n", "2", "--response-lengths",
                "lognormal:4:0.5", "--repeat", "1", "--variants", "static"])
    out = json.loads(capsys.readouterr().out)
    assert out["n"] == 2 and out["ours"]["kv_layout"] == "paged" and out["ours"]["num_blocks"]
    assert out["variants"]["static"]["kv_layout"] == "static"
    assert out["ours"]["logprob_max_abs_diff_vs_training_forward"] < 1e-4
    # the blocks held at the peak (16 tokens each) hold the distinct tokens counted then
    ours = out["ours"]
    assert ours["kv_blocks_peak"] * 16 >= ours["kv_tokens_at_peak"] > 0
    assert ours["kv_used_over_held"] >= 1
    with pytest.raises(SystemExit):
        bench.parse_args(["--response-lengths", "normal:4:1"])
    # --max-model-len: the engine's rows / the tables' width beyond prompt + response
    args = bench.parse_args(["--tiny", "--kv-layout", "paged", "--max-model-len", "96"])
    assert bench.rollout_config(args).max_model_len == 96
    assert bench.rollout_config(bench.parse_args(["--tiny"])).max_model_len == 16 + 8
    # --kv-cache-tokens: one size for either layout (static rows fewer than the sequences)
    for layout in ("static", "paged"):
        config = bench.rollout_config(bench.parse_args(
            ["--tiny", "--kv-layout", layout, "--kv-cache-tokens", "72"]))
        assert config.kv_cache_tokens == 72 and config.kv_layout == layout
    assert bench.rollout_config(bench.parse_args(["--tiny", "--kv-layout", "paged"])
                                ).kv_cache_tokens is None
    with pytest.raises(SystemExit):
        bench.parse_args(["--tiny", "--max-model-len", "23"])
