// Scalar conversions between fp32 and the 16-bit float formats, bit-exact
// with torch's own CPU `tensor.to(dtype)` (checked against torch 2.13 by
// tests/test_adam_kernel.py): round to nearest even; a bf16 NaN is 0xFFFF
// (ATen's vectorised conversion); a fp16 NaN keeps its sign and the top of its
// payload, quieted, as the F16C instruction does. The SIMD kernels match.
#pragma once

#include <cstdint>
#include <cstring>

namespace offload {

inline uint32_t f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float f32_from_bits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

inline float bf16_to_f32(uint16_t h) { return f32_from_bits(static_cast<uint32_t>(h) << 16); }

inline uint16_t f32_to_bf16(float f) {
  if (f != f) return 0xFFFF;
  const uint32_t u = f32_bits(f);
  const uint32_t rounding_bias = ((u >> 16) & 1u) + 0x7FFFu;
  return static_cast<uint16_t>((u + rounding_bias) >> 16);
}

// IEEE half <-> single, after the FP16 library torch uses (Maratyszcza/FP16).
inline float f16_to_f32(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const uint32_t exp_offset = 0xE0u << 23;
  const float exp_scale = f32_from_bits(0x7800000u);  // 2^-112
  const float normalized = f32_from_bits((two_w >> 4) + exp_offset) * exp_scale;
  const uint32_t magic_mask = 126u << 23;
  const float magic_bias = 0.5f;
  const float denormalized = f32_from_bits((two_w >> 17) | magic_mask) - magic_bias;
  const uint32_t denormalized_cutoff = 1u << 27;
  const uint32_t result =
      sign | (two_w < denormalized_cutoff ? f32_bits(denormalized) : f32_bits(normalized));
  return f32_from_bits(result);
}

inline uint16_t f32_to_f16(float f) {
  if (f != f) {  // quiet NaN, sign and payload top bits kept (as VCVTPS2PH)
    const uint32_t u = f32_bits(f);
    return static_cast<uint16_t>(((u >> 16) & 0x8000u) | 0x7E00u | ((u & 0x7FFFFFu) >> 13));
  }
  const float scale_to_inf = f32_from_bits(0x77800000u);   // 2^112
  const float scale_to_zero = f32_from_bits(0x08800000u);  // 2^-110
  float base = (f < 0 ? -f : f) * scale_to_inf * scale_to_zero;
  const uint32_t w = f32_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = f32_from_bits((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = f32_bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | nonsign);
}

}  // namespace offload
