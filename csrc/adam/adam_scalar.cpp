// Reference kernel: portable C++, the definition the SIMD kernels are tested
// against, and the path on CPUs without AVX2.
#include <cmath>

#include "adam_kernels.h"
#include "float_convert.h"

namespace offload {

const char* element_type_name(ElementType t) {
  switch (t) {
    case ElementType::kFloat32: return "float32";
    case ElementType::kBFloat16: return "bfloat16";
    case ElementType::kFloat16: return "float16";
  }
  return "unknown";
}

namespace {

inline float load_grad(const AdamBuffers& b, size_t i) {
  switch (b.grad_type) {
    case ElementType::kBFloat16: return bf16_to_f32(static_cast<const uint16_t*>(b.grad)[i]);
    case ElementType::kFloat16: return f16_to_f32(static_cast<const uint16_t*>(b.grad)[i]);
    default: return static_cast<const float*>(b.grad)[i];
  }
}

}  // namespace

void adam_kernel_scalar(const AdamParams& a, const AdamBuffers& b, size_t begin, size_t end) {
  // Note [bitwise torch order]: one rounding per torch op, std::fma exactly
  // where ATen's vector code uses fmadd. This file is built without FMA
  // instructions, so the compiler cannot contract the other lines either.
  const float w = a.one_minus_beta1;
  const bool small_w = std::fabs(w) < 0.5f;
  const float lerp_coeff = small_w ? w : w - 1.0f;
  uint16_t* out16 = static_cast<uint16_t*>(b.out);
  for (size_t i = begin; i < end; ++i) {
    float g = load_grad(b, i);
    float p = b.master[i];
    if (a.has_weight_decay) {
      if (a.adamw_mode) p = p * a.decay;
      else g = std::fma(p, a.decay, g);
    }
    const float m0 = b.exp_avg[i];
    const float m = std::fma(lerp_coeff, g - m0, small_w ? m0 : g);
    float v = b.exp_avg_sq[i] * a.beta2;
    v = std::fma(a.one_minus_beta2 * g, g, v);
    const float denom = std::sqrt(v) / a.bias2_sqrt + a.eps;
    p = p + (a.neg_step_size * m) / denom;
    b.exp_avg[i] = m;
    b.exp_avg_sq[i] = v;
    b.master[i] = p;
    if (out16 != nullptr) {
      out16[i] = b.out_type == ElementType::kBFloat16 ? f32_to_bf16(p) : f32_to_f16(p);
    }
  }
}

}  // namespace offload
