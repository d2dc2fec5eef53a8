#include "cpu_features.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#include <cstdint>
#endif

namespace offload {
namespace {

#if defined(__x86_64__) || defined(_M_X64)
// XCR0 tells which register files the OS saves on a context switch; a CPU
// flag alone is not enough (a hypervisor may hide zmm state).
uint64_t read_xcr0() {
  uint32_t eax = 0, edx = 0;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

SimdLevel probe() {
  unsigned int eax, ebx, ecx, edx;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return SimdLevel::kScalar;
  const bool osxsave = ecx & (1u << 27);
  const bool fma = ecx & (1u << 12);
  const bool f16c = ecx & (1u << 29);
  const bool avx = ecx & (1u << 28);
  if (!osxsave || !avx) return SimdLevel::kScalar;
  const uint64_t xcr0 = read_xcr0();
  const bool ymm_saved = (xcr0 & 0x6) == 0x6;
  const bool zmm_saved = (xcr0 & 0xE6) == 0xE6;
  if (!ymm_saved) return SimdLevel::kScalar;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return SimdLevel::kScalar;
  const bool avx2 = ebx & (1u << 5);
  const bool avx512f = ebx & (1u << 16);
  if (!(avx2 && fma && f16c)) return SimdLevel::kScalar;
  if (avx512f && zmm_saved) return SimdLevel::kAvx512;
  return SimdLevel::kAvx2;
}
#else
SimdLevel probe() { return SimdLevel::kScalar; }
#endif

}  // namespace

SimdLevel detected_simd_level() {
  static const SimdLevel level = probe();
  return level;
}

const char* simd_level_name(SimdLevel level) {
  switch (level) {
    case SimdLevel::kScalar: return "scalar";
    case SimdLevel::kAvx2: return "avx2";
    case SimdLevel::kAvx512: return "avx512";
  }
  return "unknown";
}

}  // namespace offload
