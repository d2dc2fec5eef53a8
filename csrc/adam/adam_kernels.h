// Fused Adam/AdamW update over flat fp32 buffers.
//
// One pass reads the gradient (fp32, bf16 or fp16), the fp32 master weights
// and both fp32 moments, updates the three in place and, when asked, writes
// the new master rounded to bf16 or fp16 (round to nearest even). Fusing the
// gradient widening and the low-precision copy into the update is what makes
// the offload step cheaper than a peer's three passes: the update is bound by
// memory bandwidth, not arithmetic.
//
// Note [bitwise torch order]
// The fp32 result equals torch.optim.Adam/AdamW's default CPU path (the
// single-tensor one: torch 2.13 has no foreach kernels for CPU tensors, so
// foreach=None runs _single_tensor_adam) bit for bit. That path is one ATen
// op per line, each rounding to fp32, with every Python scalar computed in
// double and rounded to fp32 once, where the op receives it. Per element, in
// torch's order (f(x): x rounded to fp32; fma: one rounding):
//   adamw (decoupled): p <- p * f(1 - lr*wd)               mul_
//   adam  (L2):        g <- fma(p, f(wd), g)                grad.add(p, alpha=wd)
//   d <- g - m;  w = f(1 - beta1)                            lerp_(g, w)
//   m <- |w| < 0.5 ? fma(w, d, m) : fma(w - 1, d, g)
//   v <- v * f(beta2)                                        mul_(beta2)
//   v <- fma(f(1 - beta2) * g, g, v)                         addcmul_(g, g, 1 - beta2)
//   den <- sqrt(v) / f(bias2_sqrt) + f(eps)                  (sqrt() / bc2_sqrt).add_(eps)
//   p <- p + (f(-step_size) * m) / den                       addcdiv_(m, den, -step_size)
// with, in double as torch does: step_size = lr / (1 - beta1**t) and
// bias2_sqrt = (1 - beta2**t) ** 0.5 (both from offload/ops/adam.py).
// ATen's vectorised lerp, add-with-alpha and addcmul use fmadd, the others
// round each op; torch's scalar tails give the same bits as its vector bodies
// (both checked on torch 2.13 with ATEN_CPU_CAPABILITY avx512 and avx2). So a
// kernel must not contract or reassociate anything beyond the three fmas
// above: no reciprocal for the divisions, no fma into p.
// sqrt is the one op whose bits depend on the CPU, and on how MKL sees it.
// torch.sqrt of a fp32 CPU tensor is MKL's vsSqrt (VML_HA), which picks its
// code path from the CPU at process start (MKL_ENABLE_INSTRUCTIONS lowers
// it). Seen with torch 2.13 / MKL 2024.2 over all 2^31 non-negative fp32:
//   AVX-512 path (Xeon): 1 ulp low on 0.6% of inputs, in every binade;
//   AVX2 path: IEEE except in [2^-126, 2^-104), where 1.9M inputs, the
//     hardest to round, are 1 ulp off (the residual underflows);
//   SSE4.2 path (and what an AMD EPYC ran): 1 ulp off on ~17% of inputs.
// Each path's sequence is in Note [MKL's square roots] (adam_mkl_sqrt.h).
// Builds without MKL take the IEEE sqrt. So no sqrt fixed at build time is
// torch's on every CPU. The rule instead, decided once per process and SIMD
// level by offload/ops/adam.py (sqrt_source(), shown by `offload report`):
//   1. The kernels can compute five square roots (SqrtSource), fastest first:
//      the IEEE one (every level); MKL's AVX-512 sequence (sqrt_as_torch in
//      adam_avx512.cpp, the AVX-512 kernel only: it needs VRSQRT14PS); MKL's
//      AVX2 and SSE4.2 sequences (adam_mkl_sqrt.h; the AVX2 and AVX-512
//      kernels); MKL's vsSqrt itself, found at run time in torch's own library
//      (adam_vml.cpp; every level: per 1024-element block, kMoments, vsSqrt,
//      kApply, with the block in L1 throughout).
//   2. A probe compares torch.sqrt with each of them on ~2.1M inputs: in every
//      binade, subnormals to the largest finite, the 4096 hardest-to-round
//      significands (root nearest a rounding midpoint, where a sqrt that is
//      off IEEE by a residual's lost bits fails first: all of MKL's AVX2
//      misses rank among the 800 hardest of their binade) and 4096 random
//      ones, plus 0 and inf.
//   3. The first that equals torch on every probe input runs fused.
//   4. If none does (a torch without MKL whose sqrt is not IEEE), the update
//      is split around torch.sqrt itself: kMoments, torch.sqrt(v) into a
//      scratch block, kApply. Exact by construction; ~3-4x the fused time.
// Costs at 16M parameters, 2 threads (a 2-core Xeon): in registers 1x,
// vsSqrt per block ~1.2x, the split ~3-4x. The probe is a sample: a torch
// sqrt that agreed with a kernel's on all of it but differed elsewhere would
// go unnoticed (each such sqrt 1 ulp off); OFFLOAD_ADAM_SQRT=torch forces
// the split, exact regardless.
#pragma once

#include <cstddef>
#include <algorithm>
#include <cstdint>
#include <string>

#include "../common/cpu_features.h"

#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

namespace offload {

enum class ElementType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

const char* element_type_name(ElementType t);

struct AdamParams {
  // Every field is a double from the caller rounded once to fp32, as torch
  // rounds its Python scalars (Note [bitwise torch order]). 1 - beta is passed
  // in: 1.0f - 0.999f is off from 0.001 by 1.3e-5 relative, f(1 - 0.999) is not.
  float beta1, beta2, one_minus_beta1, one_minus_beta2, eps;
  float neg_step_size;  // -(lr / bias_correction1)
  float bias2_sqrt;     // bias_correction2 ** 0.5 (divides sqrt(v), as torch)
  float decay;          // adamw: 1 - lr * wd (multiplies p); adam: wd (scales p into g)
  bool adamw_mode;
  bool has_weight_decay;
};

// Which square root a kernel computes (Note [bitwise torch order]).
enum class SqrtSource : int {
  kIeee = 0,       // the IEEE square root, every level
  kMklAvx512 = 1,  // MKL's AVX-512 sequence in registers (sqrt_as_torch), the AVX-512 kernel only
  kMklVml = 2,     // MKL's vsSqrt itself, called per block (adam_vml.cpp), every level once bound
  kMklAvx2 = 3,    // MKL's AVX2 sequence in registers (Note [MKL's square roots]), AVX2 and AVX-512
  kMklSse = 4,     // MKL's SSE4.2 sequence, what an AMD EPYC runs (Note [MKL's square roots]), likewise
};

// What one call computes: the whole update, or one half of the update split
// around a sqrt computed elsewhere (Note [bitwise torch order], rules 1, 4).
enum class AdamPass : int {
  kFused = 0,    // m, v, p (and out) from g, with the kernel's sqrt
  kMoments = 1,  // m and v only (reads p only for Adam's L2 term)
  kApply = 2,    // p (and out) from m and root = sqrt(v) computed elsewhere
};

const char* sqrt_source_name(SqrtSource s);

struct AdamBuffers {
  float* master;
  const void* grad;
  ElementType grad_type;
  float* exp_avg;
  float* exp_avg_sq;
  void* out;  // may be null; never written by kMoments
  ElementType out_type;
  const float* root;  // kApply only: sqrt(exp_avg_sq), by torch or MKL
};

// Updates elements [begin, end). begin is a multiple of the kernel's vector width
// when the pool splits work, but kernels handle any begin and any tail.
using AdamKernel = void (*)(const AdamParams&, const AdamBuffers&, size_t begin, size_t end);

// Each level's kernel for a pass and a sqrt; nullptr where the level cannot
// compute that sqrt (MKL's AVX-512 sequence below AVX-512). kMoments and
// kApply take no sqrt of their own: any source gives the same kernel.
AdamKernel adam_scalar_kernel(AdamPass pass, SqrtSource sqrt);
#if defined(__x86_64__)
AdamKernel adam_avx2_kernel(AdamPass pass, SqrtSource sqrt);
AdamKernel adam_avx512_kernel(AdamPass pass, SqrtSource sqrt);
#endif

// A level's square root on its own, as the fused kernel computes it: what the
// probe compares with torch.sqrt. out[i] = sqrt(in[i]) for i < n.
using SqrtKernel = void (*)(const float* in, float* out, size_t n);
SqrtKernel adam_scalar_sqrt(SqrtSource sqrt);
#if defined(__x86_64__)
SqrtKernel adam_avx2_sqrt(SqrtSource sqrt);
SqrtKernel adam_avx512_sqrt(SqrtSource sqrt);
#endif

// A SIMD kernel's body: updates exactly its vector width of elements at i.
using AdamVectorBody = void (*)(const AdamParams&, const AdamBuffers&, size_t i);

// Runs `body` once on zero-padded copies of elements [i, end) (end - i <= lanes
// <= 16), so a tail gets the same arithmetic as the rest of the buffer; copies
// back only what `pass` writes.
void adam_padded_tail(const AdamParams& a, const AdamBuffers& b, size_t i, size_t end,
                      size_t lanes, AdamPass pass, AdamVectorBody body);

// The kernel for `level`, `pass` and `sqrt`; throws std::invalid_argument if
// this CPU lacks the level or the level cannot compute that sqrt.
AdamKernel adam_kernel_for(SimdLevel level, AdamPass pass, SqrtSource sqrt);

// The sum of the squares of grad[begin, end) (each element as fp32, squared
// in fp32, summed in fp32 lanes, the lanes' total in double): one term of the
// global gradient norm (Note [global gradient norm] in
// offload/engine/deepspeed_api.py), read while the update's block is in cache.
using SumSquaresKernel = double (*)(const AdamBuffers& b, size_t begin, size_t end);
SumSquaresKernel adam_scalar_sum_squares();
#if defined(__x86_64__)
SumSquaresKernel adam_avx2_sum_squares();
SumSquaresKernel adam_avx512_sum_squares();
#endif

// Runs `pass` over n elements on `num_threads` threads with the kernel of
// `level` (which must not exceed detected_simd_level()). grad_sq, where not
// null and the pass reads the gradient (kFused, kMoments), receives the sum of
// the gradient's squares, taken block by block right after each block's
// update; the same value for any thread count is not promised (summation order).
void adam_update(const AdamParams& params, const AdamBuffers& buffers, size_t n,
                 SimdLevel level, AdamPass pass, SqrtSource sqrt, int num_threads,
                 double* grad_sq = nullptr);

// out[i] = the kernel's sqrt of in[i], one thread; throws as adam_kernel_for.
void adam_sqrt(const float* in, float* out, size_t n, SimdLevel level, SqrtSource sqrt);

#if defined(__x86_64__)
// Note [prefetch ahead]
// The update is a stream: four arrays read (master, exp_avg, exp_avg_sq, the
// gradient), three written, each element once. The vector kernels ask for the
// line kPrefetchBytes ahead of each read stream at every iteration (twice per
// line for AVX2's 32-byte vectors: a repeat costs nothing). The hardware
// prefetchers follow the streams too, but the body's arithmetic (the square
// root and two divisions in torch's rounding) fills the reorder window, so
// fewer misses are in flight than the memory can serve: on a 2-core Xeon
// (AVX-512, 16M and 64M fp32, one thread, alternating builds) the update went
// from about 0.80 to 0.94 Gparam/s (1024 ahead; 2048 and 4096 were no
// better; benchmarks/RESULTS.md). Prefetches change no arithmetic; one past
// the end of an array is a hint, never a fault.
#ifndef OFFLOAD_PREFETCH_BYTES
#define OFFLOAD_PREFETCH_BYTES 1024
#endif
constexpr size_t kPrefetchBytes = OFFLOAD_PREFETCH_BYTES;

inline void prefetch_ahead(const AdamBuffers& b, size_t i, AdamPass pass) {
  if constexpr (kPrefetchBytes == 0) return;
  constexpr size_t ahead = kPrefetchBytes / sizeof(float);  // elements, for the fp32 streams
  _mm_prefetch(reinterpret_cast<const char*>(b.master + i + ahead), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(b.exp_avg + i + ahead), _MM_HINT_T0);
  if (pass == AdamPass::kApply) {
    _mm_prefetch(reinterpret_cast<const char*>(b.root + i + ahead), _MM_HINT_T0);
    return;
  }
  _mm_prefetch(reinterpret_cast<const char*>(b.exp_avg_sq + i + ahead), _MM_HINT_T0);
  const char* g = b.grad_type == ElementType::kFloat32
                      ? reinterpret_cast<const char*>(static_cast<const float*>(b.grad) + i + ahead)
                      : reinterpret_cast<const char*>(static_cast<const uint16_t*>(b.grad) + i + ahead);
  _mm_prefetch(g, _MM_HINT_T0);
}
#endif

// SqrtSource::kMklVml (adam_vml.cpp). bind_vml_sqrt finds MKL's vsSqrt in
// `library`, which this process must already have loaded; false if it cannot.
bool bind_vml_sqrt(const std::string& library);
bool vml_sqrt_bound();
void vml_sqrt(const float* in, float* out, size_t n);
// The fused update over [begin, end) as kMoments, vsSqrt, kApply per block.
void adam_vml_blocks(AdamKernel moments, AdamKernel apply, const AdamParams& a,
                     const AdamBuffers& b, size_t begin, size_t end);

}  // namespace offload
