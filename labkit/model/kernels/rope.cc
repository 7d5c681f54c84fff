// Rotary position embedding (RoPE) as mindformers applies it, float32, for MindSpore ops.Custom(func_type="aot").
//   forward : y = x * cos + rot(x) * sin,          rot(x) = [-x2, x1]  (x1, x2: the two halves of the head dim)
//   backward: dx = dy * cos + rot^T(dy * sin),      rot^T(g) = [g2, -g1]
// mindformers writes rot(x) as a batch matmul with its swap mask [[0, I], [-I, 0]] and the products as broadcast
// multiplies of [B, H, S, D] by the [1, 1, S, D] tables: six kernels forward, more backward. One pass here.
// Inputs x [B, H, S, D], cos [S, D], sin [S, D] (any leading ones), then dy for the backward; all contiguous float32.
// Single-threaded and vectorised, like rmsnorm.cc.
#include <cstdint>

#include "aot.h"

namespace {

// forward y = x * c + rot(x) * s, backward dx = dy * c + rot^T(dy * s), written out per half:
//   y1 = x1 * c1 - x2 * s1,  y2 = x2 * c2 + x1 * s2       (forward)
//   y1 = x1 * c1 + x2 * s2,  y2 = x2 * c2 - x1 * s1       (backward, x = dy)
template <bool kBackward>
int rope(void **params, int *ndims, int64_t **shapes, int in_index, int out_index) {
  const int nd = ndims[0];
  if (nd < 2) return 1;
  const int64_t d = shapes[0][nd - 1], s = shapes[0][nd - 2], half = d / 2;
  if (d % 2 != 0 || numel(ndims[1], shapes[1]) != s * d || numel(ndims[2], shapes[2]) != s * d) return 1;
  const float *x = static_cast<const float *>(params[in_index]);
  const float *cos = static_cast<const float *>(params[1]);
  const float *sin = static_cast<const float *>(params[2]);
  float *y = static_cast<float *>(params[out_index]);
  const int64_t heads = numel(nd, shapes[0]) / (s * d);
  for (int64_t bh = 0; bh < heads; ++bh) {
    for (int64_t t = 0; t < s; ++t) {
      const float *xr = x + (bh * s + t) * d;
      const float *c = cos + t * d;
      const float *sn = sin + t * d;
      float *yr = y + (bh * s + t) * d;
#pragma omp simd
      for (int64_t j = 0; j < half; ++j) {
        const float x1 = xr[j], x2 = xr[j + half];
        if (kBackward) {
          yr[j] = x1 * c[j] + x2 * sn[j + half];
          yr[j + half] = x2 * c[j + half] - x1 * sn[j];
        } else {
          yr[j] = x1 * c[j] - x2 * sn[j];
          yr[j + half] = x2 * c[j + half] + x1 * sn[j + half];
        }
      }
    }
  }
  return 0;
}

}  // namespace

// inputs x, cos, sin; output y
extern "C" int RopeForward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                           void *stream, void *extra) {
  if (nparam != 4 || !all_float32(nparam, dtypes)) return 1;
  return rope<false>(params, ndims, shapes, 0, 3);
}

// inputs x, cos, sin, dy; output dx (x is not needed: RoPE is linear in x)
extern "C" int RopeBackward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                            void *stream, void *extra) {
  if (nparam != 5 || !all_float32(nparam, dtypes)) return 1;
  return rope<true>(params, ndims, shapes, 3, 4);
}
