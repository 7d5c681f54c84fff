// SwiGLU's element-wise part, float32, for MindSpore ops.Custom(func_type="aot") on CPU.
//   forward : out = silu(gate) * up,                 silu(g) = g * sigmoid(g)
//   backward: dgate = dout * up * sigmoid(g) * (1 + g * (1 - sigmoid(g))),  dup = dout * silu(g)
// gate, up, dout, out, dgate, dup all have the same shape; every tensor is contiguous float32.
// Single-threaded and vectorised, like rmsnorm.cc (no OpenMP team competing with MindSpore's pool threads).
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

int64_t numel(int ndim, const int64_t *shape) {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  return n;
}

bool all_float32(int nparam, const char **dtypes) {
  for (int i = 0; i < nparam; ++i)
    if (std::strcmp(dtypes[i], "float32") != 0) return false;
  return true;
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
  for (int64_t i = 0; i < n; ++i) out[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
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
    const float s = 1.f / (1.f + std::exp(-g[i]));
    du[i] = d[i] * g[i] * s;
    dg[i] = d[i] * u[i] * s * (1.f + g[i] * (1.f - s));
  }
  return 0;
}
