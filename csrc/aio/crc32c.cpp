#include "crc32c.h"

#include <cstdlib>
#include <cstring>

#if defined(__x86_64__)
#include <cpuid.h>
#include <nmmintrin.h>
#endif

namespace offload {
namespace aio {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

struct Table {
  uint32_t v[256];
  Table() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
      v[i] = c;
    }
  }
};

const Table& table() {
  static const Table t;
  return t;
}

#if defined(__x86_64__)
// One dependent chain of 8-byte crc32 instructions: about 8 bytes per 3
// cycles, several times the disk's speed (measured in docs/AIO.md), so the
// three-stream interleave with its shift-and-combine step is not worth its
// code here.
__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(uint32_t crc, const void* data, size_t n) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  uint64_t c = ~crc;
  while (n > 0 && (reinterpret_cast<uintptr_t>(p) & 7) != 0) {
    c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
    --n;
  }
  while (n >= 32) {
    uint64_t w0, w1, w2, w3;
    std::memcpy(&w0, p, 8);
    std::memcpy(&w1, p + 8, 8);
    std::memcpy(&w2, p + 16, 8);
    std::memcpy(&w3, p + 24, 8);
    c = _mm_crc32_u64(c, w0);
    c = _mm_crc32_u64(c, w1);
    c = _mm_crc32_u64(c, w2);
    c = _mm_crc32_u64(c, w3);
    p += 32;
    n -= 32;
  }
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c = _mm_crc32_u64(c, w);
    p += 8;
    n -= 8;
  }
  while (n > 0) {
    c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
    --n;
  }
  return ~static_cast<uint32_t>(c);
}

bool has_sse42() {
  // OFFLOAD_SIMD=scalar (the kernels' override) forces the portable table too.
  const char* forced = std::getenv("OFFLOAD_SIMD");
  if (forced != nullptr && std::strcmp(forced, "scalar") == 0) return false;
  unsigned int eax, ebx, ecx, edx;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return false;
  return (ecx & (1u << 20)) != 0;
}
#endif

}  // namespace

uint32_t crc32c_reference(uint32_t crc, const void* data, size_t n) {
  const Table& t = table();
  const unsigned char* p = static_cast<const unsigned char*>(data);
  uint32_t c = ~crc;
  for (size_t i = 0; i < n; ++i) c = t.v[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return ~c;
}

uint32_t crc32c(uint32_t crc, const void* data, size_t n) {
#if defined(__x86_64__)
  static const bool hw = has_sse42();
  if (hw) return crc32c_sse42(crc, data, n);
#endif
  return crc32c_reference(crc, data, n);
}

const char* crc32c_impl_name() {
#if defined(__x86_64__)
  static const bool hw = has_sse42();
  if (hw) return "sse4.2";
#endif
  return "table";
}

}  // namespace aio
}  // namespace offload
