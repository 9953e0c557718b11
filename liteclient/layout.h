#pragma once
// A model's parameters as the session sees them: names and shapes in model
// order (the LibTorch model's named_parameters() order), each parameter's
// offset in the flat vector that holds them all, row-major, one after another.
// What the lite trainer takes and returns, what the codecs encode tensor by
// tensor, and what SecAgg+ quantises (tensor k at offset o_k).

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace sparrow::liteclient {

struct Layout {
  std::vector<std::string> names;
  std::vector<std::vector<int64_t>> shapes;
  std::vector<int64_t> offsets;  // offsets[k]: where parameter k starts
  std::vector<int64_t> sizes;    // sizes[k]: its element count
  int64_t total = 0;

  // sparrow::Error for an empty or duplicated name or a negative dimension.
  static Layout make(std::vector<std::string> names, std::vector<std::vector<int64_t>> shapes);
  // The index of `name`, or -1.
  int64_t find(const std::string& name) const;

 private:
  std::map<std::string, int64_t> index_;
};

// The model's identity at Hello: FNV-1a 64 over "name:d0xd1x...;" for every
// parameter in name order, as core::model_digest (core/model_digest.h)
// computes it from a LibTorch model: the server compares the two.
uint64_t model_digest(const Layout& layout);

// "[2, 3]".
std::string shape_text(const std::vector<int64_t>& shape);

}  // namespace sparrow::liteclient
