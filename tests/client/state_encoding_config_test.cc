// sparrow-client's state_encoding key: its values, and a refusal that names it.
#include "tests/sparrow_test.h"

#include <string>

#include "client/session.h"
#include "core/error.h"

namespace {
const std::string kBase = "server = \"tcp://127.0.0.1:1\"\nclient_id = \"c1\"\ninsecure = true\n";
}  // namespace

TEST_CASE("client config: state_encoding is fp32 by default, takes bf16 and refuses anything else by name") {
  using sparrow::client::parse_session_config;
  CHECK(parse_session_config(kBase).state_encoding == "fp32");
  CHECK(parse_session_config(kBase + "state_encoding = \"bf16\"\n").state_encoding == "bf16");
  CHECK(parse_session_config(kBase, {"state_encoding=bf16"}).state_encoding == "bf16");
  for (const char* bad : {"fp16", "bfloat16", ""}) {
    INFO(bad);
    CHECK_THROWS_WITH_AS(parse_session_config(kBase + "state_encoding = \"" + bad + "\"\n"),
                         doctest::Contains("state_encoding"), sparrow::ConfigError);
  }
  CHECK_THROWS_WITH_AS(parse_session_config(kBase + "state_encoding = 16\n"), doctest::Contains("state_encoding"),
                       sparrow::ConfigError);
}
