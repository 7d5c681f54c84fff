// Softmax cross-entropy over the rows of the logits, float32 logits and int32 labels, for MindSpore
// ops.Custom(func_type="aot") on CPU.
//   forward : loss[r]    = logsumexp(x[r]) - x[r][label[r]]   (the row max subtracted first: no overflow)
//   backward: dx[r][j]   = (softmax(x[r])[j] - [j == label[r]]) * dloss[r]   (softmax recomputed, never stored)
// Inputs are logits [N, V], labels [N] and, for the backward, dloss [N]; every tensor is contiguous.
// A label outside [0, V) (an ignore index such as -100) is handled as mindformers' CrossEntropyLoss does: its
// one-hot row is all zeros, so the loss is 0 and the gradient is softmax * dloss (the mask then multiplies both
// away). Single-threaded and vectorised, like rmsnorm.cc. The exponential is fast_exp.h's exp_nonpositive (a
// polynomial `#pragma omp simd` vectorises; std::exp stays one scalar libm call per element without -ffast-math).
#include <cmath>
#include <cstdint>
#include <cstring>  // strcmp

#include "fast_exp.h"

namespace {

bool dtypes_are(int nparam, const char **dtypes, const char *const *want) {
  for (int i = 0; i < nparam; ++i)
    if (std::strcmp(dtypes[i], want[i]) != 0) return false;
  return true;
}

// logits [N, V], then every other tensor [N] (labels, dloss, loss); the gradient output checked by the caller
bool shapes_ok(int first_rows, int nparam, const int *ndims, int64_t *const *shapes) {
  if (ndims[0] != 2) return false;
  for (int i = first_rows; i < nparam; ++i)
    if (ndims[i] != 1 || shapes[i][0] != shapes[0][0]) return false;
  return true;
}

inline float row_max(const float *x, int64_t v) {
  float m = x[0];
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < v; ++j) m = x[j] > m ? x[j] : m;
  return m;
}

}  // namespace

// inputs logits [N, V] float32, labels [N] int32; output loss [N] float32
extern "C" int SoftmaxXentForward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                  void *stream, void *extra) {
  static const char *const want[] = {"float32", "int32", "float32"};
  if (nparam != 3 || !dtypes_are(nparam, dtypes, want) || !shapes_ok(1, nparam, ndims, shapes)) return 1;
  const float *x = static_cast<const float *>(params[0]);
  const int32_t *label = static_cast<const int32_t *>(params[1]);
  float *loss = static_cast<float *>(params[2]);
  const int64_t n = shapes[0][0], v = shapes[0][1];
  if (v <= 0) return 1;
  for (int64_t r = 0; r < n; ++r) {
    const float *xr = x + r * v;
    const float m = row_max(xr, v);
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t j = 0; j < v; ++j) s += exp_nonpositive(xr[j] - m);
    const int64_t t = label[r];
    loss[r] = (t >= 0 && t < v) ? std::log(s) + m - xr[t] : 0.f;
  }
  return 0;
}

// inputs logits [N, V] float32, labels [N] int32, dloss [N] float32; output dlogits [N, V] float32
extern "C" int SoftmaxXentBackward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                   void *stream, void *extra) {
  static const char *const want[] = {"float32", "int32", "float32", "float32"};
  if (nparam != 4 || !dtypes_are(nparam, dtypes, want) || !shapes_ok(1, 3, ndims, shapes)) return 1;
  if (ndims[3] != 2 || shapes[3][0] != shapes[0][0] || shapes[3][1] != shapes[0][1]) return 1;
  const float *x = static_cast<const float *>(params[0]);
  const int32_t *label = static_cast<const int32_t *>(params[1]);
  const float *dloss = static_cast<const float *>(params[2]);
  float *dx = static_cast<float *>(params[3]);
  const int64_t n = shapes[0][0], v = shapes[0][1];
  if (v <= 0) return 1;
  for (int64_t r = 0; r < n; ++r) {
    const float *xr = x + r * v;
    float *dr = dx + r * v;
    const float m = row_max(xr, v);
    float s = 0.f;  // the exponentials go to dx first, then one scaling pass: one exp per element
#pragma omp simd reduction(+ : s)
    for (int64_t j = 0; j < v; ++j) {
      dr[j] = exp_nonpositive(xr[j] - m);
      s += dr[j];
    }
    const float c = dloss[r] / s;
#pragma omp simd
    for (int64_t j = 0; j < v; ++j) dr[j] *= c;
    const int64_t t = label[r];
    if (t >= 0 && t < v) dr[t] -= dloss[r];
  }
  return 0;
}
