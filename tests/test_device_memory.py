"""hybridengine.device_memory: a reset that measures one phase alone (the rollout's prefill
probe) does not erase the run's peak from perf/max_memory_allocated_gb, and a phase's window
keeps its own peak (perf/max_memory_allocated_gb/<phase>; torch's counters faked: CPU); and
trainer.cuda_allocator's choice."""
import pytest
import torch

from hybridengine import device_memory


def test_the_peak_survives_a_phase_reset(monkeypatch):
    peak = {"now": 0}
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda i=None: peak["now"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda i=None: peak.update(now=0))
    monkeypatch.setattr(device_memory, "_carried", {})
    dev = torch.device("cuda", 0)
    peak["now"] = 7 << 30                 # the reshard
    device_memory.reset_peak(dev)         # the rollout measures its prefill alone
    peak["now"] = 3 << 30
    assert torch.cuda.max_memory_allocated(0) == 3 << 30
    assert device_memory.max_allocated(dev) == 7 << 30
    peak["now"] = 9 << 30                 # a later phase goes higher
    assert device_memory.max_allocated(dev) == 9 << 30


def _fake_counters(monkeypatch) -> dict:
    peak = {"now": 0}
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda i=None: peak["now"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda i=None: peak.update(now=0))
    monkeypatch.setattr(device_memory, "_carried", {})
    monkeypatch.setattr(device_memory, "_window", {})
    return peak


def test_a_window_keeps_its_own_peak_across_the_resets_inside_it(monkeypatch):
    peak, dev = _fake_counters(monkeypatch), torch.device("cuda", 0)
    peak["now"] = 9 << 30                 # an earlier phase
    device_memory.start_window(dev)
    peak["now"] = 5 << 30                 # the reshard
    device_memory.reset_peak(dev)         # the rollout's prefill probe
    peak["now"] = 4 << 30
    assert device_memory.window_peak(dev) == 5 << 30
    assert device_memory.max_allocated(dev) == 9 << 30      # still the process's
    device_memory.start_window(dev)
    peak["now"] = 2 << 30
    assert device_memory.window_peak(dev) == 2 << 30


def test_trainer_phases_record_their_peaks_on_cuda(monkeypatch):
    """Trainer._phase on a stand-in trainer whose device says cuda (counters faked): each
    phase's own peak in phase_peaks (train_step logs perf/max_memory_allocated_gb/<phase>)."""
    from types import SimpleNamespace

    from hybridengine.rl.guards import Phases
    from hybridengine.rl.trainer import Trainer
    peak = _fake_counters(monkeypatch)
    fake = SimpleNamespace(phases=Phases(0, 60.0), device=torch.device("cuda", 0),
                           residency=SimpleNamespace(enter=lambda name: None), phase_peaks={})
    for name, gib in (("rollout", 6), ("update_actor", 3)):
        with Trainer._phase(fake, name):
            peak["now"] = gib << 30
    assert fake.phase_peaks == {"rollout": 6 << 30, "update_actor": 3 << 30}
    fake.device = torch.device("cpu")     # off CUDA: none
    fake.phase_peaks = {}
    with Trainer._phase(fake, "ref"):
        pass
    assert fake.phase_peaks == {}


@pytest.mark.parametrize("setting, backend, environ, choice", [
    ("auto", "builtin", {}, "expandable_segments"),
    ("auto", "vllm", {}, "default"),                        # vLLM's own allocator refuses them
    ("auto", "builtin", {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:256"}, "default"),
    ("auto", "builtin", {"PYTORCH_ALLOC_CONF": "expandable_segments:False"}, "default"),
    ("auto", "builtin", {"PYTORCH_CUDA_ALLOC_CONF": ""}, "expandable_segments"),
    ("expandable_segments", "vllm", {"PYTORCH_CUDA_ALLOC_CONF": "x"}, "expandable_segments"),
    ("default", "builtin", {}, "default")])
def test_allocator_choice(setting, backend, environ, choice):
    assert device_memory.allocator_choice(setting, backend, environ) == choice


def test_configure_allocator_switches_only_cuda_to_expandable_segments(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", calls.append)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert device_memory.configure_allocator("auto", "builtin", cpu) == "expandable_segments"
    assert calls == []
    assert device_memory.configure_allocator("default", "builtin", cuda) == "default"
    assert calls == []
    assert device_memory.configure_allocator("auto", "builtin", cuda) == "expandable_segments"
    assert calls == ["expandable_segments:True"]


@pytest.mark.gpu
def test_expandable_segments_take_effect_on_cuda():
    """trainer.cuda_allocator=expandable_segments on a GPU: segments mapped after the switch are
    expandable (torch's snapshot says so); in a process of its own, since the allocator's
    settings are process-wide."""
    import subprocess
    import sys
    code = ("import torch; from hybridengine.device_memory import configure_allocator; "
            "print(configure_allocator('expandable_segments', 'builtin', torch.device('cuda', 0))); "
            "x = torch.empty(64 << 20, dtype=torch.uint8, device='cuda'); "
            "print(all(s.get('is_expandable', False) for s in torch.cuda.memory_snapshot()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["expandable_segments", "True"], out.stdout
