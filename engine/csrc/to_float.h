// Element loads in fp32. bf16 -> fp32 is a 16-bit shift, spelled out so that compilers vectorize it.
#pragma once
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

namespace pdserve {

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

template <>
inline float to_float<c10::BFloat16>(c10::BFloat16 x) {
  uint32_t bits = uint32_t(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

}  // namespace pdserve
