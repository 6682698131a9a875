// The CUDA kernel of hybridengine::accumulate_wgrad (gradient-accumulation fusion): the op, its
// schema and its CPU kernel are declared in hybridengine/parallel/wgrad_accumulation.py; this
// file registers the CUDA one (built by torch.utils.cpp_extension: hybridengine/kernels/wgrad.py).
// In C++ because the compiled layers' backward calls the op once per linear layer and
// micro-batch: through the Python kernel a call cost 31.5 us of host time on an H200 host, 21
// through this one, against ~25-28 us of device time for the small products (bench/RESULTS.md
// session 32).
//
//   main_grad[out, in] += grad_output[..., out]^T . x[..., in]
// in one cuBLAS call: beta = 1 on main_grad itself, bf16 / fp16 products into an fp32
// main_grad through addmm's out_dtype (the loader checks first that this torch takes an fp32 C).
#include <ATen/ATen.h>
#include <torch/library.h>

namespace {

void accumulate_wgrad_cuda(at::Tensor& main_grad, const at::Tensor& grad_output,
                           const at::Tensor& x) {
  const at::Tensor g = grad_output.reshape({-1, grad_output.size(-1)});
  const at::Tensor x2 = x.reshape({-1, x.size(-1)});
  TORCH_CHECK(main_grad.dim() == 2 && main_grad.size(0) == g.size(1) &&
                  main_grad.size(1) == x2.size(1) && g.size(0) == x2.size(0),
              "accumulate_wgrad: main_grad ", main_grad.sizes(), " for grad_output ",
              grad_output.sizes(), " and input ", x.sizes());
  if (g.scalar_type() == main_grad.scalar_type()) {
    main_grad.addmm_(g.t(), x2);
  } else {
    at::addmm_out(main_grad, main_grad, g.t(), x2, main_grad.scalar_type());
  }
}

}  // namespace

// CUDA; a CPU build for the CPU-only CI's test of this file (-DHYBRIDENGINE_WGRAD_KEY=CPU, in a
// process of its own: tests/test_wgrad_fusion.py)
#ifndef HYBRIDENGINE_WGRAD_KEY
#define HYBRIDENGINE_WGRAD_KEY CUDA
#endif

TORCH_LIBRARY_IMPL(hybridengine, HYBRIDENGINE_WGRAD_KEY, m) {
  m.impl("accumulate_wgrad", &accumulate_wgrad_cuda);
}
