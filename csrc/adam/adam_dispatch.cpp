// Kernel selection, the shared tail handling, and the threaded driver.
#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>
#include <string>
#include <stdexcept>

#include "../common/thread_pool.h"
#include "adam_kernels.h"

namespace offload {

void adam_padded_tail(const AdamParams& a, const AdamBuffers& b, size_t i, size_t end,
                      size_t lanes, AdamPass pass, AdamVectorBody body) {
  // The vector body reads and writes exactly `lanes` elements; give it
  // zero-padded copies so the tail gets the same arithmetic as the body
  // without touching memory past the caller's buffers.
  constexpr size_t kMaxLanes = 16;
  if (lanes > kMaxLanes || end - i > lanes) throw std::logic_error("adam tail wider than a vector");
  const size_t rest = end - i;
  alignas(64) float master[kMaxLanes] = {}, m[kMaxLanes] = {}, v[kMaxLanes] = {};
  alignas(64) float grad[kMaxLanes] = {};  // room for fp32, or 16-bit grads in the first half
  alignas(64) float root[kMaxLanes] = {};
  alignas(64) uint16_t out[kMaxLanes] = {};
  const size_t gsize = b.grad_type == ElementType::kFloat32 ? 4 : 2;
  std::memcpy(master, b.master + i, rest * 4);
  std::memcpy(m, b.exp_avg + i, rest * 4);
  std::memcpy(v, b.exp_avg_sq + i, rest * 4);
  if (pass != AdamPass::kApply) {
    std::memcpy(grad, static_cast<const char*>(b.grad) + i * gsize, rest * gsize);
  } else {
    std::memcpy(root, b.root + i, rest * 4);
  }
  const bool writes_p = pass != AdamPass::kMoments;
  const AdamBuffers tail{master, grad, b.grad_type, m, v,
                         writes_p && b.out ? out : nullptr, b.out_type, root};
  body(a, tail, 0);
  if (pass != AdamPass::kApply) {
    std::memcpy(b.exp_avg + i, m, rest * 4);
    std::memcpy(b.exp_avg_sq + i, v, rest * 4);
  }
  if (writes_p) {
    std::memcpy(b.master + i, master, rest * 4);
    if (b.out != nullptr) std::memcpy(static_cast<uint16_t*>(b.out) + i, out, rest * 2);
  }
}

namespace {

void check_level(SimdLevel level) {
  if (static_cast<int>(level) > static_cast<int>(detected_simd_level())) {
    throw std::invalid_argument(std::string("SIMD level ") + simd_level_name(level) +
                                " is not supported by this CPU (detected " +
                                simd_level_name(detected_simd_level()) + ")");
  }
}

[[noreturn]] void no_such_sqrt(SimdLevel level, SqrtSource sqrt) {
  throw std::invalid_argument(std::string("the ") + simd_level_name(level) +
                              " kernel cannot compute the " + sqrt_source_name(sqrt) +
                              " square root (mkl-avx512 needs the avx512 kernel, mkl-avx2 and mkl-sse the avx2 or "
                              "avx512 kernel, mkl-vml "
                              "MKL's vsSqrt bound first)");
}

AdamKernel level_kernel(SimdLevel level, AdamPass pass, SqrtSource sqrt) {
  switch (level) {
#if defined(__x86_64__)
    case SimdLevel::kAvx512: return adam_avx512_kernel(pass, sqrt);
    case SimdLevel::kAvx2: return adam_avx2_kernel(pass, sqrt);
#endif
    default: return adam_scalar_kernel(pass, sqrt);
  }
}

// kFused with kMklVml: the level's two halves around vsSqrt, block by block.
template <SimdLevel L>
void vml_fused(const AdamParams& a, const AdamBuffers& b, size_t begin, size_t end) {
  static const AdamKernel moments = level_kernel(L, AdamPass::kMoments, SqrtSource::kIeee);
  static const AdamKernel apply = level_kernel(L, AdamPass::kApply, SqrtSource::kIeee);
  adam_vml_blocks(moments, apply, a, b, begin, end);
}

}  // namespace

AdamKernel adam_kernel_for(SimdLevel level, AdamPass pass, SqrtSource sqrt) {
  check_level(level);
  if (sqrt == SqrtSource::kMklVml) {
    if (!vml_sqrt_bound()) no_such_sqrt(level, sqrt);
    if (pass != AdamPass::kFused) return level_kernel(level, pass, SqrtSource::kIeee);
    switch (level) {
      case SimdLevel::kAvx512: return &vml_fused<SimdLevel::kAvx512>;
      case SimdLevel::kAvx2: return &vml_fused<SimdLevel::kAvx2>;
      default: return &vml_fused<SimdLevel::kScalar>;
    }
  }
  const AdamKernel kernel = level_kernel(level, pass, sqrt);
  if (kernel == nullptr) no_such_sqrt(level, sqrt);
  return kernel;
}

void adam_sqrt(const float* in, float* out, size_t n, SimdLevel level, SqrtSource sqrt) {
  check_level(level);
  if (sqrt == SqrtSource::kMklVml) {
    if (!vml_sqrt_bound()) no_such_sqrt(level, sqrt);
    return vml_sqrt(in, out, n);
  }
  SqrtKernel kernel = nullptr;
  switch (level) {
#if defined(__x86_64__)
    case SimdLevel::kAvx512: kernel = adam_avx512_sqrt(sqrt); break;
    case SimdLevel::kAvx2: kernel = adam_avx2_sqrt(sqrt); break;
#endif
    default: kernel = adam_scalar_sqrt(sqrt); break;
  }
  if (kernel == nullptr) no_such_sqrt(level, sqrt);
  kernel(in, out, n);
}

namespace {

SumSquaresKernel sum_squares_for(SimdLevel level) {
  switch (level) {
#if defined(__x86_64__)
    case SimdLevel::kAvx512: return adam_avx512_sum_squares();
    case SimdLevel::kAvx2: return adam_avx2_sum_squares();
#endif
    default: return adam_scalar_sum_squares();
  }
}

}  // namespace

void adam_update(const AdamParams& params, const AdamBuffers& buffers, size_t n, SimdLevel level,
                 AdamPass pass, SqrtSource sqrt, int num_threads, double* grad_sq) {
  const AdamKernel kernel = adam_kernel_for(level, pass, sqrt);
  // Below this many elements a second thread costs more than it saves.
  constexpr size_t kMinPerThread = 1 << 15;
  const int useful = static_cast<int>(std::max<size_t>(1, n / kMinPerThread));
  const int threads = std::min(num_threads, useful);
  // Chunks of 64K elements taken in turn (Note [chunks taken in turn] in
  // thread_pool.cpp); they start on 64-element (256-byte) boundaries, whole
  // cache lines and whole vectors for every kernel, so threads never share a line.
  constexpr size_t kChunk = 1 << 16;
  const size_t chunks = (n + kChunk - 1) / kChunk;
  if (grad_sq == nullptr || pass == AdamPass::kApply) {
    if (grad_sq != nullptr) *grad_sq = 0.0;
    ThreadPool::instance().parallel_chunks(chunks, threads, [&](size_t i) {
      kernel(params, buffers, i * kChunk, std::min(n, (i + 1) * kChunk));
    });
    return;
  }
  // The norm's term read from cache: each chunk in blocks of 16 KiB of fp32
  // gradient, each block's squares summed right after its update read it (a
  // second pass over the whole gradient read it from memory again: 23% of the
  // update's time, 16M elements on one core). Blocks start on multiples of
  // 64 elements, so the kernel computes what one call over the whole would:
  // every element alone, tails padded the same way. The chunks' sums are
  // added in chunk order: the same value on any number of threads.
  constexpr size_t kBlock = 4096;
  static_assert(kChunk % kBlock == 0, "a chunk is whole blocks");
  const SumSquaresKernel squares = sum_squares_for(level);
  std::vector<double> sums(chunks, 0.0);
  ThreadPool::instance().parallel_chunks(chunks, threads, [&](size_t i) {
    const size_t end = std::min(n, (i + 1) * kChunk);
    double sum = 0.0;
    for (size_t b = i * kChunk; b < end; b += kBlock) {
      const size_t e = std::min(end, b + kBlock);
      kernel(params, buffers, b, e);
      sum += squares(buffers, b, e);
    }
    sums[i] = sum;
  });
  double total = 0.0;
  for (const double part : sums) total += part;
  *grad_sq = total;
}

}  // namespace offload
