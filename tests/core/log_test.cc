// The one log format (core/log.h), SPARROW_CHECK's source location
// (core/error.h) and the config binder's "did you mean" (core/flat_config.h).

#include "core/log.h"

#include <string>

#include "core/error.h"
#include "core/flat_config.h"
#include "tests/sparrow_test.h"

using sparrow::core::format_log_line;
using sparrow::core::LogFormat;

namespace {

std::string text(const std::string& body, const std::string& level = "info") {
  return format_log_line("2026-11-25T08:40:12.345", "+01:00", level, body, LogFormat::kText);
}
std::string json(const std::string& body, const std::string& level = "info") {
  return format_log_line("2026-11-25T08:40:12.345", "+01:00", level, body, LogFormat::kJson);
}

std::string what_of_check() {
  try {
    SPARROW_CHECK(1 + 1 == 3, "client training diverged at step " << 4);
  } catch (const sparrow::Error& e) {
    return e.what();
  }
  return "";
}

// Restores the process-wide setting a test changes.
struct LocationsGuard {
  bool saved = sparrow::check_locations();
  ~LocationsGuard() { sparrow::set_check_locations(saved); }
};

}  // namespace

TEST_CASE("log format: an event body is written as given, free text becomes event=message on one line") {
  CHECK(text("event=round_completed round=3 seconds=0.412") ==
        "2026-11-25T08:40:12.345 level=info event=round_completed round=3 seconds=0.412\n");
  CHECK(text("round 3: task received", "warning") ==
        "2026-11-25T08:40:12.345 level=warning event=message msg=\"round 3: task received\"\n");
  // Quotes, backslashes and newlines cannot end the value or the line.
  CHECK(text("a \"b\"\\c\nd") == "2026-11-25T08:40:12.345 level=info event=message msg=\"a \\\"b\\\"\\\\c\\x0ad\"\n");
}

TEST_CASE("log format: json has ts, level, event and every key=value as a field") {
  CHECK(json("event=round_completed round=3 train_loss=0.4728 eval_accuracy=nan ok=true id=007 msg=\"a b=c\"") ==
        "{\"ts\":\"2026-11-25T08:40:12.345+01:00\",\"level\":\"info\",\"event\":\"round_completed\",\"round\":3,"
        "\"train_loss\":0.4728,\"eval_accuracy\":null,\"ok\":true,\"id\":\"007\",\"msg\":\"a b=c\"}\n");
  SUBCASE("free text is the msg, escaped for JSON") {
    CHECK(json("tasks 3 \"done\"\n", "error") ==
          "{\"ts\":\"2026-11-25T08:40:12.345+01:00\",\"level\":\"error\",\"event\":\"message\","
          "\"msg\":\"tasks 3 \\\"done\\\"\\\\x0a\"}\n");
  }
  SUBCASE("a quoted value holding quotes ends at the quote before the next key") {
    CHECK(json("event=config_error msg=\"use model = \"logreg\"\" file=x.toml") ==
          "{\"ts\":\"2026-11-25T08:40:12.345+01:00\",\"level\":\"info\",\"event\":\"config_error\","
          "\"msg\":\"use model = \\\"logreg\\\"\",\"file\":\"x.toml\"}\n");
  }
  SUBCASE("words that are not key=value, and keys that would repeat, are kept") {
    CHECK(json("event=x level=3 some words msg=\"m\"") ==
          "{\"ts\":\"2026-11-25T08:40:12.345+01:00\",\"level\":\"info\",\"event\":\"x\",\"level_\":3,"
          "\"msg\":\"m\",\"text\":\"some words\"}\n");
  }
  CHECK(sparrow::core::parse_log_format("json") == LogFormat::kJson);
  CHECK_THROWS_AS(sparrow::core::parse_log_format("xml"), sparrow::ConfigError);
}

TEST_CASE("SPARROW_CHECK: the source file and line only when check locations are on") {
  LocationsGuard guard;
  sparrow::set_check_locations(false);
  const std::string plain = what_of_check();
  CHECK(plain == "client training diverged at step 4");
  CHECK(plain.find(".cc:") == std::string::npos);
  sparrow::set_check_locations(true);
  const std::string located = what_of_check();
  CHECK(located.find("client training diverged at step 4 [1 + 1 == 3 failed at ") == 0);
  CHECK(located.find("log_test.cc:") != std::string::npos);
}

TEST_CASE("config binder: an unknown key names the nearest known key within two edits") {
  using sparrow::core::closest_key;
  const std::vector<std::string> keys = {"rounds", "lr", "momentum", "clients_per_round", "eval_every"};
  CHECK(closest_key("lrr", keys) == "lr");
  CHECK(closest_key("rouns", keys) == "rounds");
  CHECK(closest_key("momentmu", keys) == "momentum");  // a swap is one edit
  CHECK(closest_key("clients_per_rounds", keys) == "clients_per_round");
  CHECK(closest_key("batch_size", keys).empty());
  CHECK(closest_key("x", keys).empty());  // "lr" is 2 edits from it, as from any 1-letter key
  CHECK(sparrow::core::edit_distance("kitten", "sitting") == 3);

  int rounds = 0;
  double lr = 0;
  sparrow::core::FlatConfig f("x.toml");
  f.bind("rounds", &rounds);
  f.bind("lr", &lr);
  try {
    f.read("lrr = 0.1\n", {});
    FAIL("an unknown key was accepted");
  } catch (const sparrow::ConfigError& e) {
    const std::string m = e.what();
    CHECK(m.find("x.toml:1: config key 'lrr' is unknown: did you mean 'lr'? (known keys: rounds, lr)") == 0);
  }
  try {
    f.apply_override("batch=3");
    FAIL("an unknown key was accepted");
  } catch (const sparrow::ConfigError& e) {
    CHECK(std::string(e.what()).find("did you mean") == std::string::npos);
  }
}
