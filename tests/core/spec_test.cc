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

TEST_CASE("spec: an unknown key is refused with the method's keys listed") {
  Spec s = Spec::parse("topk:ratio=0.01,ration=2");
  s.get_double("ratio", 0.1);
  s.get_bool("exact", false);
  (void)s.has("values");
  std::string what;
  try {
    s.check_all_consumed();
  } catch (const ConfigError& e) {
    what = e.what();
  }
  CHECK(what.find("unknown key(s) for method 'topk': ration") != std::string::npos);
  CHECK(what.find("its keys: exact, ratio, values") != std::string::npos);
  Spec none = Spec::parse("sign:x=1");
  CHECK_THROWS_WITH_AS(none.check_all_consumed(), doctest::Contains("it takes no keys"), ConfigError);
}
