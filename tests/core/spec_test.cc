#include "tests/sparrow_test.h"

#include "core/error.h"
#include "core/spec.h"

using sparrow::ConfigError;
using sparrow::Spec;

TEST_CASE("spec: method and typed keys") {
  Spec s = Spec::parse("dgc:ratio=0.001, momentum=0.9,warmup=4,ef=1,values=fp16");
  CHECK(s.method() == "dgc");
  CHECK(s.get_double("ratio", 0) == doctest::Approx(0.001));
  CHECK(s.get_double("momentum", 0) == doctest::Approx(0.9));
  CHECK(s.get_int("warmup", 0) == 4);
  CHECK(s.get_bool("ef", false));
  CHECK(s.get_string("values", "fp32") == "fp16");
  CHECK(s.get_double("clip", 7.5) == 7.5);
  CHECK_NOTHROW(s.check_all_consumed());
}

TEST_CASE("spec: method without keys") {
  Spec s = Spec::parse("terngrad");
  CHECK(s.method() == "terngrad");
  CHECK_NOTHROW(s.check_all_consumed());
  CHECK(Spec::parse("none:").method() == "none");
}

TEST_CASE("spec: errors") {
  CHECK_THROWS_AS(Spec::parse(""), ConfigError);
  CHECK_THROWS_AS(Spec::parse(":ratio=1"), ConfigError);
  CHECK_THROWS_AS(Spec::parse("topk:ratio"), ConfigError);
  CHECK_THROWS_AS(Spec::parse("topk:ratio=0.1,ratio=0.2"), ConfigError);
  CHECK_THROWS_AS(Spec::parse("topk:ratio=0.1,,ef=1"), ConfigError);
  CHECK_THROWS_AS(Spec::parse("topk:=3"), ConfigError);
  Spec s = Spec::parse("topk:ratio=abc,k=1.5,ef=maybe,tau=nan");
  CHECK_THROWS_AS(s.get_double("ratio", 0), ConfigError);
  CHECK_THROWS_AS(s.get_int("k", 0), ConfigError);
  CHECK_THROWS_AS(s.get_bool("ef", false), ConfigError);
  CHECK_THROWS_AS(s.get_double("tau", 0), ConfigError);
  Spec u = Spec::parse("topk:ratio=0.1,bogus=2");
  u.get_double("ratio", 0);
  try {
    u.check_all_consumed();
    FAIL("unknown key accepted");
  } catch (const ConfigError& e) {
    CHECK(std::string(e.what()).find("bogus") != std::string::npos);
  }
}
