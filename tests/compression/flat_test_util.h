#pragma once
// What the tests of the codecs without LibTorch (flat_codec_test.cc,
// flat_powersgd_test.cc) compare with: an Encoded field by field and byte for
// byte, a LibTorch State against a flat::State (and their bytes), and the
// type and text of what a call throws.

#include <ATen/ATen.h>

#include <cstring>
#include <string>
#include <vector>

#include "compression/compressor.h"
#include "compression/flat_codec.h"
#include "core/error.h"
#include "tests/sparrow_test.h"

namespace sparrow::compression::flat_test {

namespace fl = sparrow::compression::flat;

inline std::vector<int64_t> sizes_of(const at::Tensor& t) {
  return std::vector<int64_t>(t.sizes().begin(), t.sizes().end());
}

// "<type>: <message>" of what f throws, "" when it returns.
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const sparrow::ConfigError& e) {
    return std::string("ConfigError: ") + e.what();
  } catch (const sparrow::FormatError& e) {
    return std::string("FormatError: ") + e.what();
  } catch (const sparrow::Error& e) {
    return std::string("Error: ") + e.what();
  } catch (const std::exception& e) {
    return std::string("std::exception: ") + e.what();
  }
  return "";
}

// memcmp that allows the null data() of an empty vector (UBSan's nonnull check).
inline bool same_bytes(const void* a, const void* b, size_t n) { return n == 0 || std::memcmp(a, b, n) == 0; }

inline void check_same(const Encoded& a, const Encoded& b) {
  CHECK(a.format == b.format);
  CHECK(a.shape == b.shape);
  CHECK(a.value_type == b.value_type);
  CHECK(a.index_coding == b.index_coding);
  CHECK(a.count == b.count);
  CHECK(a.seed == b.seed);
  CHECK(a.params == b.params);
  REQUIRE(a.scales.size() == b.scales.size());
  CHECK(same_bytes(a.scales.data(), b.scales.data(), a.scales.size() * sizeof(float)));
  CHECK(a.indices == b.indices);
  REQUIRE(a.values.size() == b.values.size());
  CHECK(same_bytes(a.values.data(), b.values.data(), a.values.size()));
}

inline void check_same(const State& t, const fl::State& f) {
  CHECK(t.step == f.step);
  CHECK(t.last_round == f.last_round);
  REQUIRE(t.tensors.size() == f.tensors.size());
  for (const auto& slot : t.tensors) {
    const std::string name = slot.first;
    INFO("slot " << name);
    REQUIRE(f.has(name));
    const fl::Tensor& ft = f.tensors.at(name);
    CHECK(sizes_of(slot.second) == ft.shape);
    const at::Tensor c = slot.second.contiguous();
    REQUIRE(static_cast<size_t>(c.numel()) == ft.data.size());
    CHECK(same_bytes(c.data_ptr<float>(), ft.data.data(), ft.data.size() * sizeof(float)));
  }
  CHECK(t.serialize() == f.serialize());
}

}  // namespace sparrow::compression::flat_test
