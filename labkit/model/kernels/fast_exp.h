// exp(x) for x <= 0 in float32, written so that g++ vectorises it under `#pragma omp simd` without -ffast-math
// (g++ leaves std::exp as one scalar libm call per element, ~10x slower in these loops). Shared by xent.cc (the
// softmax, the row max subtracted first) and swiglu.cc (the sigmoid, from exp(-|g|)).
// A Cephes-style polynomial: relative error below 8.4e-8 (under one float32 ulp) over every float in [-87, 0].
// Clamped at -87.3 (exp = 1.2e-38, the smallest normal float times ~1): below it, and for -inf, the result is
// ~1.2e-38 instead of a subnormal or 0, nothing against the 1 it is added to in both callers.
// No std::floor (a scalar call), n rounded to nearest by adding and subtracting 1.5 * 2^23, 2^n built from its
// bits with __builtin_bit_cast (no memcpy), no select after the clamp.
#ifndef LABKIT_KERNELS_FAST_EXP_H_
#define LABKIT_KERNELS_FAST_EXP_H_

#include <cstdint>

inline float exp_nonpositive(float x) {
  const float xc = x < -87.3f ? -87.3f : x;
  const float n = (xc * 1.44269504088896341f + 12582912.f) - 12582912.f;  // x = n ln2 + r, |r| <= ln2 / 2
  float r = xc - n * 0.693359375f;                                         // ln2 in two parts (Cody-Waite)
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n, n >= -126: a normal float
  return e * __builtin_bit_cast(float, bits);
}

#endif  // LABKIT_KERNELS_FAST_EXP_H_
