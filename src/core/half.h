// float16 / bfloat16 <-> float32 conversions (round to nearest even).
#pragma once

#include <cstdint>
#include <cstring>

namespace dparallel {

inline float bits_to_float(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

inline uint32_t float_to_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

inline float half_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return bits_to_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {
    if (mantissa == 0) return bits_to_float(sign);
    // Subnormal: value = mantissa * 2^-24.
    float magnitude = static_cast<float>(mantissa) * (1.0f / 16777216.0f);
    return sign ? -magnitude : magnitude;
  }
  return bits_to_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

inline uint16_t float_to_half(float value) {
  uint32_t bits = float_to_bits(value);
  uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  uint32_t abs_bits = bits & 0x7fffffffu;
  if (abs_bits >= 0x7f800000u) {  // inf or nan
    return static_cast<uint16_t>(sign | 0x7c00u | (abs_bits > 0x7f800000u ? 0x200u : 0u));
  }
  if (abs_bits >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (abs_bits < 0x38800000u) {                                               // subnormal or zero in half
    // Adding 0.5 shifts the mantissa so that float rounding does the half rounding.
    float magnitude = bits_to_float(abs_bits) + 0.5f;
    return static_cast<uint16_t>(sign | (float_to_bits(magnitude) - 0x3f000000u));
  }
  uint32_t mantissa_odd = (abs_bits >> 13) & 1u;
  abs_bits += 0xc8000fffu + mantissa_odd;  // rebias exponent and round to nearest even
  return static_cast<uint16_t>(sign | (abs_bits >> 13));
}

inline float bfloat16_to_float(uint16_t b) { return bits_to_float(static_cast<uint32_t>(b) << 16); }

inline uint16_t float_to_bfloat16(float value) {
  uint32_t bits = float_to_bits(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // quiet nan
  uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

}  // namespace dparallel
