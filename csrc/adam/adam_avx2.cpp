// AVX2 + FMA + F16C kernel, 8 lanes. Compiled for that target by function
// attribute only, so the rest of the library still runs on any x86-64; it is
// called only when detected_simd_level() says the CPU has these extensions.
#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "adam_kernels.h"

#define OFFLOAD_AVX2 __attribute__((target("avx2,fma,f16c")))
#define OFFLOAD_MKL_SQRT_AVX2 OFFLOAD_AVX2
#include "adam_mkl_sqrt.h"

namespace offload {
namespace {

constexpr size_t kLanes = 8;

OFFLOAD_AVX2 inline __m256 load_grad8(const AdamBuffers& b, size_t i) {
  switch (b.grad_type) {
    case ElementType::kBFloat16: {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(
          static_cast<const uint16_t*>(b.grad) + i));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    case ElementType::kFloat16: {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(
          static_cast<const uint16_t*>(b.grad) + i));
      return _mm256_cvtph_ps(h);
    }
    default:
      return _mm256_loadu_ps(static_cast<const float*>(b.grad) + i);
  }
}

// fp32 -> bf16 as torch rounds (half to even; NaN -> 0xFFFF, see float_convert.h).
OFFLOAD_AVX2 inline __m128i to_bf16x8(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  const __m256i r = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0xFFFF), is_nan);
  // Pack 8 x u32 (all <= 0xFFFF) into 8 x u16 across the two 128-bit halves.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
  return _mm256_castsi256_si128(packed);
}

// fp32 -> fp16, IEEE round to nearest even (F16C handles NaN as torch does).
OFFLOAD_AVX2 inline __m128i to_f16x8(__m256 x) {
  return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
}

struct Consts {
  __m256 beta2, one_minus_beta2, lerp_coeff, eps, neg_step_size, bias2_sqrt, decay;
  bool lerp_small;  // |1 - beta1| < 0.5: which of ATen's two lerp forms
};

OFFLOAD_AVX2 inline Consts make_consts(const AdamParams& a) {
  const bool small = std::fabs(a.one_minus_beta1) < 0.5f;
  return Consts{_mm256_set1_ps(a.beta2),         _mm256_set1_ps(a.one_minus_beta2),
                _mm256_set1_ps(small ? a.one_minus_beta1 : a.one_minus_beta1 - 1.0f),
                _mm256_set1_ps(a.eps),           _mm256_set1_ps(a.neg_step_size),
                _mm256_set1_ps(a.bias2_sqrt),    _mm256_set1_ps(a.decay), small};
}

template <SqrtSource S>
OFFLOAD_AVX2 inline __m256 sqrt8(__m256 x) {
  if constexpr (S == SqrtSource::kMklAvx2) return mkl_sqrt::root8<true>(x);
  if constexpr (S == SqrtSource::kMklSse) return mkl_sqrt::root8<false>(x);
  return _mm256_sqrt_ps(x);
}

// Note [bitwise torch order]: one intrinsic per rounding torch does, fmadd
// only where ATen's Vectorized code has one. One body for the three passes
// (adam_scalar.cpp) and the three square roots this kernel can compute.
template <AdamPass P, SqrtSource S>
OFFLOAD_AVX2 inline void update8(const AdamParams& a, const Consts& c, const AdamBuffers& b,
                                 size_t i) {
  __m256 m, root;
  if constexpr (P != AdamPass::kApply) {
    __m256 g = load_grad8(b, i);
    if (a.has_weight_decay && !a.adamw_mode) {
      g = _mm256_fmadd_ps(_mm256_loadu_ps(b.master + i), c.decay, g);
    }
    const __m256 m0 = _mm256_loadu_ps(b.exp_avg + i);
    m = _mm256_fmadd_ps(c.lerp_coeff, _mm256_sub_ps(g, m0), c.lerp_small ? m0 : g);
    const __m256 v0 = _mm256_mul_ps(_mm256_loadu_ps(b.exp_avg_sq + i), c.beta2);
    const __m256 v = _mm256_fmadd_ps(_mm256_mul_ps(c.one_minus_beta2, g), g, v0);
    _mm256_storeu_ps(b.exp_avg + i, m);
    _mm256_storeu_ps(b.exp_avg_sq + i, v);
    if constexpr (P == AdamPass::kMoments) return;
    root = sqrt8<S>(v);
  } else {
    m = _mm256_loadu_ps(b.exp_avg + i);
    root = _mm256_loadu_ps(b.root + i);
  }
  __m256 p = _mm256_loadu_ps(b.master + i);
  if (a.has_weight_decay && a.adamw_mode) p = _mm256_mul_ps(p, c.decay);
  const __m256 denom = _mm256_add_ps(_mm256_div_ps(root, c.bias2_sqrt), c.eps);
  p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(c.neg_step_size, m), denom));
  _mm256_storeu_ps(b.master + i, p);
  if (b.out != nullptr) {
    const __m128i h = b.out_type == ElementType::kBFloat16 ? to_bf16x8(p) : to_f16x8(p);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(b.out) + i), h);
  }
}

template <AdamPass P, SqrtSource S>
OFFLOAD_AVX2 void update8_once(const AdamParams& a, const AdamBuffers& b, size_t i) {
  const Consts c = make_consts(a);
  update8<P, S>(a, c, b, i);
}

template <AdamPass P, SqrtSource S>
OFFLOAD_AVX2 void avx2_kernel(const AdamParams& a, const AdamBuffers& b, size_t begin,
                              size_t end) {
  // Local copies: the vector stores below are may_alias, so with `a` and `b`
  // behind references the compiler would reload every field after each
  // store; locals whose address never escapes cannot be aliased.
  const AdamParams la = a;
  const AdamBuffers lb = b;
  const Consts c = make_consts(la);
  size_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    prefetch_ahead(lb, i, P);
    update8<P, S>(la, c, lb, i);
  }
  if (i < end) adam_padded_tail(a, b, i, end, kLanes, P, &update8_once<P, S>);
}

template <SqrtSource S>
OFFLOAD_AVX2 void avx2_sqrt(const float* in, float* out, size_t n) {
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) _mm256_storeu_ps(out + i, sqrt8<S>(_mm256_loadu_ps(in + i)));
  if (i < n) {  // padded: the tail's lanes get the body's arithmetic
    alignas(32) float lanes[kLanes] = {};
    std::copy(in + i, in + n, lanes);
    _mm256_store_ps(lanes, sqrt8<S>(_mm256_load_ps(lanes)));
    std::copy(lanes, lanes + (n - i), out + i);
  }
}

OFFLOAD_AVX2 double avx2_sum_squares(const AdamBuffers& b, size_t begin, size_t end) {
  __m256 acc = _mm256_setzero_ps();
  size_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    const __m256 g = load_grad8(b, i);
    acc = _mm256_add_ps(acc, _mm256_mul_ps(g, g));  // not an FMA: g*g rounds to fp32 first, as torch's
  }
  alignas(32) float lanes[kLanes];
  _mm256_store_ps(lanes, acc);
  double total = 0.0;
  for (float lane : lanes) total += lane;
  return total + adam_scalar_sum_squares()(b, i, end);  // the tail, under one vector
}

}  // namespace

SumSquaresKernel adam_avx2_sum_squares() { return &avx2_sum_squares; }

AdamKernel adam_avx2_kernel(AdamPass pass, SqrtSource sqrt) {
  switch (pass) {
    case AdamPass::kMoments: return &avx2_kernel<AdamPass::kMoments, SqrtSource::kIeee>;
    case AdamPass::kApply: return &avx2_kernel<AdamPass::kApply, SqrtSource::kIeee>;
    case AdamPass::kFused: break;
  }
  switch (sqrt) {
    case SqrtSource::kIeee: return &avx2_kernel<AdamPass::kFused, SqrtSource::kIeee>;
    case SqrtSource::kMklAvx2: return &avx2_kernel<AdamPass::kFused, SqrtSource::kMklAvx2>;
    case SqrtSource::kMklSse: return &avx2_kernel<AdamPass::kFused, SqrtSource::kMklSse>;
    default: return nullptr;
  }
}

SqrtKernel adam_avx2_sqrt(SqrtSource sqrt) {
  switch (sqrt) {
    case SqrtSource::kIeee: return &avx2_sqrt<SqrtSource::kIeee>;
    case SqrtSource::kMklAvx2: return &avx2_sqrt<SqrtSource::kMklAvx2>;
    case SqrtSource::kMklSse: return &avx2_sqrt<SqrtSource::kMklSse>;
    default: return nullptr;
  }
}

}  // namespace offload
#endif  // __x86_64__
