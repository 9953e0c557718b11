#include "tests/sparrow_test.h"

#include <torch/torch.h>
// (sparrow_test.h first: glog/doctest CHECK clash.)

#include <stdexcept>
#include <string>

#include "core/error.h"
#include "core/error_text.h"

using sparrow::core::peer_message;
using sparrow::core::peer_text;

namespace {

std::string what_of_check(int stage) {
  try {
    SPARROW_CHECK(stage == 3, "secagg: reveals of round " << 7 << " are not accepted now");
  } catch (const sparrow::Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("error text: peers get a check's message without its condition and source path") {
  const std::string full = what_of_check(1);
  REQUIRE(full.find(" failed at ") != std::string::npos);
  REQUIRE(full.find("error_text_test.cc:") != std::string::npos);
  CHECK(peer_text(full) == "secagg: reveals of round 7 are not accepted now");
  SUBCASE("a check quoted in the middle of another message") {
    CHECK(peer_text("tensor 'fc1.weight': " + full + " (round 3)") ==
          "tensor 'fc1.weight': secagg: reveals of round 7 are not accepted now (round 3)");
  }
  SUBCASE("conditions with brackets, and two checks in one text") {
    CHECK(peer_text("a [x[i] == y[j] failed at /src/a.cc:12]; b [ok() failed at b.h:3]") == "a; b");
  }
  SUBCASE("text that only looks like it is kept") {
    for (const std::string s : {"decode failed at element 5", "shape [3] failed at step 2", "x [a failed at b]",
                                "x [a failed at b:]", "[c failed at f:1x]", ""})
      CHECK(peer_text(s) == s);
  }
  SUBCASE("peer_message of a sparrow::Error, another exception, and LibTorch's backtrace") {
    try {
      SPARROW_CHECK(false, "bad");
    } catch (const std::exception& e) {
      CHECK(peer_message(e) == "bad");
    }
    CHECK(peer_message(std::runtime_error("plain")) == "plain");
    CHECK(peer_text("shape mismatch\nException raised from f at /build/aten/x.cpp:9 (most recent call first):") ==
          "shape mismatch");
    try {
      (void)torch::zeros({2}).view({3});
    } catch (const std::exception& e) {
      const std::string text = peer_message(e);
      CHECK(!text.empty());
      CHECK(text.find(".cpp:") == std::string::npos);
      CHECK(text.find("frame #") == std::string::npos);
    }
  }
}
