// Fused Adam/AdamW update over flat fp32 buffers.
//
// One pass reads the gradient (fp32, bf16 or fp16), the fp32 master weights
// and both fp32 moments, updates the three in place and, when asked, writes
// the new master rounded to bf16 or fp16 (round to nearest even). Fusing the
// gradient widening and the low-precision copy into the update is what makes
// the offload step cheaper than a peer's three passes: the update is bound by
// memory bandwidth, not arithmetic.
//
// The arithmetic mirrors torch.optim.Adam/AdamW (single-tensor path):
//   adam  (L2):      g <- g + wd * p
//   adamw (decoupled): p <- p * (1 - lr * wd)
//   m <- lerp(m, g, 1 - beta1) = m + (1 - beta1) * (g - m)
//   v <- beta2 * v + ((1 - beta2) * g) * g
// (lerp as torch evaluates it, so an inf gradient turns m into NaN on the
// next step exactly as in torch, rather than staying inf)
//   p <- p - step_size * m / (sqrt(v) * inv_bias2_sqrt + eps)
// with step_size = lr / (1 - beta1^t) and inv_bias2_sqrt = 1 / sqrt(1 - beta2^t)
// (both 1 without bias correction), computed once in double by the caller.
// Multiplying by the reciprocal (torch divides) differs from torch by at most
// an ulp of the denominator and saves a division per element: the division
// and square root units, not memory, bound this kernel once data is in cache.
#pragma once

#include <cstddef>
#include <algorithm>
#include <cstdint>

#include "../common/cpu_features.h"

namespace offload {

enum class ElementType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

const char* element_type_name(ElementType t);

struct AdamParams {
  // 1 - beta is passed in, computed in double: 1.0f - 0.999f is off from
  // 0.001 by 1.3e-5 relative, which torch (computing it in double) is not.
  float beta1, beta2, one_minus_beta1, one_minus_beta2, eps;
  float step_size;    // lr / bias_correction1
  float inv_bias2_sqrt;  // 1 / sqrt(bias_correction2)
  float decay;        // adamw: 1 - lr * wd (multiplies p); adam: wd (scales p into g)
  bool adamw_mode;
  bool has_weight_decay;
};

struct AdamBuffers {
  float* master;
  const void* grad;
  ElementType grad_type;
  float* exp_avg;
  float* exp_avg_sq;
  void* out;  // may be null
  ElementType out_type;
};

// Updates elements [begin, end). begin is a multiple of the kernel's vector width
// when the pool splits work, but kernels handle any begin and any tail.
using AdamKernel = void (*)(const AdamParams&, const AdamBuffers&, size_t begin, size_t end);

void adam_kernel_scalar(const AdamParams&, const AdamBuffers&, size_t, size_t);
#if defined(__x86_64__)
void adam_kernel_avx2(const AdamParams&, const AdamBuffers&, size_t, size_t);
void adam_kernel_avx512(const AdamParams&, const AdamBuffers&, size_t, size_t);
#endif

// A SIMD kernel's body: updates exactly its vector width of elements at i.
using AdamVectorBody = void (*)(const AdamParams&, const AdamBuffers&, size_t i);

// Runs `body` once on zero-padded copies of elements [i, end) (end - i <= lanes
// <= 16), so a tail gets the same arithmetic as the rest of the buffer.
void adam_padded_tail(const AdamParams& a, const AdamBuffers& b, size_t i, size_t end,
                      size_t lanes, AdamVectorBody body);

// The kernel for `level`; throws std::invalid_argument if this CPU lacks it.
AdamKernel adam_kernel_for(SimdLevel level);

// Runs the update over n elements on `num_threads` threads with the kernel of
// `level` (which must not exceed detected_simd_level()).
void adam_update(const AdamParams& params, const AdamBuffers& buffers, size_t n,
                 SimdLevel level, int num_threads);

}  // namespace offload
