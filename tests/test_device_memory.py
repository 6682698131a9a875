"""hybridengine.device_memory: a reset that measures one phase alone (the rollout's prefill
probe) does not erase the run's peak from perf/max_memory_allocated_gb (torch's counters faked:
CPU)."""
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
