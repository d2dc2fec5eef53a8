// AVX-512F kernel, 16 lanes. Compiled for that target by function attribute
// only (see adam_avx2.cpp); the tail goes through adam_padded_tail.
//
// Not the AVX512-BF16 instruction VCVTNEPS2BF16 for the bf16 copy: it flushes
// denormal inputs to zero, and the copy must equal torch's master.to(bfloat16)
// bit for bit. The integer rounding below costs four cheap ops per vector.
#if defined(__x86_64__)
// GCC 12's own avx512fintrin.h trips -Wmaybe-uninitialized on its
// _mm512_undefined_* helpers (GCC bug 105593); the warning is not about this code.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include "adam_kernels.h"

#define OFFLOAD_AVX512 __attribute__((target("avx512f")))

namespace offload {
namespace {

constexpr size_t kLanes = 16;

OFFLOAD_AVX512 inline __m512 load_grad16(const AdamBuffers& b, size_t i) {
  switch (b.grad_type) {
    case ElementType::kBFloat16: {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
          static_cast<const uint16_t*>(b.grad) + i));
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    case ElementType::kFloat16: {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
          static_cast<const uint16_t*>(b.grad) + i));
      return _mm512_cvtph_ps(h);
    }
    default:
      return _mm512_loadu_ps(static_cast<const float*>(b.grad) + i);
  }
}

// fp32 -> bf16 as torch rounds (half to even; NaN -> 0xFFFF, see float_convert.h).
OFFLOAD_AVX512 inline __m256i to_bf16x16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 is_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, is_nan, _mm512_set1_epi32(0xFFFF));
  return _mm512_cvtepi32_epi16(r);
}

// fp32 -> fp16, IEEE round to nearest even (VCVTPS2PH handles NaN as torch does).
OFFLOAD_AVX512 inline __m256i to_f16x16(__m512 x) {
  return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
}

struct Consts {
  __m512 beta2, one_minus_beta1, one_minus_beta2, eps, step_size, inv_bias2_sqrt, decay;
};

OFFLOAD_AVX512 inline Consts make_consts(const AdamParams& a) {
  return Consts{_mm512_set1_ps(a.beta2),
                _mm512_set1_ps(a.one_minus_beta1), _mm512_set1_ps(a.one_minus_beta2),
                _mm512_set1_ps(a.eps),          _mm512_set1_ps(a.step_size),
                _mm512_set1_ps(a.inv_bias2_sqrt),   _mm512_set1_ps(a.decay)};
}

OFFLOAD_AVX512 inline void update16(const AdamParams& a, const Consts& c, const AdamBuffers& b,
                                    size_t i) {
  __m512 g = load_grad16(b, i);
  __m512 p = _mm512_loadu_ps(b.master + i);
  if (a.has_weight_decay) {
    if (a.adamw_mode) p = _mm512_mul_ps(p, c.decay);
    else g = _mm512_fmadd_ps(c.decay, p, g);
  }
  const __m512 m0 = _mm512_loadu_ps(b.exp_avg + i);
  const __m512 m = _mm512_fmadd_ps(c.one_minus_beta1, _mm512_sub_ps(g, m0), m0);
  const __m512 v = _mm512_fmadd_ps(_mm512_mul_ps(c.one_minus_beta2, g), g,
                                   _mm512_mul_ps(c.beta2, _mm512_loadu_ps(b.exp_avg_sq + i)));
  const __m512 denom = _mm512_fmadd_ps(_mm512_sqrt_ps(v), c.inv_bias2_sqrt, c.eps);
  p = _mm512_fnmadd_ps(c.step_size, _mm512_div_ps(m, denom), p);
  _mm512_storeu_ps(b.exp_avg + i, m);
  _mm512_storeu_ps(b.exp_avg_sq + i, v);
  _mm512_storeu_ps(b.master + i, p);
  if (b.out != nullptr) {
    const __m256i h = b.out_type == ElementType::kBFloat16 ? to_bf16x16(p) : to_f16x16(p);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(b.out) + i), h);
  }
}

OFFLOAD_AVX512 void update16_once(const AdamParams& a, const AdamBuffers& b, size_t i) {
  const Consts c = make_consts(a);
  update16(a, c, b, i);
}

}  // namespace

OFFLOAD_AVX512 void adam_kernel_avx512(const AdamParams& a, const AdamBuffers& b, size_t begin,
                                       size_t end) {
  // Local copies: the vector stores below are may_alias, so with `a` and `b`
  // behind references the compiler would reload every field after each
  // store; locals whose address never escapes cannot be aliased.
  const AdamParams la = a;
  const AdamBuffers lb = b;
  const Consts c = make_consts(la);
  size_t i = begin;
  for (; i + kLanes <= end; i += kLanes) update16(la, c, lb, i);
  if (i < end) adam_padded_tail(a, b, i, end, kLanes, &update16_once);
}

}  // namespace offload
#endif  // __x86_64__
