"""The C++ CUDA kernel of the gradient-accumulation fusion's op (hybridengine::accumulate_wgrad,
parallel/wgrad_accumulation.py): csrc/wgrad_accumulation.cpp, JIT-built on first use like the
log-prob kernels (kernels/logprob.py). Registered, it serves the op's CUDA calls without Python
(on an H200 host, 21 µs of host time a call against the Python kernel's 31.5: bench/RESULTS.md
session 32); where it cannot be built, the Python kernel serves them (one warning line)."""
from __future__ import annotations

import logging
import os

import torch

from hybridengine.kernels.logprob import CSRC
from hybridengine.parallel.wgrad_accumulation import dtype_out_accumulates

logger = logging.getLogger(__name__)
_LOADED: bool | None = None


def load_wgrad_kernel(dtype: torch.dtype) -> bool:
    """Register the C++ CUDA kernel (once per process; the build cached by torch under
    TORCH_EXTENSIONS_DIR). Only where this torch's addmm.dtype_out accumulates `dtype`
    products into an fp32 C (the kernel relies on it; probed here, at set-up, for the Python
    kernel too), and not with HYBRIDENGINE_NO_CUDA_KERNELS=1. Returns whether the C++ kernel
    serves the op now."""
    global _LOADED
    device = torch.device("cuda", torch.cuda.current_device())
    fused_gemm = dtype == torch.float32 or dtype_out_accumulates(device, dtype, torch.float32)
    if _LOADED is None:
        _LOADED = False
        if os.environ.get("HYBRIDENGINE_NO_CUDA_KERNELS") == "1" or not fused_gemm:
            return False
        from torch.utils.cpp_extension import load
        try:
            load(name="hybridengine_wgrad",
                 sources=[os.path.join(CSRC, "wgrad_accumulation.cpp")],
                 extra_cflags=["-O3"], is_python_module=False,
                 verbose=os.environ.get("HYBRIDENGINE_VERBOSE_BUILD") == "1")
            _LOADED = True
        except Exception as e:      # any build failure: one line, then the Python kernel
            msg = str(e).strip().splitlines()
            logger.warning("hybridengine: the C++ gradient-accumulation kernel is unavailable, "
                           "using the Python one (%s: %s)", type(e).__name__,
                           msg[-1] if msg else "")
    return _LOADED
