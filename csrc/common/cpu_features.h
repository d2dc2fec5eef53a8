// Run-time CPU feature detection. The build never uses -march=native: every
// SIMD kernel is compiled for its own target with a function attribute and the
// one to run is picked here, from cpuid and the OS's saved-register support.
#pragma once

namespace offload {

// Ordered: a level implies the ones below it.
enum class SimdLevel : int {
  kScalar = 0,  // portable C++, any CPU
  kAvx2 = 1,    // AVX2 + FMA + F16C
  kAvx512 = 2,  // AVX-512F (zmm state enabled by the OS)
};

// Highest level this CPU and OS support. Cached after the first call.
SimdLevel detected_simd_level();

const char* simd_level_name(SimdLevel level);

}  // namespace offload
