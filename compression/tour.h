#pragma once
// The codec tour: one gradient step of the built-in MLP on a Fashion-MNIST batch,
// then every compressor on that real gradient, printed as a table.

#include <cstdint>
#include <ostream>
#include <string>

namespace sparrow::compression {

int run_tour(const std::string& data_dir, int batch, uint64_t seed, std::ostream& out);

}  // namespace sparrow::compression
