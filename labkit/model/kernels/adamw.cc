// The optimizer's per-gradient work, float32, for MindSpore ops.Custom(func_type="aot") on CPU.
//   SquareSum  : s = sum((k * g)^2)                 (one gradient's term of the global gradient norm)
//   AdamWUpdate: g' = g * gscale                    (gscale = clip factor / accumulation or loss-scale divisor)
//                m += (g' - m) * (1 - beta1);  v += (g'^2 - v) * (1 - beta2)
//                var -= lr * (m / (sqrt(v) + eps) + decay * var)
// AdamWUpdate is MindSpore's AdamWeightDecay (no bias correction, the same order of operations) with the gradient
// scaling folded in, and like it writes var, m and v in place: adamw.py declares them written (RW_WRITE), so the
// graph orders every later read after it. Without the fold, scaling and clipping are two more passes over every
// gradient (Div, Mul), and the norm a Square that writes a copy of each before its ReduceSum.
// -fno-math-errno (build.py's flags) lets std::sqrt vectorise (with errno it is a branch around a libm call).
#include <cmath>
#include <cstdint>
#include <initializer_list>

#include "aot.h"

// inputs k [1], g; output s (a scalar). Accumulated in double: 10^6 squares summed in float32 lose ~3 digits.
extern "C" int SquareSum(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                         void *stream, void *extra) {
  if (nparam != 3 || !all_float32(nparam, dtypes) || numel(ndims[0], shapes[0]) != 1) return 1;
  const float k = *static_cast<const float *>(params[0]);
  const float *g = static_cast<const float *>(params[1]);
  const int64_t n = numel(ndims[1], shapes[1]);
  double s = 0.0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) {
    const float x = k * g[i];
    s += static_cast<double>(x) * x;
  }
  *static_cast<float *>(params[2]) = static_cast<float>(s);
  return 0;
}

// inputs var, m, v (updated in place), lr, beta1, beta2, eps, decay, g, gscale; output: a [1] zero
extern "C" int AdamWUpdate(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                           void *stream, void *extra) {
  if (nparam != 11 || !all_float32(nparam, dtypes)) return 1;
  const int64_t n = numel(ndims[0], shapes[0]);
  for (int i : {1, 2, 8})  // m, v and g must hold as many values as var: the loop reads and writes n of each
    if (numel(ndims[i], shapes[i]) != n) return 1;
  for (int i : {3, 4, 5, 6, 7, 9, 10})
    if (numel(ndims[i], shapes[i]) != 1) return 1;
  float *var = static_cast<float *>(params[0]);
  float *m = static_cast<float *>(params[1]);
  float *v = static_cast<float *>(params[2]);
  const float lr = *static_cast<const float *>(params[3]);
  const float b1 = 1.f - *static_cast<const float *>(params[4]);
  const float b2 = 1.f - *static_cast<const float *>(params[5]);
  const float eps = *static_cast<const float *>(params[6]);
  const float decay = *static_cast<const float *>(params[7]);
  const float *g = static_cast<const float *>(params[8]);
  const float gscale = *static_cast<const float *>(params[9]);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i] * gscale;
    const float mi = m[i] + (gi - m[i]) * b1;
    const float vi = v[i] + (gi * gi - v[i]) * b2;
    m[i] = mi;
    v[i] = vi;
    var[i] -= lr * (mi / (std::sqrt(vi) + eps) + decay * var[i]);
  }
  *static_cast<float *>(params[10]) = 0.f;
  return 0;
}
