#include "tests/sparrow_test.h"

#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <string>

#include "core/error.h"
#include "core/flat_config.h"

using sparrow::ConfigError;
using sparrow::core::FlatConfig;

namespace {

struct Conf {
  int rounds = 10;
  uint32_t hb = 1000;
  int64_t delta = -5;
  uint64_t seed = 1;
  double lr = 0.1;
  bool insecure = false;
  std::string name = "x";
  double speed = 2;  // "profiles.speed"
};

void bind_all(FlatConfig& f, Conf& c) {
  f.bind("rounds", &c.rounds, 1, 100);
  f.bind("hb", &c.hb);
  f.bind("delta", &c.delta);
  f.bind("seed", &c.seed);
  f.bind("lr", &c.lr);
  f.bind("insecure", &c.insecure);
  f.bind("name", &c.name);
  f.bind("profiles.speed", &c.speed);
}

// The ConfigError message of reading `toml` then `overrides` ("" when none).
std::string error_of(const std::string& toml, const std::vector<std::string>& overrides = {}) {
  Conf c;
  FlatConfig f("t.toml");
  bind_all(f, c);
  try {
    f.read_toml(toml);
    f.apply_overrides(overrides);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("flat config reads every type and records where") {
  Conf c;
  FlatConfig f("t.toml");
  bind_all(f, c);
  f.read_toml(
      "rounds = 7\nhb = 4000000000\ndelta = -9000000000\nseed = 42\nlr = 3\ninsecure = true\nname = \"a\"\n"
      "[profiles]\nspeed = 0.5\n");
  CHECK(c.rounds == 7);
  CHECK(c.hb == 4000000000u);
  CHECK(c.delta == -9000000000LL);
  CHECK(c.seed == 42);
  CHECK(c.lr == 3.0);
  CHECK(c.insecure);
  CHECK(c.name == "a");
  CHECK(c.speed == 0.5);
  CHECK(f.where("rounds") == "t.toml:1");
  CHECK(f.where("profiles.speed") == "t.toml:9");
  CHECK(f.has("name"));
  FlatConfig g("t.toml");
  Conf d;
  bind_all(g, d);
  CHECK_FALSE(g.has("name"));
  CHECK(g.where("name") == "t.toml (default)");
}

TEST_CASE("flat config unknown keys name the key and list the known ones") {
  const std::string e = error_of("rounds = 3\n\nroundz = 4\n");
  CHECK(contains(e, "t.toml:3: config key 'roundz' is unknown"));
  CHECK(contains(e, "known keys: rounds, hb, delta, seed, lr, insecure, name, profiles.speed"));
  CHECK(contains(error_of("[profiles]\nbattery = 1\n"), "t.toml:2: config key 'profiles.battery' is unknown"));
  CHECK(contains(error_of("[extra]\nx = 1\n"), "'extra' is unknown"));
  CHECK(contains(error_of("", {"nope=1"}), "--set: config key 'nope' is unknown"));
  CHECK(contains(error_of("profiles = 3\n"), "'profiles' must be a table ([profiles])"));
}

TEST_CASE("flat config wrong types are errors") {
  CHECK(contains(error_of("rounds = \"ten\"\n"), "t.toml:1: config key 'rounds' must be an integer (got string)"));
  CHECK(contains(error_of("rounds = 2.0\n"), "'rounds' must be an integer"));
  CHECK(contains(error_of("lr = \"0.1\"\n"), "'lr' must be a number"));
  CHECK(contains(error_of("insecure = 1\n"), "'insecure' must be true or false"));
  CHECK(contains(error_of("name = 3\n"), "'name' must be a string"));
  CHECK(error_of("lr = 1\nname = \"\"\n").empty());  // an integer is a number
}

TEST_CASE("flat config integer ranges are checked") {
  CHECK(contains(error_of("rounds = 0\n"), "'rounds' is out of range (got 0)"));
  CHECK(contains(error_of("rounds = 101\n"), "'rounds' is out of range"));
  CHECK(error_of("rounds = 100\n").empty());
  CHECK(contains(error_of("hb = -1\n"), "'hb' is out of range"));
  CHECK(contains(error_of("hb = 4294967296\n"), "'hb' is out of range"));
  CHECK(contains(error_of("seed = -1\n"), "'seed' is out of range"));
  CHECK(contains(error_of("", {"rounds=0"}), "--set: config key 'rounds' is out of range"));
  CHECK(contains(error_of("", {"hb=99999999999"}), "'hb' is out of range"));
  CHECK(contains(error_of("", {"delta=99999999999999999999"}), "'delta' must be an integer"));
}

TEST_CASE("flat config overrides are parsed by the key type") {
  Conf c;
  FlatConfig f("t.toml");
  bind_all(f, c);
  f.read("rounds = 3\nname = \"file\"\n",
         {" rounds =5", "lr=1e-3", "insecure=true", "name=a=b c", "profiles.speed=7", "delta=-3"});
  CHECK(c.rounds == 5);
  CHECK(c.lr == 0.001);
  CHECK(c.insecure);
  CHECK(c.name == "a=b c");
  CHECK(c.speed == 7);
  CHECK(c.delta == -3);
  CHECK(f.where("rounds") == "--set");
  CHECK(f.where("name") == "--set");
  CHECK(contains(error_of("", {"rounds"}), "expected key=value"));
  CHECK(contains(error_of("", {"=3"}), "expected key=value"));
  CHECK(contains(error_of("", {"rounds=ten"}), "--set: config key 'rounds' must be an integer (got 'ten')"));
  CHECK(contains(error_of("", {"rounds="}), "'rounds' must be an integer"));
  CHECK(contains(error_of("", {"rounds=5x"}), "'rounds' must be an integer"));
  CHECK(contains(error_of("", {"lr=fast"}), "'lr' must be a number (got 'fast')"));
  CHECK(contains(error_of("", {"lr=1e999"}), "'lr' is out of range"));
  CHECK(contains(error_of("", {"insecure=yes"}), "'insecure' must be true or false"));
}

TEST_CASE("flat config syntax errors give file line and column") {
  const std::string e = error_of("rounds = 3\nlr = = 2\n");
  CHECK(contains(e, "t.toml:2:"));
  CHECK(contains(e, "TOML syntax error"));
}

TEST_CASE("flat config check and fail name the key and where it came from") {
  Conf c;
  FlatConfig f("t.toml");
  bind_all(f, c);
  f.read_toml("rounds = 3\n");
  CHECK_NOTHROW(f.check("rounds", true, "never"));
  CHECK_THROWS_WITH_AS(f.check("rounds", false, "must be odd"), "t.toml:1: config key 'rounds' must be odd",
                       ConfigError);
  CHECK_THROWS_WITH_AS(f.fail("lr", "is bad"), "t.toml (default): config key 'lr' is bad", ConfigError);
  c.lr = std::nan("");
  CHECK_THROWS_WITH_AS(f.check_finite(), doctest::Contains("'lr' must be finite"), ConfigError);
  FlatConfig anon("");
  Conf d;
  bind_all(anon, d);
  CHECK_THROWS_WITH_AS(anon.fail("lr", "is bad"), "config key 'lr' is bad", ConfigError);
  CHECK_THROWS_AS(anon.bind("lr", &d.lr), sparrow::Error);  // bound twice
}

TEST_CASE("flat config quoting and numbers round trip through toml_value") {
  Conf c;
  c.name = std::string("q\"uo\\te\n\ttab\x01\x7f end \xc3\xa9", 21);
  c.rounds = 100;
  c.lr = 0.1;
  c.speed = 1e-300;
  c.seed = 9007199254740993ULL;
  c.delta = std::numeric_limits<int64_t>::min();
  c.insecure = true;
  FlatConfig w("");
  bind_all(w, c);
  std::string text;
  for (const std::string& k : w.keys())
    if (k.find('.') == std::string::npos) text += k + " = " + w.toml_value(k) + "\n";
  text += "[profiles]\nspeed = " + w.toml_value("profiles.speed") + "\n";
  Conf r;
  r.rounds = 1;
  FlatConfig f("<string>");
  bind_all(f, r);
  f.read_toml(text);
  CHECK(r.name == c.name);
  CHECK(r.rounds == 100);
  CHECK(r.lr == c.lr);
  CHECK(r.speed == c.speed);
  CHECK(r.seed == c.seed);
  CHECK(r.delta == c.delta);
  CHECK(r.insecure);
  CHECK(sparrow::core::toml_quote("a\"b") == "\"a\\\"b\"");
  CHECK(sparrow::core::toml_number(10) == "10.0");
  CHECK(sparrow::core::toml_number(0.1) == "0.1");
  CHECK(sparrow::core::toml_number(-0.0) == "-0.0");
  CHECK(sparrow::core::toml_number(1e20) == "1e+20");
  CHECK(sparrow::core::toml_number(std::numeric_limits<double>::infinity()) == "inf");
  for (double v : {1.0 / 3, 2.5e-8, 123456789.125, 1e15, -7.0, 5e-324}) {
    CAPTURE(v);
    const std::string s = sparrow::core::toml_number(v);
    CHECK(std::strtod(s.c_str(), nullptr) == v);
    CHECK(s.find_first_of(".eE") != std::string::npos);
  }
}

TEST_CASE("flat config read_config_file") {
  const std::string path = "flat_config_test_read.toml";
  std::ofstream(path) << "rounds = 4\n";
  CHECK(sparrow::core::read_config_file(path) == "rounds = 4\n");
  std::remove(path.c_str());
  CHECK_THROWS_WITH_AS(sparrow::core::read_config_file("flat_config_test_no_such_file.toml"),
                       doctest::Contains("cannot read config file"), ConfigError);
}
