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

const char* sqrt_source_name(SqrtSource s) {
  switch (s) {
    case SqrtSource::kIeee: return "ieee";
    case SqrtSource::kMklAvx512: return "mkl-avx512";
    case SqrtSource::kMklVml: return "mkl-vml";
    case SqrtSource::kMklAvx2: return "mkl-avx2";
    case SqrtSource::kMklSse: return "mkl-sse";
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

// Note [bitwise torch order]: one rounding per torch op, std::fma exactly
// where ATen's vector code uses fmadd. This file is built without FMA
// instructions, so the compiler cannot contract the other lines either. The
// passes share this one body: kMoments stops after v, kApply starts from the
// stored m and torch's root; what each computes is what kFused computes.
template <AdamPass P>
void scalar_kernel(const AdamParams& a, const AdamBuffers& b, size_t begin, size_t end) {
  const float w = a.one_minus_beta1;
  const bool small_w = std::fabs(w) < 0.5f;
  const float lerp_coeff = small_w ? w : w - 1.0f;
  uint16_t* out16 = static_cast<uint16_t*>(b.out);
  for (size_t i = begin; i < end; ++i) {
    float m, root;
    if constexpr (P != AdamPass::kApply) {
      float g = load_grad(b, i);
      if (a.has_weight_decay && !a.adamw_mode) g = std::fma(b.master[i], a.decay, g);
      const float m0 = b.exp_avg[i];
      m = std::fma(lerp_coeff, g - m0, small_w ? m0 : g);
      float v = b.exp_avg_sq[i] * a.beta2;
      v = std::fma(a.one_minus_beta2 * g, g, v);
      b.exp_avg[i] = m;
      b.exp_avg_sq[i] = v;
      if constexpr (P == AdamPass::kMoments) continue;
      root = std::sqrt(v);
    } else {
      m = b.exp_avg[i];
      root = b.root[i];
    }
    float p = b.master[i];
    if (a.has_weight_decay && a.adamw_mode) p = p * a.decay;
    const float denom = root / a.bias2_sqrt + a.eps;
    p = p + (a.neg_step_size * m) / denom;
    b.master[i] = p;
    if (out16 != nullptr) {
      out16[i] = b.out_type == ElementType::kBFloat16 ? f32_to_bf16(p) : f32_to_f16(p);
    }
  }
}

void scalar_sqrt(const float* in, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = std::sqrt(in[i]);
}

double scalar_sum_squares(const AdamBuffers& b, size_t begin, size_t end) {
  float lanes[8] = {};
  size_t i = begin;
  for (; i + 8 <= end; i += 8) {
    for (size_t j = 0; j < 8; ++j) {
      const float g = load_grad(b, i + j);
      lanes[j] += g * g;
    }
  }
  for (size_t j = 0; i < end; ++i, ++j) {
    const float g = load_grad(b, i);
    lanes[j] += g * g;
  }
  double total = 0.0;
  for (float lane : lanes) total += lane;
  return total;
}

}  // namespace

AdamKernel adam_scalar_kernel(AdamPass pass, SqrtSource sqrt) {
  switch (pass) {
    case AdamPass::kMoments: return &scalar_kernel<AdamPass::kMoments>;
    case AdamPass::kApply: return &scalar_kernel<AdamPass::kApply>;
    case AdamPass::kFused: break;
  }
  return sqrt == SqrtSource::kIeee ? &scalar_kernel<AdamPass::kFused> : nullptr;
}

SqrtKernel adam_scalar_sqrt(SqrtSource sqrt) {
  return sqrt == SqrtSource::kIeee ? &scalar_sqrt : nullptr;
}

SumSquaresKernel adam_scalar_sum_squares() { return &scalar_sum_squares; }

}  // namespace offload
