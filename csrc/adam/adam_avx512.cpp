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

#include <cmath>

#include "adam_kernels.h"

#define OFFLOAD_AVX512 __attribute__((target("avx512f")))
#define OFFLOAD_MKL_SQRT_AVX512 OFFLOAD_AVX512
#include "adam_mkl_sqrt.h"

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

// sqrt(v) as MKL's AVX-512 code path computes it (torch.sqrt on an Intel CPU
// with AVX-512). torch.sqrt of a fp32 CPU tensor is MKL's vsSqrt (VML_HA),
// and MKL's AVX-512 code path is not the
// IEEE square root: it rounds down in ~0.7% of inputs (never more than 0.56
// ulp from exact). This sequence, a VRSQRT14PS estimate refined by one Newton
// step on the residual, gives the same bits as that path for every non-negative
// fp32 input, the only ones v takes (checked exhaustively, all 2^31 bit
// patterns with the sign clear, NaNs as NaN, against torch 2.13 / MKL
// 2024.2 on a Xeon with AVX-512): inputs under 2^-100 are scaled by 2^64 first
// (the residual would lose bits to underflow) and 0 and inf pass through.
// Used only where torch.sqrt equals it on every probe input (Note [bitwise
// torch order]); MKL's other paths are not this sequence.
OFFLOAD_AVX512 inline __m512 sqrt_as_torch(__m512 x) {
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(0x1p-100f), _CMP_LT_OQ);
  const __m512 xs = _mm512_mask_mul_ps(x, tiny, x, _mm512_set1_ps(0x1p64f));
  const __m512 y0 = _mm512_rsqrt14_ps(xs);
  const __m512 s = _mm512_mul_ps(xs, y0);
  const __m512 residual = _mm512_fnmadd_ps(s, s, xs);
  __m512 r = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), y0), residual, s);
  r = _mm512_mask_mul_ps(r, tiny, r, _mm512_set1_ps(0x1p-32f));
  const __mmask16 passthrough = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_EQ_OQ) |
                                _mm512_cmp_ps_mask(x, _mm512_set1_ps(__builtin_inff()), _CMP_EQ_OQ);
  return _mm512_mask_mov_ps(r, passthrough, x);
}

// Note [division by a constant]: q = x * r, e = x - q*c (one fma, exact),
// q' = q + e*r (one fma), with r = RN(1/c), is the correctly rounded x / c
// whenever x / c neither overflows nor underflows (Markstein's theorem: r is
// within half an ulp of 1/c, q within one ulp of x/c, so e is exact and one
// correction rounds right). Here x = sqrt(v) in [2^-50, 2^64] on the fast path
// and c = bias2_sqrt in (0, 1]; checked exhaustively for every x in that
// range against VDIVPS, for 97 divisors (bias2_sqrt of beta2 in {0.5 .. 0.9999}
// at t from 1 to 12345, 40 random ones, and 1). Three cheap ops instead of a
// division, which here shares the one divider with the other division.
struct Consts {
  __m512 beta2, one_minus_beta2, lerp_coeff, eps, neg_step_size, bias2_sqrt, inv_bias2_sqrt, decay;
  bool lerp_small;  // |1 - beta1| < 0.5: which of ATen's two lerp forms
};

OFFLOAD_AVX512 inline Consts make_consts(const AdamParams& a) {
  const bool small = std::fabs(a.one_minus_beta1) < 0.5f;
  return Consts{_mm512_set1_ps(a.beta2),         _mm512_set1_ps(a.one_minus_beta2),
                _mm512_set1_ps(small ? a.one_minus_beta1 : a.one_minus_beta1 - 1.0f),
                _mm512_set1_ps(a.eps),           _mm512_set1_ps(a.neg_step_size),
                _mm512_set1_ps(a.bias2_sqrt),    _mm512_set1_ps(1.0f / a.bias2_sqrt),
                _mm512_set1_ps(a.decay),         small};
}

// sqrt(v) / bias2_sqrt + eps, each op rounded as torch rounds it. The common
// case, every lane in [2^-100, inf), needs neither sqrt_as_torch's scaling nor
// its passthrough, and divides by Note [division by a constant]; a vector with
// any other lane (0, tiny, inf, NaN) takes the general sequence. Same bits
// either way; the split only saves work.
OFFLOAD_AVX512 inline __m512 denom_as_torch(__m512 v, const Consts& c) {
  // v >= 0 (a sum of squares scaled by positive constants), so one unsigned
  // compare on the bits finds the lanes outside [2^-100, inf).
  const __m512i lo = _mm512_castps_si512(_mm512_set1_ps(0x1p-100f));
  const __m512i span = _mm512_sub_epi32(_mm512_castps_si512(_mm512_set1_ps(__builtin_inff())), lo);
  const __mmask16 general = _mm512_cmp_epu32_mask(
      _mm512_sub_epi32(_mm512_castps_si512(v), lo), span, _MM_CMPINT_NLT);
  if (__builtin_expect(general != 0, 0)) {
    return _mm512_add_ps(_mm512_div_ps(sqrt_as_torch(v), c.bias2_sqrt), c.eps);
  }
  const __m512 y0 = _mm512_rsqrt14_ps(v);  // sqrt_as_torch's sequence, unscaled
  const __m512 s = _mm512_mul_ps(v, y0);
  const __m512 residual = _mm512_fnmadd_ps(s, s, v);
  const __m512 root = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), y0), residual, s);
  const __m512 q = _mm512_mul_ps(root, c.inv_bias2_sqrt);
  const __m512 q_exact = _mm512_fmadd_ps(_mm512_fnmadd_ps(q, c.bias2_sqrt, root), c.inv_bias2_sqrt, q);
  return _mm512_add_ps(q_exact, c.eps);
}

template <SqrtSource S>
OFFLOAD_AVX512 inline __m512 root16(__m512 x) {
  if constexpr (S == SqrtSource::kMklAvx512) return sqrt_as_torch(x);
  if constexpr (S == SqrtSource::kMklAvx2) return mkl_sqrt::root16<true>(x);
  if constexpr (S == SqrtSource::kMklSse) return mkl_sqrt::root16<false>(x);
  return _mm512_sqrt_ps(x);
}

// Note [bitwise torch order]: one intrinsic per rounding torch does, fmadd
// only where ATen's Vectorized code has one. One body for the three passes
// (adam_scalar.cpp) and the four square roots this kernel can compute.
template <AdamPass P, SqrtSource S>
OFFLOAD_AVX512 inline void update16(const AdamParams& a, const Consts& c, const AdamBuffers& b,
                                    size_t i) {
  __m512 m, denom;
  if constexpr (P != AdamPass::kApply) {
    __m512 g = load_grad16(b, i);
    if (a.has_weight_decay && !a.adamw_mode) {
      g = _mm512_fmadd_ps(_mm512_loadu_ps(b.master + i), c.decay, g);
    }
    const __m512 m0 = _mm512_loadu_ps(b.exp_avg + i);
    m = _mm512_fmadd_ps(c.lerp_coeff, _mm512_sub_ps(g, m0), c.lerp_small ? m0 : g);
    const __m512 v0 = _mm512_mul_ps(_mm512_loadu_ps(b.exp_avg_sq + i), c.beta2);
    const __m512 v = _mm512_fmadd_ps(_mm512_mul_ps(c.one_minus_beta2, g), g, v0);
    _mm512_storeu_ps(b.exp_avg + i, m);
    _mm512_storeu_ps(b.exp_avg_sq + i, v);
    if constexpr (P == AdamPass::kMoments) return;
    if constexpr (S == SqrtSource::kMklAvx512) {
      denom = denom_as_torch(v, c);
    } else {
      denom = _mm512_add_ps(_mm512_div_ps(root16<S>(v), c.bias2_sqrt), c.eps);
    }
  } else {
    m = _mm512_loadu_ps(b.exp_avg + i);
    denom = _mm512_add_ps(_mm512_div_ps(_mm512_loadu_ps(b.root + i), c.bias2_sqrt), c.eps);
  }
  __m512 p = _mm512_loadu_ps(b.master + i);
  if (a.has_weight_decay && a.adamw_mode) p = _mm512_mul_ps(p, c.decay);
  p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(c.neg_step_size, m), denom));
  _mm512_storeu_ps(b.master + i, p);
  if (b.out != nullptr) {
    const __m256i h = b.out_type == ElementType::kBFloat16 ? to_bf16x16(p) : to_f16x16(p);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(b.out) + i), h);
  }
}

template <AdamPass P, SqrtSource S>
OFFLOAD_AVX512 void update16_once(const AdamParams& a, const AdamBuffers& b, size_t i) {
  const Consts c = make_consts(a);
  update16<P, S>(a, c, b, i);
}

template <AdamPass P, SqrtSource S>
OFFLOAD_AVX512 void avx512_kernel(const AdamParams& a, const AdamBuffers& b, size_t begin,
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
    update16<P, S>(la, c, lb, i);
  }
  if (i < end) adam_padded_tail(a, b, i, end, kLanes, P, &update16_once<P, S>);
}


template <SqrtSource S>
OFFLOAD_AVX512 void avx512_sqrt(const float* in, float* out, size_t n) {
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) _mm512_storeu_ps(out + i, root16<S>(_mm512_loadu_ps(in + i)));
  if (i < n) {  // masked: the tail's lanes get the body's arithmetic
    const __mmask16 k = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(out + i, k, root16<S>(_mm512_maskz_loadu_ps(k, in + i)));
  }
}

OFFLOAD_AVX512 double avx512_sum_squares(const AdamBuffers& b, size_t begin, size_t end) {
  __m512 acc = _mm512_setzero_ps();
  size_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    const __m512 g = load_grad16(b, i);
    acc = _mm512_add_ps(acc, _mm512_mul_ps(g, g));  // not an FMA: g*g rounds to fp32 first, as torch's
  }
  alignas(64) float lanes[kLanes];
  _mm512_store_ps(lanes, acc);
  double total = 0.0;
  for (float lane : lanes) total += lane;
  return total + adam_scalar_sum_squares()(b, i, end);  // the tail, under one vector
}

}  // namespace

SumSquaresKernel adam_avx512_sum_squares() { return &avx512_sum_squares; }

AdamKernel adam_avx512_kernel(AdamPass pass, SqrtSource sqrt) {
  switch (pass) {
    case AdamPass::kMoments: return &avx512_kernel<AdamPass::kMoments, SqrtSource::kIeee>;
    case AdamPass::kApply: return &avx512_kernel<AdamPass::kApply, SqrtSource::kIeee>;
    case AdamPass::kFused: break;
  }
  switch (sqrt) {
    case SqrtSource::kIeee: return &avx512_kernel<AdamPass::kFused, SqrtSource::kIeee>;
    case SqrtSource::kMklAvx512: return &avx512_kernel<AdamPass::kFused, SqrtSource::kMklAvx512>;
    case SqrtSource::kMklAvx2: return &avx512_kernel<AdamPass::kFused, SqrtSource::kMklAvx2>;
    case SqrtSource::kMklSse: return &avx512_kernel<AdamPass::kFused, SqrtSource::kMklSse>;
    default: return nullptr;
  }
}

SqrtKernel adam_avx512_sqrt(SqrtSource sqrt) {
  switch (sqrt) {
    case SqrtSource::kIeee: return &avx512_sqrt<SqrtSource::kIeee>;
    case SqrtSource::kMklAvx512: return &avx512_sqrt<SqrtSource::kMklAvx512>;
    case SqrtSource::kMklAvx2: return &avx512_sqrt<SqrtSource::kMklAvx2>;
    case SqrtSource::kMklSse: return &avx512_sqrt<SqrtSource::kMklSse>;
    default: return nullptr;
  }
}

}  // namespace offload
#endif  // __x86_64__
