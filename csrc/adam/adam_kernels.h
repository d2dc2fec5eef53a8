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
// sqrt is the one op whose bits depend on the CPU: torch.sqrt runs MKL's
// vsSqrt, which is correctly rounded on MKL's AVX2 path but not on its AVX-512
// path (1 ulp low in ~0.7% of inputs; SSE4.2: ~19%). The AVX-512 kernel
// reproduces MKL's AVX-512 sequence exactly (sqrt_as_torch in
// adam_avx512.cpp); the AVX2 and scalar kernels take the IEEE sqrt. So where
// MKL takes its AVX-512 path (checked) or its AVX2 path (checked with
// MKL_ENABLE_INSTRUCTIONS=AVX2), the kernel the CPU selects by default equals
// torch bit for bit; a lower level forced on an AVX-512 CPU (OFFLOAD_SIMD)
// equals torch's op order with IEEE sqrt, each sqrt within 1 ulp of torch's.
#pragma once

#include <cstddef>
#include <algorithm>
#include <cstdint>

#include "../common/cpu_features.h"

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
