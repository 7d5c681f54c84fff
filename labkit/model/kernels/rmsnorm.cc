// RMSNorm over the last axis, float32, for MindSpore ops.Custom(func_type="aot") on CPU.
//   forward : y = x * rstd * w,           rstd = 1 / sqrt(mean(x^2) + eps)   (one rstd per row)
//   backward: dx = rstd * (g - xhat * mean(g * xhat)),  g = dy * w,  xhat = x * rstd
//             dw = sum over rows of dy * xhat
// Inputs are x [..., H], w [H], eps [1]; every tensor is contiguous float32.
// AOT signature: params holds the inputs, then the outputs; shapes/ndims describe each of them.
// Single-threaded, vectorised (`#pragma omp simd` under -fopenmp-simd): MindSpore runs the operator on one of its
// own pool threads, and an OpenMP team of our own would compete with the pool's threads for the same cores.
#include <cmath>
#include <cstdint>

#include "aot.h"

namespace {

inline float row_rstd(const float *x, int64_t h, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t j = 0; j < h; ++j) ss += x[j] * x[j];
  return 1.f / std::sqrt(ss / static_cast<float>(h) + eps);
}

}  // namespace

extern "C" int RmsNormForward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                              void *stream, void *extra) {
  if (nparam != 4 || !all_float32(nparam, dtypes)) return 1;
  const float *x = static_cast<const float *>(params[0]);
  const float *w = static_cast<const float *>(params[1]);
  const float eps = static_cast<const float *>(params[2])[0];
  float *y = static_cast<float *>(params[3]);
  const int64_t h = shapes[0][ndims[0] - 1];
  const int64_t n = numel(ndims[0] - 1, shapes[0]);
  for (int64_t r = 0; r < n; ++r) {
    const float *xr = x + r * h;
    float *yr = y + r * h;
    const float rstd = row_rstd(xr, h, eps);
#pragma omp simd
    for (int64_t j = 0; j < h; ++j) yr[j] = xr[j] * rstd * w[j];
  }
  return 0;
}

// inputs x, w, eps, dy; outputs dx [..., H], dw [H]
extern "C" int RmsNormBackward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                               void *stream, void *extra) {
  if (nparam != 6 || !all_float32(nparam, dtypes)) return 1;
  const float *x = static_cast<const float *>(params[0]);
  const float *w = static_cast<const float *>(params[1]);
  const float eps = static_cast<const float *>(params[2])[0];
  const float *dy = static_cast<const float *>(params[3]);
  float *dx = static_cast<float *>(params[4]);
  float *dw = static_cast<float *>(params[5]);
  const int64_t h = shapes[0][ndims[0] - 1];
  const int64_t n = numel(ndims[0] - 1, shapes[0]);
  for (int64_t j = 0; j < h; ++j) dw[j] = 0.f;
  for (int64_t r = 0; r < n; ++r) {
    const float *xr = x + r * h, *gr = dy + r * h;
    float *dxr = dx + r * h;
    const float rstd = row_rstd(xr, h, eps);
    float dot = 0.f;  // sum of (dy * w) * x over the row
#pragma omp simd reduction(+ : dot)
    for (int64_t j = 0; j < h; ++j) dot += gr[j] * w[j] * xr[j];
    const float c = dot * rstd * rstd / static_cast<float>(h);
#pragma omp simd
    for (int64_t j = 0; j < h; ++j) {
      dxr[j] = rstd * (gr[j] * w[j] - xr[j] * c);
      dw[j] += gr[j] * xr[j] * rstd;
    }
  }
  return 0;
}
