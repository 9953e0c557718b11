#include "tests/sparrow_test.h"

#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/registry.h"

using sparrow::ConfigError;
using sparrow::core::Registry;

namespace {

using Factory = std::function<int(int)>;

std::string message_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("registry: a name maps to its value and description, names sorted") {
  Registry<Factory> r("widget");
  r.add(
      "triple", [](int x) { return 3 * x; }, "three times x");
  r.add(
      "double", [](int x) { return 2 * x; }, "two times x");
  CHECK(r.get("double")(5) == 10);
  CHECK(r.get("triple")(5) == 15);
  CHECK(r.names() == std::vector<std::string>({"double", "triple"}));
  CHECK(r.description("triple") == "three times x");
  CHECK(r.contains("double"));
  CHECK_FALSE(r.contains("quadruple"));
  CHECK_FALSE(r.find("quadruple").has_value());
}

TEST_CASE("registry: an unknown name is a ConfigError listing the known names") {
  Registry<Factory> r("widget");
  r.add(
      "b", [](int x) { return x; }, "");
  r.add(
      "a", [](int x) { return x; }, "");
  CHECK_THROWS_AS(r.get("c"), ConfigError);
  CHECK(message_of([&] { r.get("c"); }) == "unknown widget 'c' (known: a, b)");
  CHECK(message_of([&] { r.description("c"); }) == "unknown widget 'c' (known: a, b)");
  CHECK(std::string(r.unknown("c", "file:PATH").what()) == "unknown widget 'c' (known: a, b, file:PATH)");
  Registry<Factory> empty("widget");
  CHECK(message_of([&] { empty.get("x"); }) == "unknown widget 'x' (known: )");
}

TEST_CASE("registry: registering a name twice or a malformed name is a programming error") {
  Registry<Factory> r("widget");
  r.add(
      "a", [](int x) { return x; }, "first");
  // sparrow::Error, and deliberately not a ConfigError: it is the code's fault, not the config's.
  bool config_error = false, error = false;
  try {
    r.add(
        "a", [](int x) { return -x; }, "second");
  } catch (const ConfigError&) {
    config_error = true;
  } catch (const sparrow::Error&) {
    error = true;
  }
  CHECK(error);
  CHECK_FALSE(config_error);
  CHECK(r.get("a")(4) == 4);  // the first registration stands
  CHECK(r.description("a") == "first");
  for (const char* bad : {"", "a:b", "a,b", "a=b", "a b"}) {
    CAPTURE(bad);
    CHECK_THROWS_AS(r.add(
                        bad, [](int x) { return x; }, ""),
                    sparrow::Error);
  }
  CHECK(r.names() == std::vector<std::string>({"a"}));
}

TEST_CASE("registry: concurrent registration and lookup") {
  Registry<Factory> r("widget");
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&r, t] {
      for (int i = 0; i < 50; ++i) {
        const std::string name = "w" + std::to_string(t) + "_" + std::to_string(i);
        r.add(
            name, [i](int x) { return x + i; }, "");
        (void)r.names();
        (void)r.get(name);
      }
    });
  for (auto& th : threads) th.join();
  CHECK(r.names().size() == 200);
  CHECK(r.get("w3_49")(1) == 50);
}
