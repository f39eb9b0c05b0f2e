// optimizer.cu: one AdamW step on one parameter tensor (engine/backend.h), elementwise:
//   g = grad * grad_scale;  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
//   w -= lr * ( m/(1-b1^t) / (sqrt(v/(1-b2^t)) + eps) + weight_decay * w )
// - With a master (F32): w is the master, updated in place, then rounded (nearest even)
//   into param (BF16 or F32). Without one, param must be F32 and is itself the master.
// - m, v are F32; grad is F32 (grad dtype) or BF16. Bias corrections are formed in fp64 on
//   the host; the per-element update runs in fp32.
#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace mhar::cuda {
namespace {

struct Hyper {
  float lr, b1, b2, eps, wd, grad_scale, inv_c1, inv_c2;
};

template <class TP, class TG>
__global__ void adamw_kernel(TP* param, float* master, const TG* grad, float* m, float* v,
                             int64_t n, Hyper hp) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float g = load(grad[i]) * hp.grad_scale;
    const float mi = hp.b1 * m[i] + (1.f - hp.b1) * g;
    const float vi = hp.b2 * v[i] + (1.f - hp.b2) * g * g;
    m[i] = mi;
    v[i] = vi;
    const float w = master ? master[i] : load(param[i]);
    const float update = (mi * hp.inv_c1) / (sqrtf(vi * hp.inv_c2) + hp.eps) + hp.wd * w;
    const float w_new = w - hp.lr * update;
    if (master) master[i] = w_new;
    param[i] = store<TP>(w_new);
  }
}

}  // namespace

void adamw(cudaStream_t s, Tensor param, Tensor master, Tensor grad, Tensor m, Tensor v,
           const Backend::AdamW& hp) {
  const int64_t n = param.numel();
  check_numel(grad, n, "adamw", "grad");
  check_numel(m, n, "adamw", "m");
  check_numel(v, n, "adamw", "v");
  check_dtype(m, DType::F32, "adamw", "m");
  check_dtype(v, DType::F32, "adamw", "v");
  if (master.empty()) {
    check_dtype(param, DType::F32, "adamw (no master)", "param");
  } else {
    check_numel(master, n, "adamw", "master");
    check_dtype(master, DType::F32, "adamw", "master");
  }
  MHAR_CHECK(hp.step >= 1, "adamw step ", hp.step, " (counts from 1)");
  if (n == 0) return;
  const double c1 = 1.0 - std::pow(hp.beta1, double(hp.step));
  const double c2 = 1.0 - std::pow(hp.beta2, double(hp.step));
  const Hyper h{float(hp.lr), float(hp.beta1), float(hp.beta2), float(hp.eps),
                float(hp.weight_decay), float(hp.grad_scale), float(1.0 / c1), float(1.0 / c2)};
  float* master_ptr = master.empty() ? nullptr : master.ptr<float>();
  dispatch_float(param.dtype, "adamw", [&](auto tp) {
    dispatch_float(grad.dtype, "adamw", [&](auto tg) {
      using TP = decltype(tp);
      using TG = decltype(tg);
      adamw_kernel<TP, TG><<<grid_stride_blocks(n, 256), 256, 0, s>>>(
          static_cast<TP*>(param.data), master_ptr, static_cast<const TG*>(grad.data),
          m.ptr<float>(), v.ptr<float>(), n, h);
      CUDA_CHECK_LAUNCH();
    });
  });
}

}  // namespace mhar::cuda
