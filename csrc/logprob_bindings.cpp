// torch bindings of csrc/logprob_kernels.cu (built by torch.utils.cpp_extension, see
// hybridengine/kernels/logprob.py). Checks shapes, dtypes and devices, then launches on the
// current stream of the logits' device. Semantics: the comment at the top of the .cu file.
#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

namespace hybridengine {
cudaError_t logprob_stats_update(const void* logits, int dtype, int64_t rows, int64_t cols,
                                 int64_t n_valid, const int64_t* targets, int64_t col_offset,
                                 float inv_temp, float* m, float* s, float* d, float* zt,
                                 cudaStream_t stream);
cudaError_t logprob_grad_inplace(void* logits, int dtype, int64_t rows, int64_t cols,
                                 int64_t n_valid, const int64_t* targets, int64_t col_offset,
                                 float inv_temp, const float* log_z, const float* entropy,
                                 const float* g_logp, const float* g_ent, cudaStream_t stream);
}  // namespace hybridengine

namespace {

int dtype_code(const at::Tensor& logits) {
  switch (logits.scalar_type()) {
    case at::kFloat:
      return 0;
    case at::kHalf:
      return 1;
    case at::kBFloat16:
      return 2;
    default:
      TORCH_CHECK(false, "logits must be float32, float16 or bfloat16, got ",
                  logits.scalar_type());
  }
  return -1;
}

void check_chunk(const at::Tensor& logits, const at::Tensor& targets, int64_t n_valid) {
  TORCH_CHECK(logits.is_cuda() && logits.dim() == 2 && logits.is_contiguous(),
              "logits must be a contiguous 2-D CUDA tensor");
  TORCH_CHECK(n_valid >= 0 && n_valid <= logits.size(1), "n_valid=", n_valid,
              " outside [0, ", logits.size(1), "]");
  TORCH_CHECK(targets.device() == logits.device() && targets.scalar_type() == at::kLong &&
                  targets.is_contiguous() && targets.dim() == 1 &&
                  targets.size(0) == logits.size(0),
              "targets must be a contiguous int64 vector of ", logits.size(0),
              " ids on the logits' device");
}

float* row_vector(const at::Tensor& v, const at::Tensor& logits, const char* name) {
  TORCH_CHECK(v.device() == logits.device() && v.scalar_type() == at::kFloat &&
                  v.is_contiguous() && v.dim() == 1 && v.size(0) == logits.size(0),
              name, " must be a contiguous fp32 vector of ", logits.size(0),
              " rows on the logits' device");
  return v.data_ptr<float>();
}

void stats_update(const at::Tensor& logits, const at::Tensor& targets, int64_t col_offset,
                  int64_t n_valid, double inv_temp, const at::Tensor& m, const at::Tensor& s,
                  const at::Tensor& d, const at::Tensor& zt) {
  check_chunk(logits, targets, n_valid);
  const c10::cuda::CUDAGuard guard(logits.device());
  const cudaError_t err = hybridengine::logprob_stats_update(
      logits.data_ptr(), dtype_code(logits), logits.size(0), logits.size(1), n_valid,
      targets.data_ptr<int64_t>(), col_offset, static_cast<float>(inv_temp),
      row_vector(m, logits, "m"), row_vector(s, logits, "s"), row_vector(d, logits, "d"),
      row_vector(zt, logits, "zt"), c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "logprob_stats_update: ", cudaGetErrorString(err));
}

void grad_inplace(const at::Tensor& logits, const at::Tensor& targets, int64_t col_offset,
                  int64_t n_valid, double inv_temp, const at::Tensor& log_z,
                  const at::Tensor& entropy, const at::Tensor& g_logp, const at::Tensor& g_ent) {
  check_chunk(logits, targets, n_valid);
  const c10::cuda::CUDAGuard guard(logits.device());
  const cudaError_t err = hybridengine::logprob_grad_inplace(
      logits.data_ptr(), dtype_code(logits), logits.size(0), logits.size(1), n_valid,
      targets.data_ptr<int64_t>(), col_offset, static_cast<float>(inv_temp),
      row_vector(log_z, logits, "log_z"), row_vector(entropy, logits, "entropy"),
      row_vector(g_logp, logits, "g_logp"), row_vector(g_ent, logits, "g_ent"),
      c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "logprob_grad_inplace: ", cudaGetErrorString(err));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("stats_update", &stats_update,
             "Merge a logits chunk into the running per-row (m, s, d, zt) statistics");
  module.def("grad_inplace", &grad_inplace,
             "Overwrite a logits chunk with dL/dlogits given log Z, entropy and output grads");
}
