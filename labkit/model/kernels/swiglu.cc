// SwiGLU's element-wise part, float32, for MindSpore ops.Custom(func_type="aot") on CPU.
//   forward : out = silu(gate) * up,                 silu(g) = g * sigmoid(g)
//   backward: dgate = dout * up * sigmoid(g) * (1 + g * (1 - sigmoid(g))),  dup = dout * silu(g)
// gate, up, dout, out, dgate, dup all have the same shape; every tensor is contiguous float32.
// Single-threaded and vectorised, like rmsnorm.cc (no OpenMP team competing with MindSpore's pool threads).
// The sigmoid uses fast_exp.h's exp_nonpositive, which `#pragma omp simd` vectorises (std::exp stays one scalar
// libm call per element without -ffast-math).
#include <cstdint>

#include "aot.h"
#include "fast_exp.h"

namespace {

// sigmoid(g) from e = exp(-|g|) <= 1, never exp of a large positive number: 1 / (1 + e) for g >= 0, e / (1 + e)
// below. Both branches are computed and one is picked (a blend, no branch), so the loop stays vectorised. Past
// |g| = 87.3 e is clamped at ~1.2e-38: sigmoid is exactly 1 above, and below it is set to 0 (the true value is
// under 1.2e-38), so silu(g) = g * 0 = -0 as in the native cells even for g = -3e38, where the clamped e would
// leave g * 1.2e-38 ~ -3.6. No Inf and no NaN for any finite g.
inline float sigmoid(float g) {
  const float e = exp_nonpositive(g < 0.f ? g : -g);
  const float r = 1.f / (1.f + e);
  return g >= 0.f ? r : (g < -87.3f ? 0.f : e * r);
}

}  // namespace

// inputs gate, up; output out
extern "C" int SwiGluForward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                             void *stream, void *extra) {
  if (nparam != 3 || !all_float32(nparam, dtypes)) return 1;
  const float *g = static_cast<const float *>(params[0]);
  const float *u = static_cast<const float *>(params[1]);
  float *out = static_cast<float *>(params[2]);
  const int64_t n = numel(ndims[0], shapes[0]);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = g[i] * sigmoid(g[i]) * u[i];
  return 0;
}

// inputs gate, up, dout; outputs dgate, dup
extern "C" int SwiGluBackward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                              void *stream, void *extra) {
  if (nparam != 5 || !all_float32(nparam, dtypes)) return 1;
  const float *g = static_cast<const float *>(params[0]);
  const float *u = static_cast<const float *>(params[1]);
  const float *d = static_cast<const float *>(params[2]);
  float *dg = static_cast<float *>(params[3]);
  float *du = static_cast<float *>(params[4]);
  const int64_t n = numel(ndims[0], shapes[0]);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float s = sigmoid(g[i]);
    du[i] = d[i] * g[i] * s;
    dg[i] = (d[i] * u[i]) * (s * (1.f + g[i] * (1.f - s)));  // no product of d, u, s alone: it can underflow
  }
  return 0;
}
