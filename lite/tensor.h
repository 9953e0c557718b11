#pragma once
// The runtime's one data type: a dense float32 array, row-major, batch first.
// No views, no strides, no autograd: a layer reads its input, writes its
// output, and keeps what its backward needs. Plain std::vector storage so the
// buffers are reused from step to step (resize keeps the capacity).

#include <cstdint>
#include <string>
#include <vector>

#include "core/error.h"

// Every runtime error is a sparrow::Error (core/error.h); only the header-only
// part is used, so sparrow_lite links nothing of sparrow_core (which needs LibTorch).
#define SPARROW_LITE_CHECK(cond, ...) SPARROW_CHECK_T(::sparrow::Error, cond, __VA_ARGS__)

namespace sparrow::lite {

using Shape = std::vector<int64_t>;

inline int64_t numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

std::string shape_str(const Shape& s);

struct Tensor {
  Shape shape;
  std::vector<float> data;

  // Sets the shape and sizes the storage (contents unspecified).
  void resize(const Shape& s) {
    shape = s;
    data.resize(static_cast<size_t>(lite::numel(s)));
  }
  int64_t size(size_t d) const { return shape[d]; }
  int64_t numel() const { return static_cast<int64_t>(data.size()); }
  float* ptr() { return data.data(); }
  const float* ptr() const { return data.data(); }
};

// A trainable array: its name (as the LibTorch model's state_dict names it),
// shape, value and the gradient of the last backward.
struct Param {
  std::string name;
  Shape shape;
  std::vector<float> value;
  std::vector<float> grad;
};

}  // namespace sparrow::lite
