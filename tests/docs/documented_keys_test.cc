// The key tables of the docs against what each program reads: every key a
// docs table lists is known to its program, and every key a program knows is
// in a table. The program's own list is the one its unknown-key error prints
// ("known keys: ..."), so a key added to a config binder without a docs row
// (or a row left behind after a key is gone) fails here.
#include "tests/sparrow_test.h"

#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "client/session.h"
#include "core/error.h"
#include "server/config.h"
#include "simulator/config.h"

namespace {

using Keys = std::set<std::string>;

std::string read_doc(const std::string& name) {
  std::ifstream f(std::string(SPARROW_SOURCE_DIR) + "/docs/" + name);
  REQUIRE_MESSAGE(f.good(), "docs/" << name << " is missing");
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// The first cells (`key`) of the table rows under the `## heading` of a docs
// page, up to the next `## ` heading.
Keys table_keys(const std::string& page, const std::string& heading) {
  std::istringstream in(read_doc(page));
  std::string line;
  bool inside = false;
  Keys keys;
  while (std::getline(in, line)) {
    if (line.rfind("## ", 0) == 0) {
      if (inside) break;
      inside = line == "## " + heading;
      continue;
    }
    if (!inside || line.rfind("| `", 0) != 0) continue;
    const size_t end = line.find('`', 3);
    if (end != std::string::npos) keys.insert(line.substr(3, end - 3));
  }
  REQUIRE_MESSAGE(!keys.empty(), "docs/" << page << " has no key table under '## " << heading << "'");
  return keys;
}

// The keys a parser knows, from its error for an unknown key.
template <typename Parse>
Keys known_keys(Parse parse) {
  try {
    parse({"zz_not_a_key=1"});
  } catch (const sparrow::ConfigError& e) {
    const std::string msg = e.what();
    const std::string tag = "(known keys: ";
    const size_t at = msg.find(tag);
    REQUIRE_MESSAGE(at != std::string::npos, "no key list in: " << msg);
    const size_t end = msg.find(')', at);
    std::istringstream list(msg.substr(at + tag.size(), end - at - tag.size()));
    Keys keys;
    std::string k;
    while (std::getline(list, k, ',')) keys.insert(k.substr(k.find_first_not_of(' ')));
    return keys;
  }
  FAIL("an unknown key was accepted");
  return {};
}

std::string joined(const Keys& k) {
  std::string s;
  for (const auto& x : k) s += (s.empty() ? "" : ", ") + x;
  return s;
}

// Keys of `a` that are not in `b`.
Keys minus(const Keys& a, const Keys& b) {
  Keys out;
  for (const auto& k : a)
    if (!b.count(k)) out.insert(k);
  return out;
}

Keys unite(std::initializer_list<Keys> parts) {
  Keys out;
  for (const auto& p : parts) out.insert(p.begin(), p.end());
  return out;
}

const std::string kClientBase = "server = \"tcp://127.0.0.1:1\"\nclient_id = \"c1\"\ninsecure = true\n";

}  // namespace

TEST_CASE("docs: every documented key is known to its program, and every key a program knows is documented") {
  const Keys shared = table_keys("configuration.md", "Shared keys");
  const Keys sim_doc = table_keys("simulator.md", "Configuration keys");
  // The gateway's keys have their own table; `server_key` is the old name of
  // `key`, said in `key`'s row.
  const Keys server_doc = unite({table_keys("server.md", "Configuration keys"),
                                 table_keys("server.md", "Gateway role (two levels)"), Keys{"server_key"}});
  const Keys client_doc = table_keys("client.md", "Configuration");

  const Keys sim =
      known_keys([](const std::vector<std::string>& o) { sparrow::simulator::parse_config_string("", o); });
  const Keys server =
      known_keys([](const std::vector<std::string>& o) { sparrow::server::parse_server_config("", o); });
  const Keys client =
      known_keys([&](const std::vector<std::string>& o) { sparrow::client::parse_session_config(kClientBase, o); });

  // The simulator and the server each know the other's keys too (to say they
  // have no effect there), so both know the union of the three tables.
  const Keys documented = unite({shared, sim_doc, server_doc});
  const Keys sim_undocumented = minus(sim, documented), sim_unknown = minus(unite({shared, sim_doc}), sim);
  const Keys server_undocumented = minus(server, documented),
             server_unknown = minus(unite({shared, server_doc}), server);
  const Keys client_undocumented = minus(client, client_doc), client_unknown = minus(client_doc, client);
  CHECK_MESSAGE(sim_undocumented.empty(), "sparrow-sim keys in no docs table: " << joined(sim_undocumented));
  CHECK_MESSAGE(sim_unknown.empty(), "documented for sparrow-sim but unknown to it: " << joined(sim_unknown));
  CHECK_MESSAGE(server_undocumented.empty(), "sparrow-server keys in no docs table: " << joined(server_undocumented));
  CHECK_MESSAGE(server_unknown.empty(), "documented for sparrow-server but unknown to it: " << joined(server_unknown));
  CHECK_MESSAGE(client_undocumented.empty(),
                "sparrow-client keys not in docs/client.md's table: " << joined(client_undocumented));
  CHECK_MESSAGE(client_unknown.empty(),
                "docs/client.md lists keys sparrow-client does not know: " << joined(client_unknown));
  // The new key sits where this test looks for it.
  CHECK(sim.count("state_encoding"));
  CHECK(client.count("state_encoding"));
}
