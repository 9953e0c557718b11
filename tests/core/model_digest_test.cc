#include "tests/sparrow_test.h"

#include <ATen/ATen.h>

#include "core/model_digest.h"
#include "core/models.h"

using namespace sparrow;

TEST_CASE("model digest: names and shapes decide it and it is stable") {
  // The documented definition: FNV-1a 64 of "name:d0xd1;" in name order.
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : std::string("a:2x3;b:;")) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  CHECK(core::model_digest(std::map<std::string, std::vector<int64_t>>{{"b", {}}, {"a", {2, 3}}}) == h);

  const std::map<std::string, at::Tensor> w{{"a", at::zeros({2, 3})}, {"b", at::zeros({})}};
  CHECK(core::model_digest(w) == h);
  const std::map<std::string, at::Tensor> transposed{{"a", at::zeros({3, 2})}, {"b", at::zeros({})}};
  CHECK(core::model_digest(transposed) != h);
  const std::map<std::string, at::Tensor> renamed{{"a", at::zeros({2, 3})}, {"c", at::zeros({})}};
  CHECK(core::model_digest(renamed) != h);

  // Weights do not matter, the architecture does.
  const auto m1 = core::make_model("mlp", 1), m2 = core::make_model("mlp", 2), c = core::make_model("cnn", 1);
  CHECK(core::model_digest(*m1) == core::model_digest(*m2));
  CHECK(core::model_digest(*m1) != core::model_digest(*c));
}
