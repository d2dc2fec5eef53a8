// MKL's AVX2 and SSE4.2 square roots, bit for bit, for the AVX2 and AVX-512
// kernels (included by adam_avx2.cpp and adam_avx512.cpp, each compiling it
// for its own target).
//
// Note [MKL's square roots]
// torch.sqrt of a float32 CPU tensor is MKL's vsSqrt (VML HA), whose kernel
// MKL picks from the CPU (Note [bitwise torch order] in adam_kernels.h). Read
// from the code of MKL 2024.2 inside torch 2.13's libtorch_cpu.so (the
// kernels mkl_vml_kernel_sSqrt_L9HAynn and _H8HAynn) and then checked against
// torch.sqrt over every non-negative float32 (2^31 inputs, 0 mismatches each),
// two of its paths are a seed and Newton-Raphson steps, every lane alike:
//   AVX2 (L9):   y = VRSQRTPS(x); s = y*x; h = y*0.5; e = fnmadd(h, s, 0.5);
//                s1 = fmadd(e, s, s); h1 = fmadd(e, h, h);
//                root = fmadd(fnmadd(s1, s1, x), h1, s1)
//   SSE4.2 (H8): the same steps with each product and sum rounded on its own
//                (no fma), so 0.5 - s*h, s*e + s, e*h + h, x - s1*s1, r*h1 + s1
// A lane the vector test sends to MKL's scalar path gets the correctly rounded
// root there (its double-precision table and Goldschmidt steps; for +-0, inf
// and NaN, the input itself): for AVX2 every lane outside the normals
// [2^-126, FLT_MAX], for SSE4.2 also the top of the range (bits above
// 0x7f7ff000). Both take the IEEE root here for those lanes. AVX2's root is
// IEEE except where x - s1*s1 underflows ([2^-126, 2^-104): 1.9M inputs); the
// SSE4.2 one is 1 ulp off on 17% of inputs, both ways, from s1*s1 rounded
// before the subtraction.
// The seed is the CPU's own 12-bit RSQRTPS, whose table differs between
// vendors (AMD's depends on 12 mantissa bits, Intel's on 10). torch.sqrt on
// an AMD EPYC (Zen 5) is this SSE4.2 sequence with AMD's seed: it equals the
// 2.15M roots in ../shared/data/torch-sqrt-amd-epyc-zen5.npz when the seed is
// AMD's table (rebuilt from that file), and no sequence that does not depend
// on the seed's bits matches them. So the kernel computes the sequence with
// the seed of the CPU it runs on, and the probe (offload/ops/adam.py) decides
// on each machine whether that is torch's. AVX-512F has no 512-bit VRSQRTPS
// (only VRSQRT14PS, another table): the AVX-512 kernel seeds each 256-bit
// half. -ffp-contract=off (setup.py) keeps the SSE4.2 steps unfused.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>

namespace offload {
namespace mkl_sqrt {

// Lanes MKL's vector test keeps: (int32)(bits + 0x7f800000) <= limit.
constexpr int kAvx2Limit = static_cast<int>(0xfeffffffu);  // the normals up to FLT_MAX
constexpr int kSseLimit = static_cast<int>(0xfefff000u);   // the normals up to bits 0x7f7ff000

#ifdef OFFLOAD_MKL_SQRT_AVX2
// 8 lanes (the AVX2 kernel). kFusedSteps: MKL's AVX2 path; else its SSE4.2 path.
template <bool kFusedSteps>
OFFLOAD_MKL_SQRT_AVX2 inline __m256 root8(__m256 x) {
  const __m256 half = _mm256_set1_ps(0.5f);
  const __m256 y = _mm256_rsqrt_ps(x);
  const __m256 s = _mm256_mul_ps(y, x);
  const __m256 h = _mm256_mul_ps(y, half);
  __m256 r;
  if constexpr (kFusedSteps) {
    const __m256 e = _mm256_fnmadd_ps(h, s, half);
    const __m256 s1 = _mm256_fmadd_ps(e, s, s);
    const __m256 h1 = _mm256_fmadd_ps(e, h, h);
    r = _mm256_fmadd_ps(_mm256_fnmadd_ps(s1, s1, x), h1, s1);
  } else {
    const __m256 e = _mm256_sub_ps(half, _mm256_mul_ps(s, h));
    const __m256 s1 = _mm256_add_ps(_mm256_mul_ps(s, e), s);
    const __m256 h1 = _mm256_add_ps(_mm256_mul_ps(e, h), h);
    r = _mm256_add_ps(_mm256_mul_ps(_mm256_sub_ps(x, _mm256_mul_ps(s1, s1)), h1), s1);
  }
  const __m256i shifted = _mm256_add_epi32(_mm256_castps_si256(x), _mm256_set1_epi32(0x7f800000));
  const __m256i scalar_path =
      _mm256_cmpgt_epi32(shifted, _mm256_set1_epi32(kFusedSteps ? kAvx2Limit : kSseLimit));
  return _mm256_blendv_ps(r, _mm256_sqrt_ps(x), _mm256_castsi256_ps(scalar_path));
}
#endif

#ifdef OFFLOAD_MKL_SQRT_AVX512
// 16 lanes (the AVX-512 kernel): the seed per 256-bit half, the steps in one register.
OFFLOAD_MKL_SQRT_AVX512 inline __m512 rsqrt12_16(__m512 x) {
  const __m256 lo = _mm256_rsqrt_ps(_mm512_castps512_ps256(x));
  const __m256 hi = _mm256_rsqrt_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  return _mm512_castpd_ps(
      _mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
}

template <bool kFusedSteps>
OFFLOAD_MKL_SQRT_AVX512 inline __m512 root16(__m512 x) {
  const __m512 half = _mm512_set1_ps(0.5f);
  const __m512 y = rsqrt12_16(x);
  const __m512 s = _mm512_mul_ps(y, x);
  const __m512 h = _mm512_mul_ps(y, half);
  __m512 r;
  if constexpr (kFusedSteps) {
    const __m512 e = _mm512_fnmadd_ps(h, s, half);
    const __m512 s1 = _mm512_fmadd_ps(e, s, s);
    const __m512 h1 = _mm512_fmadd_ps(e, h, h);
    r = _mm512_fmadd_ps(_mm512_fnmadd_ps(s1, s1, x), h1, s1);
  } else {
    const __m512 e = _mm512_sub_ps(half, _mm512_mul_ps(s, h));
    const __m512 s1 = _mm512_add_ps(_mm512_mul_ps(s, e), s);
    const __m512 h1 = _mm512_add_ps(_mm512_mul_ps(e, h), h);
    r = _mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(x, _mm512_mul_ps(s1, s1)), h1), s1);
  }
  const __m512i shifted = _mm512_add_epi32(_mm512_castps_si512(x), _mm512_set1_epi32(0x7f800000));
  const __mmask16 scalar_path =
      _mm512_cmpgt_epi32_mask(shifted, _mm512_set1_epi32(kFusedSteps ? kAvx2Limit : kSseLimit));
  return _mm512_mask_sqrt_ps(r, scalar_path, x);
}
#endif

}  // namespace mkl_sqrt
}  // namespace offload
#endif  // __x86_64__
