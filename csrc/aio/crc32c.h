// CRC-32C (Castagnoli), the checksum of the swap and checkpoint files.
//
// Why CRC-32C and not zlib's CRC-32: x86 has an instruction for it (SSE4.2
// crc32), so the checked path costs a fraction of the disk time, where
// zlib.crc32 measured 3.1 GB/s on the reference machine, about the disk's own
// speed (figures in docs/AIO.md). The instruction path is chosen at run time
// from cpuid; a portable table-driven reference sits next to it and the tests
// compare the two.
#pragma once

#include <cstddef>
#include <cstdint>

namespace offload {
namespace aio {

// Continues `crc` (0 to start) over [data, data + n); chaining calls over
// consecutive pieces gives the CRC of the concatenation.
uint32_t crc32c(uint32_t crc, const void* data, size_t n);
uint32_t crc32c_reference(uint32_t crc, const void* data, size_t n);

// "sse4.2" or "table": what crc32c() runs on this CPU.
const char* crc32c_impl_name();

}  // namespace aio
}  // namespace offload
