"""A graph pass for the rollout's compiled decode step (torch.compile, inductor backend).

Inductor folds `residual + x @ W` into one `addmm(residual, x, W)` when the sum feeds a
reduction (the next RMSNorm). On CUDA, ATen runs an addmm whose input is a full matrix as a copy
of that matrix into the output followed by a GEMM with beta = 1: a separate copy kernel per
residual add (2.7 µs per layer per decode step on an H200, bench/RESULTS.md, 2026-11-30),
where the plain add costs nothing once fused into the norm's kernel. The pass, run after
inductor's own patterns, turns such addmms back into mm + add; a bias vector's addmm (qkv) stays.
"""
from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

aten = torch.ops.aten


class SplitResidualAddmm(CustomGraphPass):
    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in list(graph.nodes):
            if node.target is not aten.addmm.default or node.kwargs or len(node.args) != 3:
                continue               # beta / alpha given: leave it as inductor wrote it
            inp, a, b = node.args
            out = node.meta.get("val")
            val = getattr(inp, "meta", {}).get("val")
            if out is None or val is None or val.shape != out.shape or val.dtype != out.dtype:
                continue               # a bias vector (broadcast): cuBLAS's epilogue adds it
            with graph.inserting_before(node):
                mm = graph.call_function(aten.mm.default, (a, b))
                mm.meta.update(node.meta)
                add = graph.call_function(aten.add.Tensor, (inp, mm))
                add.meta.update(node.meta)
            node.replace_all_uses_with(add)
            graph.erase_node(node)

    def uuid(self):
        return get_hash_for_files((__file__,))
