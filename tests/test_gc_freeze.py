"""trainer.gc_freeze_freq (rl.gc_freeze): full collections only between steps, what is alive then
frozen out of Python's later collections, and frozen cycles collected again every freq steps."""
import gc
import weakref

import pytest

from hybridengine.rl.gc_freeze import GcFreeze


@pytest.fixture(autouse=True)
def unfrozen():
    yield
    gc.unfreeze()        # the rest of the test process collects as before


class Node:
    pass


def _cycle() -> tuple[Node, weakref.ref]:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return a, weakref.ref(a)


def test_due_at_the_first_step_at_compiling_steps_and_every_freq_steps():
    policy = GcFreeze(freq=5)
    due = []
    for step, compile_s in [(1, 0.0), (2, 0.0), (3, 4.5), (4, 0.0), (5, 0.0), (6, 0.0), (10, 0.0)]:
        if policy.due(step, compile_s):
            due.append(step)
            policy.after_step(step, compile_s)
    assert due == [1, 3, 5, 10]
    assert not any(GcFreeze(freq=0).due(s, 9.0) for s in (1, 2, 100))


def test_alive_objects_leave_the_collected_generations_and_later_garbage_is_collected():
    policy = GcFreeze(freq=100)
    kept = Node()
    metrics = policy.after_step(1, 0.0)
    assert metrics["perf/gc_frozen_objects"] == gc.get_freeze_count() > 0
    assert metrics["timing_s/gc_freeze"] >= 0
    assert not any(o is kept for o in gc.get_objects())      # frozen: no collection scans it
    # garbage made after the freeze is Python's automatic collector's as before
    node, ref = _cycle()
    del node
    gc.collect()
    assert ref() is None
    assert policy.after_step(2, 0.0) == {}                   # not due: nothing runs


def test_a_frozen_object_that_becomes_cyclic_garbage_waits_until_the_next_due_step():
    policy = GcFreeze(freq=3)
    node, ref = _cycle()
    policy.after_step(1, 0.0)                # frozen while alive
    del node
    gc.collect()
    assert ref() is not None                 # the bound the docstring states: not collected yet
    policy.after_step(2, 0.0)
    assert ref() is not None
    policy.after_step(3, 0.0)                # due: unfrozen, collected, what lives frozen again
    assert ref() is None


def test_close_gives_the_objects_back_to_the_collector():
    policy = GcFreeze(freq=100)
    policy.after_step(1, 0.0)
    assert gc.get_freeze_count() > 0
    policy.close()
    assert gc.get_freeze_count() == 0


def test_the_trainer_freezes_after_its_first_step_and_fit_unfreezes(tmp_path):
    from tests.test_temperature import tiny_trainer
    trainer = tiny_trainer(tmp_path / "run", "trainer.total_training_steps=2")
    first = trainer.train_step(1, [0, 1, 2, 3], lambda: None)
    second = trainer.train_step(2, [0, 1, 2, 3], lambda: None)
    assert first["perf/gc_frozen_objects"] > 0 and "timing_s/gc_freeze" in first
    assert "timing_s/gc_freeze" not in second            # nothing compiled: not due
    off = tiny_trainer(tmp_path / "off", "trainer.gc_freeze_freq=0")
    gc.unfreeze()
    assert "timing_s/gc_freeze" not in off.train_step(1, [0, 1, 2, 3], lambda: None)
    assert gc.get_freeze_count() == 0
    trainer.fit()                      # resumes nothing (no checkpoint), runs to its 2 steps
    assert gc.get_freeze_count() == 0
