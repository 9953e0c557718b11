#pragma once
// The lite model file: one model's architecture and weights, what
// `sparrow-lite-export` writes and a device loads. Binary, little-endian,
// versioned, checksummed (layout in docs/lite.md):
//
//   magic "SPRWLITE" | u32 version (1) | u32 flags (0)
//   u32 input rank | i64 input dims...
//   u32 layer count | per layer: u32 kind, i64 in, out, kh, kw, sh, sw, ph, pw,
//     bias, flag, f32 p, eps, u32 tensor count, per tensor:
//     u32 name length, name bytes, u32 rank, i64 dims...
//   u64 value count | f32 values (every tensor, in order, row-major)
//   u64 FNV-1a 64 of every byte before it
//
// A layer's tensors are its parameters, preceded by its frozen tensors
// (frozen_count: a LoRA layer's weight and bias), whose values the reader
// puts into the spec (LayerSpec::frozen), not into the flat vector. Files
// without LoRA layers are byte for byte what readers before LoRA wrote and
// read; such a reader refuses a LoRA file as a model that does not build
// ("unknown layer kind 11"), so the version stays 1.
//
// A reader refuses, with a FormatError naming the file, anything that is not
// exactly this: another magic or version, a truncated file, trailing bytes,
// a checksum mismatch, counts out of range, or a model that does not build.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "lite/model.h"

namespace sparrow::lite {

constexpr uint32_t kModelFileVersion = 1;

struct ModelFile {
  ModelSpec spec;             // frozen tensors included
  std::vector<float> values;  // Model::get_values() order: parameters only
};

std::vector<uint8_t> encode_model_file(const ModelSpec& spec, const std::vector<float>& values);
// `what` names the bytes' origin (the file) in every error message.
ModelFile decode_model_file(const uint8_t* data, size_t size, const std::string& what);

// Written to PATH.tmp, then renamed: a reader never sees half a file.
// sparrow::Error naming the path when it cannot be written.
void save_model_file(const std::string& path, const ModelSpec& spec, const std::vector<float>& values);
ModelFile load_model_file(const std::string& path);

// load_model_file, then a Model holding its values. Also checks that this
// CPU runs the runtime's build (gemm.h, check_cpu).
std::unique_ptr<Model> load_model(const std::string& path);

}  // namespace sparrow::lite
