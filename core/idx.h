#pragma once
// IDX files (the MNIST / Fashion-MNIST container), plain or gzip-compressed.
// Only unsigned-byte data (type 0x08) is supported, which is what those
// datasets use. Malformed or truncated files raise FormatError.

#include <ATen/core/Tensor.h>

#include <string>

namespace sparrow::core {

// Reads an IDX file (gzip or not, detected by magic) into a uint8 tensor of the
// stored shape.
at::Tensor read_idx(const std::string& path);

// ((bytes / 255) - mean) / std as float32 of the same shape, exactly as ATen
// computes that expression, in one pass (a 256-entry table).
at::Tensor normalize_bytes(const at::Tensor& bytes, float mean, float std);

// One split of an MNIST-format dataset in `dir`: images as float32 [N, 1, 28, 28]
// scaled to [0, 1] and normalised by the given mean/std, labels as int64 [N].
struct ImageSplit {
  at::Tensor images;
  at::Tensor labels;
};
constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";
// split is "train" or "test" (files train-images-idx3-ubyte[.gz], t10k-...).
ImageSplit load_mnist_format(const std::string& dir, const std::string& split, float mean = 0.2860f,
                             float std = 0.3530f);

}  // namespace sparrow::core
