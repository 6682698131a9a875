"""Which trained roles run their training micro-batches in CUDA graphs (use_cuda_graph,
train.cuda_graphs), as the memory plan (rl.memory) and the start report see them: the engine
graphs a role where train.cuda_graphs.unsupported finds no reason not to, else trains it
eagerly and says why."""
from __future__ import annotations

import torch

from hybridengine.config import uses_critic
from hybridengine.train.cuda_graphs import unsupported as graphs_unsupported
from hybridengine.train.memory_advice import gib_text
from hybridengine.train.memory_plan import MemoryPlan, RoleSpec


def graphs_off(spec: RoleSpec, device: torch.device) -> str | None:
    """Why the engine trains this role eagerly although use_cuda_graph asks for graphs
    (train.cuda_graphs.unsupported), or None: its training micro-batches run in graphs."""
    lay = spec.layout
    return graphs_unsupported(spec.cfg, tp=lay.tp, pp=lay.pp, cp=lay.cp, dtype=spec.dtype,
                              device_type=device.type, recompute=spec.recompute,
                              lora=spec.lora_rank > 0,
                              offload=spec.offload)


def graph_requests(cfg) -> dict[str, bool]:
    """use_cuda_graph of each trained role of the run."""
    asked = {"actor": bool(cfg.actor_rollout_ref.actor.use_cuda_graph)}
    if uses_critic(cfg):
        asked["critic"] = bool(cfg.critic.use_cuda_graph)
    return asked


def graphs_line(cfg, plan: MemoryPlan, device: torch.device) -> str | None:
    """The training CUDA graphs' line of the start report, where a role asks for them: which
    roles run in graphs, the pool they hold in every phase, and why a role trains eagerly."""
    asked = [name for name, on in graph_requests(cfg).items() if on]
    if not asked:
        return None
    roles = plan.inputs[0]
    on = [name for name in asked if roles[name].graphed]
    pool = max((parts.get("graphs.pool", 0) for parts in plan.phases.values()), default=0)
    parts = [f"{', '.join(on)} (a pool of {gib_text(pool)} held in every phase)"] if on else []
    parts += [f"{name} eager: {graphs_off(roles[name], device)}" for name in asked
              if not roles[name].graphed]
    return "training CUDA graphs: " + "; ".join(parts)
