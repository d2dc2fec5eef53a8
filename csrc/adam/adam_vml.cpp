// The fused update with MKL's own vsSqrt as its square root (SqrtSource::
// kMklVml), for a CPU where torch.sqrt is MKL's but neither sqrt a kernel
// computes in registers (Note [bitwise torch order], rule 1). MKL is not a
// build dependency: the symbol is looked up at run time in the library torch
// already loaded (libtorch_cpu links MKL statically and exports its Fortran
// entry points), and the probe checks it against torch.sqrt before use.
//
// Per thread range, block by block: the level's kMoments kernel (m, v), then
// vsSqrt of the block's v into a stack buffer, then its kApply kernel (p and
// the low-precision copy). A block's m, v and root stay in L1 between the
// three, so the passes cost little more than the fused one.
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <string>

#include "adam_kernels.h"

namespace offload {
namespace {

// VSSQRT(n, a, r): MKL's Fortran-style vsSqrt, LP64 (32-bit n).
using VmlSqrt = void (*)(const int* n, const float* a, float* r);
std::atomic<VmlSqrt> g_vml_sqrt{nullptr};
// MKL_Set_Num_Threads_Local(n) (the C entry; the lower-case names are the
// Fortran one, which takes a pointer): MKL's thread count for the calling thread
// only (0: back to the global one); returns the previous local value.
using SetLocalThreads = int (*)(int n);
std::atomic<SetLocalThreads> g_set_local_threads{nullptr};

// Called from a thread that is not one of OpenMP's (the pool's, or Python's),
// vsSqrt opens an OpenMP team of its own even for a short block, whose
// spinning threads cost several times the update (seen: 5x the CPU time on
// two threads). One MKL thread per calling thread for the block loop, then
// the caller's setting back, so torch's own MKL calls are untouched.
class OneMklThread {
 public:
  OneMklThread() : set_(g_set_local_threads.load()) {
    if (set_ != nullptr) previous_ = set_(1);
  }
  ~OneMklThread() {
    if (set_ != nullptr) set_(previous_);
  }
  OneMklThread(const OneMklThread&) = delete;
  OneMklThread& operator=(const OneMklThread&) = delete;

 private:
  SetLocalThreads set_;
  int previous_ = 0;
};

// Elements per block: 4 KiB of each array, a multiple of every vector width,
// and small enough that MKL never threads the call.
constexpr size_t kBlock = 1024;

}  // namespace

bool bind_vml_sqrt(const std::string& library) {
  // RTLD_NOLOAD: only a library this process already loaded (torch's own).
  void* handle = dlopen(library.c_str(), RTLD_NOLOAD | RTLD_LAZY | RTLD_LOCAL);
  if (handle == nullptr) return false;
  auto fn = reinterpret_cast<VmlSqrt>(dlsym(handle, "VSSQRT_"));
  if (fn == nullptr) return false;  // the handle stays open: torch keeps the library anyway
  g_set_local_threads.store(
      reinterpret_cast<SetLocalThreads>(dlsym(handle, "MKL_Set_Num_Threads_Local")));
  g_vml_sqrt.store(fn);
  return true;
}

bool vml_sqrt_bound() { return g_vml_sqrt.load() != nullptr; }

void vml_sqrt(const float* in, float* out, size_t n) {
  const VmlSqrt fn = g_vml_sqrt.load();
  const OneMklThread one_thread;
  for (size_t i = 0; i < n;) {
    const int len = static_cast<int>(std::min<size_t>(n - i, INT_MAX));
    fn(&len, in + i, out + i);
    i += static_cast<size_t>(len);
  }
}

void adam_vml_blocks(AdamKernel moments, AdamKernel apply, const AdamParams& a,
                     const AdamBuffers& b, size_t begin, size_t end) {
  alignas(64) float root[kBlock];
  const OneMklThread one_thread;
  const VmlSqrt sqrt_block = g_vml_sqrt.load();
  const size_t gsize = b.grad_type == ElementType::kFloat32 ? 4 : 2;
  for (size_t i = begin; i < end; i += kBlock) {
    const size_t len = std::min(kBlock, end - i);
    // The block as buffers of its own, so the kernels index root from 0.
    const AdamBuffers block{b.master + i,
                            static_cast<const char*>(b.grad) + i * gsize,
                            b.grad_type,
                            b.exp_avg + i,
                            b.exp_avg_sq + i,
                            b.out ? static_cast<uint16_t*>(b.out) + i : nullptr,
                            b.out_type,
                            root};
    moments(a, block, 0, len);
    const int n = static_cast<int>(len);
    sqrt_block(&n, block.exp_avg_sq, root);
    apply(a, block, 0, len);
  }
}

}  // namespace offload
