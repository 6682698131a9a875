"""Sharded checkpoints: exact resume of DistributedOptimizer training in fresh processes, RNG
restore, atomic publish (a save that dies half-way keeps the previous one), layout errors."""
import json
import random

import numpy as np
import pytest
import torch
from torch import nn

from dist_utils import run_dist
from hybridengine.train.checkpoint import (LATEST, begin_checkpoint, checkpoint_dir,
                                              find_latest, load_checkpoint, save_checkpoint,
                                              write_rank_state)
from hybridengine.train.optimizer import DistributedOptimizer


pytestmark = pytest.mark.usefixtures("one_thread")


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_round_trip_tensors_meta_and_rng(tmp_path):
    tensors = {"w": torch.randn(3, 4), "h": torch.randn(5).to(torch.bfloat16),
               "ids": torch.arange(7), "view": torch.arange(10.0)[2:6]}
    tensors["alias"] = tensors["w"]                          # same storage twice
    meta = {"step": 3, "sampler": {"epoch": 1, "index": 17}, "kl_coef": 0.02}
    save_checkpoint(tmp_path, 3, tensors, meta)
    expected = _draws()
    _draws()                                                 # move every generator on
    loaded, loaded_meta = load_checkpoint(tmp_path)
    assert _draws() == expected                              # RNG restored
    assert loaded_meta == meta and loaded.keys() == tensors.keys()
    for k, v in tensors.items():
        assert loaded[k].dtype == v.dtype and torch.equal(loaded[k], v), k
    assert find_latest(tmp_path) == 3 and (tmp_path / LATEST).read_text() == "3"
    record = json.loads((checkpoint_dir(tmp_path, 3) / "state" / "rank_00000.json").read_text())
    assert record["meta"] == meta and "torch_cpu" in record["rng"]


def test_pointer_pruning_and_layout_errors(tmp_path):
    assert find_latest(tmp_path) is None
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, {"w": torch.full((2, 3), float(step))}, {"step": step},
                        max_to_keep=2)
    assert find_latest(tmp_path) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_2", "global_step_3", LATEST]
    tensors, _ = load_checkpoint(checkpoint_dir(tmp_path, 2), restore_rng_state=False)
    assert torch.equal(tensors["w"], torch.full((2, 3), 2.0))
    with pytest.raises(ValueError, match=r"tensor w has shape \[2, 3\] in the checkpoint, "
                                         r"\[3, 3\] in the model"):
        load_checkpoint(tmp_path, like={"w": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match=r"tensor v \[4\] of the model is missing"):
        load_checkpoint(tmp_path, like={"w": (2, 3), "v": (4,)})
    with pytest.raises(ValueError, match=r"tensor w \[2, 3\] of the checkpoint is not in"):
        load_checkpoint(tmp_path, like={})
    with pytest.raises(ValueError, match="not JSON-serialisable"):
        save_checkpoint(tmp_path, 4, {}, {"bad": object()})
    assert find_latest(tmp_path) == 3
    (tmp_path / LATEST).write_text("7")
    with pytest.raises(FileNotFoundError, match="names step 7"):
        load_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        load_checkpoint(tmp_path / "nowhere")


# --- exact resume across processes (2 DP ranks, ZeRO-1) -----------------------------------------

def _setup(rank):
    from hybridengine.parallel.layout import Layout
    from hybridengine.parallel.mesh import build_mesh
    mesh = build_mesh(Layout(1, 1, 2))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))
    opt = DistributedOptimizer(list(model.named_parameters()), mesh.dp_group, mesh.mp_group,
                               lr=1e-2, weight_decay=0.1, grad_clip=1.0, bucket_mb=0.002,
                               use_distributed_optimizer=True)
    return model, opt, mesh.world_group       # the ranks that save together


def _train(model, opt, num_steps):
    """Every RNG feeds the data, so a resume without RNG restore would diverge."""
    for _ in range(num_steps):
        opt.zero_grad()
        x = torch.randn(4, 16) * (1 + random.random()) + float(np.random.rand())
        (model(x).square().sum() / 8).backward()
        opt.step()


def _state(model, opt):
    tensors, meta = opt.state_dict()
    tensors = {f"optim.{k}": v for k, v in tensors.items()}
    tensors.update({f"model.{k}": v for k, v in model.state_dict().items()})
    return tensors, {"optim": meta}


def _save_killed_halfway(root, step, tensors, meta, group):
    tmp = begin_checkpoint(root, step, group)
    write_rank_state(tmp, tensors, meta, group=group)       # the state is written ...
    raise RuntimeError("killed while writing the HF directory")     # ... the commit never runs


def _first_run(rank, world, root):
    model, opt, group = _setup(rank)
    torch.manual_seed(100 + rank), random.seed(rank), np.random.seed(rank)
    _train(model, opt, 2)
    tensors, meta = _state(model, opt)
    save_checkpoint(root, 2, tensors, meta, group=group)
    _train(model, opt, 2)
    save_checkpoint(f"{root}/final", 4, dict(model.state_dict()), {}, rng=False, group=group)

    # A save that dies between writing files: `latest` stays on step 2, which still loads.
    with pytest.raises(RuntimeError, match="killed"):
        _save_killed_halfway(root, 5, tensors, meta, group)
    tmp = checkpoint_dir(root, 5).with_name("global_step_5.tmp")
    assert find_latest(root) == 2 and tmp.is_dir()
    load_checkpoint(root, like=tensors, restore_rng_state=False, group=group)
    # The next save cleans the stale temp dir.
    save_checkpoint(root, 6, {"x": torch.zeros(1)}, {}, max_to_keep=None, group=group)
    assert not tmp.exists() and find_latest(root) == 6


def _resumed_run(rank, world, root):
    model, opt, group = _setup(rank)
    torch.manual_seed(999), random.seed(999), np.random.seed(999)     # overwritten by the load
    like = _state(model, opt)[0]
    tensors, meta = load_checkpoint(checkpoint_dir(root, 2), like=like, group=group)
    model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
    opt.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("optim.")},
                        meta["optim"], publish=False)
    assert opt.num_steps == 2
    _train(model, opt, 2)
    final, _ = load_checkpoint(f"{root}/final", restore_rng_state=False, group=group)
    for k, v in model.state_dict().items():
        assert torch.equal(v, final[k]), k


@pytest.mark.multiproc
def test_resume_in_fresh_processes_is_bit_exact(tmp_path):
    root = str(tmp_path / "ckpt")
    run_dist(_first_run, 2, root)
    assert find_latest(root) == 6
    assert sorted(p.name for p in (checkpoint_dir(root, 2) / "state").iterdir()) == [
        "rank_00000.json", "rank_00000.safetensors", "rank_00001.json", "rank_00001.safetensors"]
    run_dist(_resumed_run, 2, root)
    with pytest.raises(ValueError, match="saved by 2 ranks, this run has 1"):
        load_checkpoint(checkpoint_dir(root, 2))
