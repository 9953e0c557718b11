#include "tests/sparrow_test.h"

#include <chrono>
#include <string>

#include "core/peer_text.h"
#include "core/refusal_log.h"

using sparrow::core::client_id_problem;
using sparrow::core::printable;
using sparrow::core::RefusalLog;
using sparrow::core::valid_client_id;
using namespace std::chrono_literals;

TEST_CASE("peer text: printable escapes every byte a log, terminal or page could act on") {
  SUBCASE("plain ASCII passes") { CHECK(printable("client-7 v1.2 (linux) a=b") == "client-7 v1.2 (linux) a=b"); }
  SUBCASE("newline and terminal escapes") {
    CHECK(printable("evil\n2026 level=info\x1b[2J\r\t") == "evil\\x0a2026 level=info\\x1b[2J\\x0d\\x09");
  }
  SUBCASE("quotes and backslashes") { CHECK(printable("a\"b\\c") == "a\\\"b\\\\c"); }
  SUBCASE("NUL, DEL and bytes above 0x7f") {
    CHECK(printable(std::string("a\0b", 3)) == "a\\x00b");
    CHECK(printable("\x7f") == "\\x7f");
    CHECK(printable("\xc3\xa9\xe2\x80\xae") == "\\xc3\\xa9\\xe2\\x80\\xae");  // é, RIGHT-TO-LEFT OVERRIDE
  }
  SUBCASE("the output is inert") {
    std::string all;
    for (int c = 0; c < 256; ++c) all += static_cast<char>(c);
    const std::string p = printable(all);
    for (size_t i = 0; i < p.size(); ++i) {
      const auto c = static_cast<unsigned char>(p[i]);
      CHECK((c >= 0x20 && c < 0x7f));
      if (c == '"') CHECK((i > 0 && p[i - 1] == '\\'));
    }
    CHECK(p.find('<') != std::string::npos);  // HTML is made inert by the page (textContent), not here
  }
  SUBCASE("empty") { CHECK(printable("") == ""); }
}

TEST_CASE("peer text: client ids are 1 to 64 characters from A-Z a-z 0-9 . _ : @ -") {
  CHECK(valid_client_id("c1"));
  CHECK(valid_client_id("device-017.lab_3:eu@site"));
  CHECK(valid_client_id(std::string(64, 'a')));
  CHECK(!valid_client_id(""));
  CHECK(!valid_client_id(std::string(65, 'a')));
  CHECK(!valid_client_id("a b"));
  CHECK(!valid_client_id("evil\n2026"));
  CHECK(!valid_client_id("a\x1b[2J"));
  CHECK(!valid_client_id("caf\xc3\xa9"));
  CHECK(!valid_client_id("a/b"));
  CHECK(client_id_problem("c1").empty());
  const std::string why = client_id_problem("evil\n\x1b[2J");
  CHECK(why.find("A-Z a-z 0-9 . _ : @ -") != std::string::npos);
  CHECK(why.find("evil\\x0a\\x1b[2J") != std::string::npos);
  CHECK(why.find('\n') == std::string::npos);
  CHECK(client_id_problem("").find("empty") != std::string::npos);
  CHECK(client_id_problem(std::string(1000, 'a')).size() < 300);
}

TEST_CASE("peer text: refused handshakes are logged once per address and period") {
  const auto t0 = RefusalLog::Clock::time_point{} + 1000s;
  SUBCASE("500 fresh keys from one address: one line now, one with the counts a period later") {
    RefusalLog log(60s, 20, 100);
    int lines = 0;
    for (int i = 0; i < 500; ++i) {
      const auto l = log.note("127.0.0.1", "key" + std::to_string(i), t0 + std::chrono::milliseconds(i));
      if (l) {
        ++lines;
        CHECK(l->refused == 1);
        CHECK(l->keys == 1);
        CHECK(l->key == "key0");
      }
    }
    CHECK(lines == 1);
    CHECK(log.due(t0 + 30s).empty());
    const auto d = log.due(t0 + 61s);
    REQUIRE(d.size() == 1);
    CHECK(d[0].address == "127.0.0.1");
    CHECK(d[0].refused == 499);
    CHECK(d[0].keys == 499);
    CHECK(d[0].key == "key499");
    // Nothing waits: no more lines; then quiet for a period, it is forgotten.
    CHECK(log.due(t0 + 125s).empty());
    CHECK(log.due(t0 + 200s).empty());
    CHECK(log.note("127.0.0.1", "again", t0 + 201s).has_value());
  }
  SUBCASE("one key retrying counts one distinct key") {
    RefusalLog log(60s, 20, 100);
    CHECK(log.note("10.0.0.1", "k", t0).has_value());
    for (int i = 1; i <= 100; ++i) CHECK(!log.note("10.0.0.1", "k", t0 + std::chrono::milliseconds(100 * i)));
    const auto l = log.note("10.0.0.1", "k", t0 + 61s);
    REQUIRE(l.has_value());
    CHECK(l->refused == 101);
    CHECK(l->keys == 1);
  }
  SUBCASE("many addresses: at most max_lines lines a period, the rest later and under '*'") {
    RefusalLog log(60s, 5, 50);
    int lines = 0;
    for (int i = 0; i < 1000; ++i)
      if (log.note("10.0." + std::to_string(i / 250) + "." + std::to_string(i % 250), "k" + std::to_string(i), t0))
        ++lines;
    CHECK(lines == 5);
    uint64_t total = 5;
    bool star = false;
    for (int minute = 1; minute <= 20; ++minute) {
      const auto d = log.due(t0 + std::chrono::seconds(61 * minute));
      CHECK(d.size() <= 5);
      for (const auto& l : d) {
        total += l.refused;
        if (l.address == "*") {
          star = true;
          CHECK(l.refused == 950);
          CHECK(l.keys == 950);
        }
      }
    }
    CHECK(star);
    CHECK(total == 1000);  // every refusal is counted in some line
  }
  SUBCASE("drain: at shutdown every waiting count, in at most max_lines + 1 lines") {
    RefusalLog log(60s, 3, 100);
    for (int i = 0; i < 10; ++i)
      for (int k = 0; k < 4; ++k) log.note("10.0.0." + std::to_string(i), "k" + std::to_string(k), t0);
    uint64_t total = 0;
    for (const auto& l : log.due(t0 + 30s)) total += l.refused;  // the period has not passed: nothing
    CHECK(total == 0);
    const auto d = log.drain();
    REQUIRE(d.size() == 4);
    CHECK(d[3].address == "*");
    for (const auto& l : d) total += l.refused;
    CHECK(total == 40 - 3);  // the first refusal of 3 addresses was written at once
    CHECK(log.drain().empty());
  }
  SUBCASE("distinct keys are counted up to a cap") {
    RefusalLog log(60s, 20, 100);
    for (size_t i = 0; i < RefusalLog::kMaxKeys + 10; ++i) log.note("a", std::to_string(i), t0);
    const auto d = log.due(t0 + 61s);
    REQUIRE(d.size() == 1);
    CHECK(d[0].keys == RefusalLog::kMaxKeys);
    CHECK(d[0].keys_capped);
  }
}
