// Element access for dp-perf's result checks: every dtype read and written
// as a double. Exact for the small integers and halves the checks use.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "dparallel/dp_base.h"

namespace perf {

inline uint16_t half_bits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u;
  if ((x & 0x7fffffffu) == 0) return static_cast<uint16_t>(sign);
  uint32_t exponent = ((x >> 23) & 0xffu) - 127u + 15u;
  return static_cast<uint16_t>(sign | (exponent << 10) | ((x >> 13) & 0x3ffu));
}

inline float half_value(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  uint32_t x = (exponent == 0 && mantissa == 0) ? sign : sign | ((exponent - 15 + 127) << 23) | (mantissa << 13);
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

inline void store(int32_t dtype, void* base, int64_t i, double v) {
  switch (dtype) {
    case DP_FLOAT32:
      static_cast<float*>(base)[i] = static_cast<float>(v);
      break;
    case DP_FLOAT64:
      static_cast<double*>(base)[i] = v;
      break;
    case DP_FLOAT16:
      static_cast<uint16_t*>(base)[i] = half_bits(static_cast<float>(v));
      break;
    case DP_BFLOAT16: {
      float f = static_cast<float>(v);
      uint32_t x;
      std::memcpy(&x, &f, 4);
      static_cast<uint16_t*>(base)[i] = static_cast<uint16_t>(x >> 16);
      break;
    }
    case DP_INT8:
      static_cast<int8_t*>(base)[i] = static_cast<int8_t>(v);
      break;
    case DP_UINT8:
      static_cast<uint8_t*>(base)[i] = static_cast<uint8_t>(v);
      break;
    case DP_INT32:
      static_cast<int32_t*>(base)[i] = static_cast<int32_t>(v);
      break;
    case DP_INT64:
      static_cast<int64_t*>(base)[i] = static_cast<int64_t>(v);
      break;
    case DP_BOOL:
      static_cast<uint8_t*>(base)[i] = v != 0 ? 1 : 0;
      break;
    default:
      break;
  }
}

inline double load(int32_t dtype, const void* base, int64_t i) {
  switch (dtype) {
    case DP_FLOAT32:
      return static_cast<const float*>(base)[i];
    case DP_FLOAT64:
      return static_cast<const double*>(base)[i];
    case DP_FLOAT16:
      return half_value(static_cast<const uint16_t*>(base)[i]);
    case DP_BFLOAT16: {
      uint32_t x = static_cast<uint32_t>(static_cast<const uint16_t*>(base)[i]) << 16;
      float f;
      std::memcpy(&f, &x, 4);
      return f;
    }
    case DP_INT8:
      return static_cast<const int8_t*>(base)[i];
    case DP_UINT8:
      return static_cast<const uint8_t*>(base)[i];
    case DP_INT32:
      return static_cast<const int32_t*>(base)[i];
    case DP_INT64:
      return static_cast<double>(static_cast<const int64_t*>(base)[i]);
    case DP_BOOL:
      return static_cast<const uint8_t*>(base)[i];
    default:
      return NAN;
  }
}

}  // namespace perf
