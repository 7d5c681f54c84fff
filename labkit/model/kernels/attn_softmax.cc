// Attention's softmax as mindformers computes it without flash attention, float32, for MindSpore ops.Custom (aot).
//   forward : p = softmax(score * scale + mask)               over the last axis (one row per query position)
//   backward: dscore = scale * p * (dp - sum(dp * p))           (the softmax's Jacobian, then the scale)
// mindformers runs Mul (scale), Add (the mask, broadcast over heads), Softmax, and in the backward SoftmaxGrad plus
// the broadcast Mul's backward: one pass per row here, and the backward reuses the forward's p (MindSpore hands it
// to the bprop as `out`), nothing recomputed.
// Inputs score [B, H, S, T], mask [Bm, Hm, S, T] with Bm in {1, B} and Hm in {1, H} (mindformers' causal mask is
// [B, 1, S, T], -10000 where masked), scale [1]; the backward adds p and dp. Contiguous float32 throughout.
// Single-threaded and vectorised, like rmsnorm.cc; the exponential is fast_exp.h's (argument <= 0 after the row max).
#include <cstdint>

#include "aot.h"
#include "fast_exp.h"

namespace {

struct Layout {
  int64_t b, h, rows, t, mask_b, mask_h;  // rows = S (query positions), t = T (key positions)
};

// score's shape against the mask's: false when the mask does not broadcast as described above
bool layout(int *ndims, int64_t **shapes, Layout *l) {
  if (ndims[0] != 4 || ndims[1] != 4) return false;
  const int64_t *s = shapes[0], *m = shapes[1];
  *l = {s[0], s[1], s[2], s[3], m[0], m[1]};
  return (m[0] == 1 || m[0] == s[0]) && (m[1] == 1 || m[1] == s[1]) && m[2] == s[2] && m[3] == s[3];
}

const float *mask_rows(const float *mask, const Layout &l, int64_t b, int64_t h) {
  const int64_t mb = l.mask_b == 1 ? 0 : b, mh = l.mask_h == 1 ? 0 : h;
  return mask + (mb * l.mask_h + mh) * l.rows * l.t;
}

}  // namespace

// inputs score, mask, scale; output p
extern "C" int AttnSoftmaxForward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                  void *stream, void *extra) {
  Layout l;
  if (nparam != 4 || !all_float32(nparam, dtypes) || !layout(ndims, shapes, &l)) return 1;
  const float *score = static_cast<const float *>(params[0]);
  const float *mask = static_cast<const float *>(params[1]);
  const float scale = static_cast<const float *>(params[2])[0];
  float *p = static_cast<float *>(params[3]);
  for (int64_t b = 0; b < l.b; ++b) {
    for (int64_t h = 0; h < l.h; ++h) {
      const float *mrow = mask_rows(mask, l, b, h);
      const int64_t base = (b * l.h + h) * l.rows * l.t;
      for (int64_t r = 0; r < l.rows; ++r) {
        const float *x = score + base + r * l.t;
        const float *m = mrow + r * l.t;
        float *y = p + base + r * l.t;
        float mx = -3.4e38f;
#pragma omp simd reduction(max : mx)
        for (int64_t j = 0; j < l.t; ++j) {
          y[j] = x[j] * scale + m[j];
          mx = y[j] > mx ? y[j] : mx;
        }
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < l.t; ++j) {
          y[j] = exp_nonpositive(y[j] - mx);
          sum += y[j];
        }
        const float inv = 1.f / sum;
#pragma omp simd
        for (int64_t j = 0; j < l.t; ++j) y[j] *= inv;
      }
    }
  }
  return 0;
}

// inputs score, mask, scale, p, dp; output dscore (score and mask only give the shapes: p holds the forward)
extern "C" int AttnSoftmaxBackward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                   void *stream, void *extra) {
  Layout l;
  if (nparam != 6 || !all_float32(nparam, dtypes) || !layout(ndims, shapes, &l)) return 1;
  const float scale = static_cast<const float *>(params[2])[0];
  const float *p = static_cast<const float *>(params[3]);
  const float *dp = static_cast<const float *>(params[4]);
  float *ds = static_cast<float *>(params[5]);
  const int64_t n = l.b * l.h * l.rows;
  for (int64_t r = 0; r < n; ++r) {
    const float *y = p + r * l.t;
    const float *g = dp + r * l.t;
    float *d = ds + r * l.t;
    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
    for (int64_t j = 0; j < l.t; ++j) dot += g[j] * y[j];
#pragma omp simd
    for (int64_t j = 0; j < l.t; ++j) d[j] = scale * y[j] * (g[j] - dot);
  }
  return 0;
}
