"""tools/profiling.py charges work to the innermost named range; bench_ppo --profile reports
every phase of a real step."""
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from tool_utils import load_tool

_tool = load_tool("profiling")  # tools/profiling.py
category, kernel_table, owner_at, timeline = _tool.category, _tool.kernel_table, _tool.owner_at, _tool.timeline
idle_gaps, host_index, launch_label = _tool.idle_gaps, _tool._host_index, _tool._launch_label
host_diagnosis = _tool.host_diagnosis


def test_work_goes_to_the_innermost_named_range(one_thread):
    x = torch.randn(128, 128)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("update"):
            for _ in range(3):
                x @ x
            with record_function("decode"):
                torch.cat([x, x])
        x + 1
    table = kernel_table(prof, ["update", "decode"])
    assert {"update", "decode", "other"} <= table.keys()
    update = {name: count for name, count, _ in table["update"]["top"]}
    assert update["aten::mm"] == 3 and "aten::cat" not in update
    assert table["update"]["by_category_ms"]["gemm"] > 0
    assert [n for n, _, _ in table["decode"]["top"]][0] == "aten::cat"
    assert "aten::add" in [n for n, _, _ in table["other"]["top"]]


def _waits_for_the_device():
    import warnings
    # what torch's sync debug mode raises at a synchronising call (CUDA only)
    warnings.warn("called a synchronizing CUDA operation")


def _busy_host():
    for _ in range(3):
        _waits_for_the_device()
    return sum(i * i for i in range(20000))


def test_host_diagnosis_names_the_slow_functions_and_the_waiting_lines():
    """host_diagnosis: functions by own and cumulative host time, and each line that
    synchronised with its callers and a count (other warnings are not counted)."""
    def step():
        import warnings
        warnings.warn("something else")
        _busy_host()
    out = host_diagnosis(step)
    cumulative = [row[0] for row in out["by_cumulative_time"]]
    assert any("_busy_host" in name for name in cumulative)
    assert out["columns"] == ["function", "calls", "own_ms", "cumulative_ms"]
    # the builtin sum spends the time; the line to change is its caller's, _busy_host
    assert out["callers_columns"] == ["caller", "calls", "own_ms"]
    (summed,) = [f for f in out["callers"] if "builtins.sum" in f]
    assert out["callers"][summed][0][0].endswith("(_busy_host)")
    (where, count), = out["syncs"].items()
    assert count == 3
    assert where.startswith("test_profiling.py:") and "(_waits_for_the_device) <- " in where
    assert "(_busy_host)" in where


def test_host_time_of_each_sub_range_per_named_range(one_thread):
    """host_ms: the host's wall time in each dotted sub-range of a named range (how long the
    host spent queueing a forward, beside how long the device waited for it), with counts."""
    x = torch.randn(256, 256)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("update_actor"):
            for _ in range(3):
                with record_function("train.forward"):
                    for _ in range(4):
                        x @ x
            with record_function("train.optimizer"):
                x.add_(1)
        with record_function("train.forward"):          # in no named range: not counted
            x @ x
    host = kernel_table(prof, ["update_actor"])["update_actor"]["host_ms"]
    assert set(host) == {"train.forward", "train.optimizer"}
    assert host["train.forward"][1] == 3 and host["train.optimizer"][1] == 1
    assert host["train.forward"][0] > host["train.optimizer"][0] > 0


def test_timeline_gives_the_innermost_span():
    # rollout [0, 100) holds decode steps [10, 20) and [30, 40); update [100, 150) follows.
    spans = [(0, 100, "rollout"), (30, 40, "decode"), (10, 20, "decode"), (100, 150, "update")]
    starts, owners = timeline(spans)
    want = {-1: None, 0: "rollout", 5: "rollout", 10: "decode", 19.9: "decode", 20: "rollout",
            35: "decode", 40: "rollout", 99: "rollout", 100: "update", 149: "update", 150: None}
    assert {t: owner_at(starts, owners, t) for t in want} == want


def test_idle_gaps_go_to_the_launcher_of_the_work_that_ends_them():
    # a [0, 10) and b [4, 12) overlap; 3 us idle before c (too short); 30 us before d; 18 before e
    items = [(4, 12, "b"), (0, 10, "a"), (15, 20, "c"), (50, 60, "train.optimizer"),
             (78, 80, "aten::copy_")]
    total, by = idle_gaps(items, min_gap_us=5)
    assert total == 48 and by == {"train.optimizer": 30, "aten::copy_": 18}
    assert idle_gaps([], 5) == (0.0, {})


def test_a_kernel_is_charged_to_the_sub_range_around_the_call_that_launched_it():
    from types import SimpleNamespace as E
    from torch.autograd import DeviceType
    cpu = dict(device_type=DeviceType.CPU, is_async=False)
    step = E(name="train.optimizer", id=1, linked_correlation_id=0, cpu_parent=None, **cpu)
    op = E(name="aten::addcdiv_", id=7, linked_correlation_id=0, cpu_parent=step, **cpu)
    bare = E(name="aten::copy_", id=8, linked_correlation_id=0, cpu_parent=None, **cpu)
    # the runtime call: the kernel's correlation id (500), nested in the op
    launch = E(name="cudaLaunchKernel", id=500, linked_correlation_id=7, cpu_parent=op, **cpu)
    # CUPTI's own host events carry id 0: a kernel without a link must not land on them
    cupti = E(name="Activity Buffer Request", id=0, linked_correlation_id=0, cpu_parent=None,
              **cpu)
    index = host_index([step, op, bare, launch, cupti])
    assert launch_label(E(id=500, linked_correlation_id=7), index) == "train.optimizer"
    # no runtime call recorded: the op the link names
    assert launch_label(E(id=501, linked_correlation_id=8), index) == "aten::copy_"
    assert launch_label(E(id=502, linked_correlation_id=0), index) == "unknown"


def test_kernel_categories():
    assert category("ncclDevKernel_AllGather_RING_LL") == "comm"
    assert category("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert category("flash_fwd_splitkv_kernel") == "attention"
    assert category("void at::native::elementwise_kernel<copy>") == "copy"
    assert category("triton_poi_fused_silu_mul_0") == "fused"
    assert category("triton_poi_fused_cat_mul_silu_silu_backward_split_0") == "fused"
    assert category("triton_red_fused__to_copy_add_index_put_0") == "fused"
    assert category("_split_kernel") == "other"


def test_bench_ppo_profiles_every_phase_with_offload(bench_ppo_tiny):
    """conftest.bench_ppo_tiny: --tiny --steps 1 --warmup 0 --profile --offload grads,optimizer
    (tests/test_bench_ppo.py reads the same run's memory plan)."""
    returncode, stderr, out = bench_ppo_tiny
    assert returncode == 0, stderr[-3000:]
    assert {"decode", "prefill", "old_log_prob", "ref", "update_actor"} <= out["profile"].keys()
    assert out["profile"]["update_actor"]["by_category_ms"]["gemm"] > 0
    # the host's time in the update loop's sub-ranges (12 or so micro-batches' worth of each)
    host = out["profile"]["update_actor"]["host_ms"]
    assert {"train.forward", "train.backward", "train.optimizer"} <= host.keys()
    assert out["mean"]["timing_s/offload"] > 0 and out["offload"] == "grads,optimizer"


def test_gc_pauses_count_and_time_each_generation_per_take():
    """GcPauses: the collections between two takes, per generation, with their milliseconds;
    a take resets them, and close() stops the counting."""
    import gc
    pauses = _tool.GcPauses()
    try:
        pauses.take()
        gc.collect(2)
        gc.collect(0)
        taken = pauses.take()
        assert taken["collections"][2] >= 1 and taken["collections"][0] >= 1
        assert taken["ms"][2] > 0 and all(ms >= 0 for ms in taken["ms"])
        assert pauses.take()["collections"][2] == 0
    finally:
        pauses.close()
    gc.collect(2)
    assert pauses.take()["collections"] == [0, 0, 0]
