// Kernel selection, the shared tail handling, and the threaded driver.
#include <algorithm>
#include <cstring>
#include <string>
#include <stdexcept>

#include "../common/thread_pool.h"
#include "adam_kernels.h"

namespace offload {

void adam_padded_tail(const AdamParams& a, const AdamBuffers& b, size_t i, size_t end,
                      size_t lanes, AdamVectorBody body) {
  // The vector body reads and writes exactly `lanes` elements; give it
  // zero-padded copies so the tail gets the same arithmetic as the body
  // without touching memory past the caller's buffers.
  constexpr size_t kMaxLanes = 16;
  if (lanes > kMaxLanes || end - i > lanes) throw std::logic_error("adam tail wider than a vector");
  const size_t rest = end - i;
  alignas(64) float master[kMaxLanes] = {}, m[kMaxLanes] = {}, v[kMaxLanes] = {};
  alignas(64) float grad[kMaxLanes] = {};  // room for fp32, or 16-bit grads in the first half
  alignas(64) uint16_t out[kMaxLanes] = {};
  const size_t gsize = b.grad_type == ElementType::kFloat32 ? 4 : 2;
  std::memcpy(master, b.master + i, rest * 4);
  std::memcpy(m, b.exp_avg + i, rest * 4);
  std::memcpy(v, b.exp_avg_sq + i, rest * 4);
  std::memcpy(grad, static_cast<const char*>(b.grad) + i * gsize, rest * gsize);
  const AdamBuffers tail{master, grad, b.grad_type, m, v, b.out ? out : nullptr, b.out_type};
  body(a, tail, 0);
  std::memcpy(b.master + i, master, rest * 4);
  std::memcpy(b.exp_avg + i, m, rest * 4);
  std::memcpy(b.exp_avg_sq + i, v, rest * 4);
  if (b.out != nullptr) std::memcpy(static_cast<uint16_t*>(b.out) + i, out, rest * 2);
}

AdamKernel adam_kernel_for(SimdLevel level) {
  if (static_cast<int>(level) > static_cast<int>(detected_simd_level())) {
    throw std::invalid_argument(std::string("SIMD level ") + simd_level_name(level) +
                                " is not supported by this CPU (detected " +
                                simd_level_name(detected_simd_level()) + ")");
  }
  switch (level) {
#if defined(__x86_64__)
    case SimdLevel::kAvx512: return &adam_kernel_avx512;
    case SimdLevel::kAvx2: return &adam_kernel_avx2;
#endif
    default: return &adam_kernel_scalar;
  }
}

void adam_update(const AdamParams& params, const AdamBuffers& buffers, size_t n, SimdLevel level,
                 int num_threads) {
  const AdamKernel kernel = adam_kernel_for(level);
  // Below this many elements a second thread costs more than it saves.
  constexpr size_t kMinPerThread = 1 << 15;
  const int useful = static_cast<int>(std::max<size_t>(1, n / kMinPerThread));
  // Ranges start on 64-element (256-byte) boundaries: whole cache lines and
  // whole vectors for every kernel, so threads never share a line.
  ThreadPool::instance().parallel_for(
      n, 64, std::min(num_threads, useful),
      [&](size_t begin, size_t end) { kernel(params, buffers, begin, end); });
}

}  // namespace offload
