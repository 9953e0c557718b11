#pragma once
// A model's identity on the wire: FNV-1a 64 over "name:d0xd1x...;" for every
// parameter in name order (a scalar is "name:;"). Server and client compare
// digests in the Hello handshake so a client that built another model (or
// another version of it) is refused before any update is exchanged.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace torch::nn {
class Module;
}

namespace sparrow::core {

uint64_t model_digest(const std::map<std::string, std::vector<int64_t>>& shapes);
uint64_t model_digest(const std::map<std::string, at::Tensor>& weights);
uint64_t model_digest(const torch::nn::Module& model);  // its named_parameters()

}  // namespace sparrow::core
