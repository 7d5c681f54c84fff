// What every kernel here checks of MindSpore's AOT arguments (params = inputs then outputs; ndims/shapes/dtypes
// describe each of them): the element count of a shape, and that every tensor is float32. xent.cc, whose labels
// are int32, checks its dtypes one by one instead.
#ifndef LABKIT_KERNELS_AOT_H_
#define LABKIT_KERNELS_AOT_H_

#include <cstdint>
#include <cstring>

// the product of the first ndim sizes: numel(ndim - 1, shape) is the number of rows of the last axis
inline int64_t numel(int ndim, const int64_t *shape) {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  return n;
}

inline bool all_float32(int nparam, const char **dtypes) {
  for (int i = 0; i < nparam; ++i)
    if (std::strcmp(dtypes[i], "float32") != 0) return false;
  return true;
}

#endif  // LABKIT_KERNELS_AOT_H_
