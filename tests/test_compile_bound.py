"""Compilation stays bounded: the rollout's compiled steps (decode, its sampler bookkeeping,
prefill) over a run-like sequence of generate calls, and the compiled training layers over
packed micro-batches of varying length, compile the graphs documented in
hybridengine/rollout/compile_steps.py (and hybridengine/train/engine.py) at the first call and never
again. On the CPU with aot_eager (dynamo's graphs and guards, no inductor); the gpu variant runs
inductor in CUDA graphs. Also: hybridengine.compiling.CompileWatch (timing_s/compile and the
late-compilation warning)."""
from dataclasses import replace

import pytest
import torch
from torch._dynamo.utils import counters

from hybridengine.compiling import CompileWatch, _records, _runtime, compile_fn, describe
from hybridengine.models.hf import load_decoder
from hybridengine.rollout.engine import Engine
from hybridengine.rollout.model_runner import MAX_COMPILED_GRAPHS
from hybridengine.rollout.rollout_config import CompileMode, RolloutConfig
from hybridengine.rollout.sampling import SamplingParams
from model_utils import STORIES
from test_rollout import _prompts

STOP = (426, 419)       # frequent stories260k tokens: most responses stop early, at varied steps


def _calls(vocab: int, stop=STOP) -> list[tuple[str, list, SamplingParams]]:
    """A run's generate calls: GSM8K-like varied prompt lengths, n = 4 training batches,
    a partial last batch of one prompt, greedy validation (n = 1, also a single prompt), top-p
    and top-k sampling, another max_tokens, more sequences than cache slots (prefills of one or
    two rows as responses stop)."""
    def p(lens, seed):
        return _prompts(lens, vocab, seed=seed)

    def sampled(seed, **kw):
        return SamplingParams(**{"n": 4, "temperature": 1.0, "max_tokens": 24,
                                 "stop_token_ids": stop, "seed": seed, **kw})
    greedy = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=stop)
    return [("train", p([12, 20, 7, 33], 1), sampled(1)),
            ("train", p([9, 25, 14, 30], 2), sampled(2)),
            ("partial batch", p([17], 3), sampled(3)),
            ("validation", p([11, 19, 23, 8, 5, 40], 4), greedy),
            ("validation, one prompt", p([11], 5), greedy),
            ("top-p", p([10, 21, 6], 6), sampled(4, n=2, temperature=0.7, top_p=0.9)),
            ("top-k", p([13, 4, 26], 7), sampled(5, n=2, top_k=20)),
            ("max_tokens", p([15, 12, 18], 8), sampled(6, max_tokens=60)),
            ("slots refilled", p([5 + 3 * i for i in range(12)], 9), sampled(7, n=3)),
            ("train", p([22, 13, 8, 31], 10), sampled(8))]


def _run(engine: Engine, calls) -> tuple[int, int, list[str], list]:
    """(graphs after the first call, graphs at the end, late compilations, results)."""
    watch = CompileWatch(warmup_polls=1)
    first, late, results = None, [], []
    for i, (_, prompts, params) in enumerate(calls + calls[:1]):
        if i == len(calls):         # once more after free_cache(): another slot count
            slots = engine.runner.num_slots
            engine.free_cache()
            engine.runner.config = replace(engine.runner.config,
                                           kv_cache_tokens=(slots // 2 + 1) * engine.max_model_len)
        results.append(engine.generate(prompts, params))
        first = first if first is not None else counters["stats"]["unique_graphs"]
        late += watch.poll().late
    return first, counters["stats"]["unique_graphs"], late, results


def test_rollout_compiles_a_bounded_set_of_graphs_at_the_first_generate(one_thread):
    """compile + compile_prefill (aot_eager) with the dense prefill attention and graph-shaped
    decode steps: MAX_COMPILED_GRAPHS at the first generate (both prefill forms), none after,
    through varied prompt lengths, batch sizes, sampler modes, max_tokens and slot counts."""
    torch._dynamo.reset()
    counters.clear()
    model = load_decoder(STORIES)
    engine = Engine(model, RolloutConfig(max_num_seqs=16, max_model_len=96, max_prefill_tokens=256,
                                         kv_cache_tokens=17 * 96, compile=CompileMode.AOT_EAGER,
                                         compile_prefill=CompileMode.AOT_EAGER,
                                         prefill_attention="dense"))
    engine.runner.static_shapes = True          # the CUDA-graph shapes, without capture
    first, last, late, results = _run(engine, _calls(512))
    assert first == last == MAX_COMPILED_GRAPHS, (first, last)
    assert late == []
    assert engine.runner.prefill_compiled       # no eager fallback
    reasons = {r.finish_reason for batch in results for r in batch}
    assert reasons == {"stop", "length"}   # varied lengths: the decode batch shrinks by buckets


def test_compile_watch_reports_seconds_and_late_compilations_with_their_cause():
    torch._dynamo.reset()
    f = compile_fn(lambda x: x * 2 + 1, backend="aot_eager")
    watch = CompileWatch(warmup_polls=1)
    f(torch.ones(3))
    warm = watch.poll()
    assert warm.seconds > 0 and warm.late == []          # the warm-up's compilation: expected
    f(torch.ones(3))
    assert watch.poll().seconds == 0.0
    f(torch.ones(2, 3))                                  # another rank: compiles again
    late = watch.poll().late
    assert len(late) == 1 and "rank mismatch" in late[0] and "test_compile_bound.py" in late[0]


def test_generator_reports_compile_time_and_warns_after_the_first_step(capsys):
    """The trainer's per-step metrics (Generator.pop_metrics): timing_s/compile (0 when the step
    compiled nothing); one warning line on rank 0 for a compilation after the first step."""
    from types import SimpleNamespace
    from hybridengine.hybrid.generator import Generator
    torch._dynamo.reset()
    gen = Generator.__new__(Generator)
    gen.hybrid = SimpleNamespace(pop_metrics=dict)
    gen.mesh, gen.compile_watch = SimpleNamespace(rank=0), CompileWatch(warmup_polls=1)
    f = compile_fn(lambda x: x + 1, backend="aot_eager")
    f(torch.ones(3))
    assert gen.pop_metrics()["timing_s/compile"] > 0
    f(torch.ones(3))
    assert gen.pop_metrics() == {"timing_s/compile": 0.0}
    f(torch.ones(2, 2))
    assert gen.pop_metrics()["timing_s/compile"] > 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith(
        "warning: torch.compile compiled again after the first step: <lambda> "
        "(test_compile_bound.py:") and "rank mismatch" in out[0]


def _training_graphs(model, device: str, compile_backend: str | None,
                     group: int | None = None) -> int:
    """Dynamo graphs of the compiled decoder layers of a TrainEngine over forward-only and
    training micro-batches of varying T (one sequence, two tokens, many sequences; with
    activation recomputation every other step). compile_backend: compile the layers as the
    engine does, with that backend (None: the engine's own setup, CUDA only)."""
    from hybridengine.train.compile_layers import compile_decoder_layers
    from hybridengine.train.engine import MicroBatch, OptimConfig, TrainEngine
    from hybridengine.models.attention import PackedInput
    from hybridengine.parallel.layout import Layout
    from hybridengine.parallel.mesh import build_mesh
    torch._dynamo.reset()
    counters.clear()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    engine = TrainEngine(model, build_mesh(Layout(1, 1, 1)), optim=OptimConfig(lr=1e-3),
                         dtype=dtype, device=device, compile_layers=compile_backend is None)
    if compile_backend is not None:
        compile_decoder_layers(engine.model, backend=compile_backend, group=group)
    g = torch.Generator().manual_seed(0)

    def micro(lens):
        ids = torch.randint(0, 512, (sum(lens),), generator=g).to(device)
        mask = torch.ones(len(ids), device=device)
        return MicroBatch(PackedInput.from_lengths(ids, lens),
                          {"targets": torch.roll(ids, -1), "mask": mask})

    def loss_fn(out, mb):
        loss = -(out["logprob"] * mb.tensors["mask"]).mean()
        return loss, {"loss": loss.detach()}
    for i, lens in enumerate([[5, 9, 13], [40], [2], [11, 11], [64, 1, 3], [8] * 8]):
        engine.model.recompute_layers = i % 2 == 1
        engine.forward_only([micro(lens)])
        engine.train_step([micro(lens), micro(lens[::-1])], loss_fn)
    return counters["stats"]["unique_graphs"]


def test_training_layers_compile_once_per_grad_mode(one_thread):
    """The decoder layers compiled as the TrainEngine compiles them (dynamic=True; aot_eager
    here): one graph per grad mode (forward-only, training) for every micro-batch length."""
    assert _training_graphs(STORIES, "cpu", "aot_eager") == 2


def test_grouped_layers_compile_once_per_grad_mode_and_group_size(one_thread):
    """compile_decoder_layers(group=k): the units of k layers share one graph per grad mode,
    the shorter last unit one more (stories260K's 5 layers: 2 + 2 + 1); all 5 at once, one per
    grad mode. (The recomputing steps run the layers uncompiled: no graph of theirs.)"""
    from hybridengine.models.hf_config import read_model_config
    assert read_model_config(STORIES).num_layers == 5
    assert _training_graphs(STORIES, "cpu", "aot_eager", group=2) == 4
    assert _training_graphs(STORIES, "cpu", "aot_eager", group=5) == 2


def test_grouped_layers_train_as_the_per_layer_units(one_thread, monkeypatch):
    """Three AdamW steps of stories260K with its layers compiled in groups of 2 (aot_eager), the
    group size read from HYBRIDENGINE_TRAIN_LAYER_GROUP: the same losses and weights, bit for
    bit, as per-layer units; the state dict keeps the layers' own names."""
    from hybridengine.models.attention import PackedInput
    from hybridengine.parallel.layout import Layout
    from hybridengine.parallel.mesh import build_mesh
    from hybridengine.train.compile_layers import compile_decoder_layers
    from hybridengine.train.engine import MicroBatch, OptimConfig, TrainEngine
    runs = {}
    for group in ("1", "2"):
        torch._dynamo.reset()
        monkeypatch.setenv("HYBRIDENGINE_TRAIN_LAYER_GROUP", group)
        engine = TrainEngine(STORIES, build_mesh(Layout(1, 1, 1)), optim=OptimConfig(lr=1e-2),
                             dtype=torch.float32, device="cpu", compile_layers=False)
        compile_decoder_layers(engine.model, backend="aot_eager")
        assert (engine.model.layer_groups is None) == (group == "1")
        g = torch.Generator().manual_seed(0)
        losses = []
        for lens in ([5, 9, 13], [40], [11, 11]):
            ids = torch.randint(0, 512, (sum(lens),), generator=g)
            mb = MicroBatch(PackedInput.from_lengths(ids, lens),
                            {"targets": torch.roll(ids, -1)})
            m = engine.train_step([mb], lambda out, mb: (-out["logprob"].mean(), {}))
            losses.append(engine.forward_only([mb])[0]["logprob"].sum().item())
            assert m["stepped"] == 1.0
        runs[group] = (losses, engine.model.state_dict())
    assert runs["1"][0] == runs["2"][0]
    assert runs["1"][1].keys() == runs["2"][1].keys()
    assert all(torch.equal(runs["1"][1][k], runs["2"][1][k]) for k in runs["1"][1])


def test_gemma2_layers_compile_once_per_grad_mode_and_layer_kind(one_thread):
    """Gemma 2's capped attention is a custom op (models.spec_attention) the compiled layer
    traces through: no graph per packing nor per layer index (its earlier per-sequence torch
    loop broke the graph there: 23 graphs for 2 such layers over these micro-batches, hitting
    dynamo's recompile limit), one per grad mode and layer kind (sliding, full)."""
    from hybridengine.models.decoder import ModelConfig
    cfg = ModelConfig(vocab_size=512, num_layers=4, tie_word_embeddings=True, hidden_size=64,
                      intermediate_size=128, num_heads=4, num_kv_heads=1, head_dim=16,
                      model_type="gemma2", hidden_act="gelu_pytorch_tanh",
                      query_pre_attn_scalar=16, attn_softcap=50.0, final_softcap=30.0,
                      sliding_window=8, layer_types=("sliding_attention", "full_attention") * 2)
    assert _training_graphs(cfg, "cpu", "aot_eager") == 4


@pytest.mark.gpu
def test_training_layers_compile_once_per_grad_mode_on_cuda():
    """The same with the engine's own setup on CUDA (inductor, bf16, flash varlen attention)."""
    from test_rollout_gpu import SMALL
    assert _training_graphs(SMALL, "cuda", None) == 2


@pytest.mark.gpu
def test_grouped_training_layers_compile_once_per_grad_mode_on_cuda(monkeypatch):
    """The engine's own setup on CUDA with HYBRIDENGINE_TRAIN_LAYER_GROUP=4 (SMALL's 4 layers in
    one unit): inductor (C++ wrapper), bf16, flash attention; one graph per grad mode."""
    from test_rollout_gpu import SMALL
    monkeypatch.setenv("HYBRIDENGINE_TRAIN_LAYER_GROUP", "4")
    assert _training_graphs(SMALL, "cuda", None) == 2


@pytest.mark.gpu
def test_rollout_compiles_a_bounded_set_of_graphs_on_cuda():
    """The same calls with inductor, CUDA graphs and bf16 (the CUDA defaults) on a random
    Qwen2-shaped model (head_dim 64: the triton decode attention, the dense prefill): every
    graph at the first generate, no compilation after it."""
    from hybridengine.models.decoder import Decoder
    from test_rollout_gpu import SMALL
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Decoder(SMALL, dtype=torch.bfloat16, device=torch.device("cuda"))
    engine = Engine(model, RolloutConfig(max_num_seqs=16, max_model_len=96, max_prefill_tokens=256,
                                         kv_cache_tokens=17 * 96, compile=CompileMode.INDUCTOR,
                                         compile_prefill=CompileMode.INDUCTOR))
    # 16 stop tokens of 1000: about a third of the random model's responses stop early
    first, last, late, _ = _run(engine, _calls(SMALL.vocab_size, stop=tuple(range(3, 19))))
    assert engine.runner.use_graphs and engine.runner.prefill_compiled
    # every compiled frame, in the report of a failure (captured output is never truncated)
    print("\n".join(describe(r) for r in _records() if not _runtime(r)))
    assert first == last <= MAX_COMPILED_GRAPHS and late == [], (first, last, late)


def test_training_inductor_options_take_the_environment_override(monkeypatch):
    """The training layers' inductor options: the C++ wrapper on by default (not with Gemma 2's
    soft-capped attention); the benchmarks' HYBRIDENGINE_TRAIN_INDUCTOR_OPTIONS (a JSON object)
    overrides or adds, and anything else is one error naming the variable."""
    from hybridengine.train.compile_layers import (TRAIN_INDUCTOR_OPTIONS_ENV,
                                                   training_inductor_options)
    from hybridengine.models.decoder import ModelConfig
    monkeypatch.delenv(TRAIN_INDUCTOR_OPTIONS_ENV, raising=False)
    assert training_inductor_options()["cpp_wrapper"] is True
    plain = ModelConfig(vocab_size=64, num_layers=1, hidden_size=16, intermediate_size=32,
                        num_heads=2, num_kv_heads=1, head_dim=8)
    assert training_inductor_options(plain)["cpp_wrapper"] is True
    capped = replace(plain, attn_softcap=50.0)
    assert training_inductor_options(capped)["cpp_wrapper"] is False     # Gemma 2: not tried
    assert training_inductor_options(plain, cuda=False)["cpp_wrapper"] is False
    monkeypatch.setenv(TRAIN_INDUCTOR_OPTIONS_ENV, '{"cpp_wrapper": false, "max_autotune": true}')
    options = training_inductor_options()
    assert options["cpp_wrapper"] is False and options["max_autotune"] is True
    for bad in ("{cpp_wrapper: true}", "[1, 2]"):
        monkeypatch.setenv(TRAIN_INDUCTOR_OPTIONS_ENV, bad)
        with pytest.raises(ValueError, match=TRAIN_INDUCTOR_OPTIONS_ENV):
            training_inductor_options()


def test_compile_breakdown_names_each_compilation_and_its_parts():
    """compiling.compile_breakdown: a line per compilation record, this function's frame among
    them with dynamo's and AOTAutograd's seconds."""
    from hybridengine.compiling import compile_breakdown

    def doubled_sine(x):
        return x.sin() * 2
    compile_fn(doubled_sine, backend="aot_eager")(torch.randn(4))
    lines = [line for line in compile_breakdown() if line.startswith("doubled_sine")]
    assert lines and "[frame; dynamo" in lines[-1] and "aot" in lines[-1], lines


def test_compile_timers_sum_the_timed_steps_longest_first():
    """compiling.compile_timers: torch's timed compilation steps, seconds summed over the
    process, longest first; dynamo's top-level step covers the AOT one inside it."""
    from hybridengine.compiling import compile_timers

    def tripled_cosine(x):
        return x.cos() * 3
    compile_fn(tripled_cosine, backend="aot_eager")(torch.randn(4))
    timers = compile_timers(min_seconds=0.0)
    seconds = list(timers.values())
    assert seconds == sorted(seconds, reverse=True) and all(s >= 0 for s in seconds)
    assert timers["_compile.compile_inner"] >= timers["create_aot_dispatcher_function"] > 0
    assert all(s >= 0.5 for s in compile_timers().values())
