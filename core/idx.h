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
// computes that expression, in one pass (a 256-entry table). With `rows`
// (int64 indices into dim 0), row i of the result is row rows[i] of bytes:
// a gather and the normalisation in one pass into one allocation.
at::Tensor normalize_bytes(const at::Tensor& bytes, float mean, float std, const at::Tensor& rows = {});
constexpr float kFashionMnistMean = 0.2860f, kFashionMnistStd = 0.3530f;

// One split of an MNIST-format dataset in `dir`: images as float32 [N, 1, 28, 28]
// scaled to [0, 1] and normalised by the given mean/std, labels as int64 [N].
struct ImageSplit {
  at::Tensor images;
  at::Tensor labels;
};
constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";
// split is "train" or "test" (files train-images-idx3-ubyte[.gz], t10k-...).
ImageSplit load_mnist_format(const std::string& dir, const std::string& split, float mean = kFashionMnistMean,
                             float std = kFashionMnistStd);
// The same split with the images as the file's uint8 [N, 1, 28, 28], for a
// caller that reorders them before normalize_bytes (the simulator: 188 MB of
// Fashion-MNIST floats are then written once, not twice).
ImageSplit load_mnist_bytes(const std::string& dir, const std::string& split);

}  // namespace sparrow::core
