// Damaged or foreign state is refused (or resumed from with a warning that
// says what was lost), and bad paths are config errors naming their key
// (issue 48, items 3 and 6). The real binaries; one client and the mlp model.
#include <sys/stat.h>

#include "tests/integration/fixtures.h"

using namespace sparrow::testing::integ;  // NOLINT(google-build-using-namespace)

namespace {

const std::string kSimBin = kBin + "/sparrow-sim";
const std::string kEdgeBin = kBin + "/sparrow-edge";

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void sql(const std::string& path, const std::string& statements) {
  sqlite3* db = nullptr;
  REQUIRE(sqlite3_open(path.c_str(), &db) == SQLITE_OK);
  char* err = nullptr;
  const int rc = sqlite3_exec(db, statements.c_str(), nullptr, nullptr, &err);
  INFO((err ? err : ""));
  sqlite3_free(err);
  sqlite3_close(db);
  REQUIRE(rc == SQLITE_OK);
}

// The rounds SQLite itself sees in a copy of `db` and its -wal file (the copy
// is opened read-write, so SQLite replays the log as a restarted server would).
int64_t rounds_sqlite_sees(const std::string& db, const std::string& scratch) {
  fs::remove_all(scratch);
  fs::create_directories(scratch);
  fs::copy_file(db, scratch + "/x.db");
  if (fs::exists(db + "-wal")) fs::copy_file(db + "-wal", scratch + "/x.db-wal");
  sqlite3* h = nullptr;
  REQUIRE(sqlite3_open((scratch + "/x.db").c_str(), &h) == SQLITE_OK);
  sqlite3_stmt* st = nullptr;
  REQUIRE(sqlite3_prepare_v2(h, "SELECT COUNT(*) FROM rounds", -1, &st, nullptr) == SQLITE_OK);
  REQUIRE(sqlite3_step(st) == SQLITE_ROW);
  const int64_t n = sqlite3_column_int64(st, 0);
  sqlite3_finalize(st);
  sqlite3_close(h);
  return n;
}

// A server with one client (600 samples) running `rounds` rounds of mlp.
std::string one_client_server(const std::string& name, int rounds, const std::string& extra = "") {
  const std::string dir = fresh_dir(name);
  keygen(dir, 1);
  server_toml(dir, "rounds = " + std::to_string(rounds) +
                       "\nclients_per_round = 1\nround_deadline_s = 20\nheartbeat_ms = 300\n" + extra);
  return dir;
}

uint32_t be32(const std::string& s, size_t at) {
  return (uint32_t(uint8_t(s[at])) << 24) | (uint32_t(uint8_t(s[at + 1])) << 16) | (uint32_t(uint8_t(s[at + 2])) << 8) |
         uint32_t(uint8_t(s[at + 3]));
}

}  // namespace

TEST_CASE("bad state: a flipped byte in the server's -wal file after kill -9 is refused, naming the file") {
  const std::string dir = one_client_server("wal_flip", 8, "keep_checkpoints = 10\n");
  {
    auto server = start_server(dir, dir + "/server1.log");
    auto client = start_client(dir, 1, server_endpoint(*server), 100, 0);
    // Killed early: SQLite checkpoints its log once it passes 1,000 pages
    // (about five rounds of this model) and restarts it at the next commit,
    // after which the log holds too few current frames to damage one in the middle.
    REQUIRE_MESSAGE(server->wait_for_log("event=round_completed round=2", 120s), log_tail(*server));
    server->signal(SIGKILL);
    REQUIRE(server->wait(10s) == 128 + SIGKILL);
    client->signal(SIGKILL);
    client->wait(10s);
  }
  const std::string db = dir + "/server.db", wal = db + "-wal";
  REQUIRE(fs::exists(wal));
  const int64_t intact = rounds_sqlite_sees(db, dir + "/scratch");
  REQUIRE(intact >= 2);
  // One byte in the page of a frame in the middle of the log's current frames.
  std::string bytes = read_file(wal);
  const size_t page = be32(bytes, 8), frame = 24 + page;
  size_t current = 0;  // frames carrying the header's salts, from the start
  while (32 + (current + 1) * frame <= bytes.size() && bytes.compare(32 + current * frame + 8, 8, bytes, 16, 8) == 0)
    ++current;
  REQUIRE(current >= 4);
  bytes[32 + (current / 2) * frame + 24 + page / 2] ^= 0x10;
  write_file(wal, bytes);
  const int64_t damaged = rounds_sqlite_sees(db, dir + "/scratch");
  REQUIRE(damaged < intact);  // what SQLite alone would silently resume from
  const std::string db_before = read_file(db);

  // The server stops at start, names the -wal file and says what to do.
  auto server = start_server(dir, dir + "/server2.log");
  const auto rc = server->wait(60s);
  const std::string log = server->log();
  INFO(log);
  CHECK(rc == std::optional<int>(2));
  CHECK(log.find("'" + wal + "' is damaged") != std::string::npos);
  CHECK(log.find("Restore the database and its -wal file from a backup") != std::string::npos);
  CHECK(log.find("event=resumed") == std::string::npos);
  CHECK(read_file(wal) == bytes);  // nothing written
  CHECK(read_file(db) == db_before);
  // So does `status`.
  CHECK(run_tool({kServerBin, "status", "--db", db}, dir + "/status.log") == 2);
  CHECK(read_file(dir + "/status.log").find("is damaged") != std::string::npos);
  // The advice works: cut the log where it says, and the intact commits stand.
  std::smatch m;
  REQUIRE(std::regex_search(log, m, std::regex("truncate -s (\\d+)")));
  fs::resize_file(wal, std::stoull(m[1]));
  CHECK(run_tool({kServerBin, "status", "--db", db}, dir + "/status2.log") == 0);
  CHECK(read_file(dir + "/status2.log").find("completed rounds: " + std::to_string(damaged)) != std::string::npos);
  fs::remove_all(dir);
}

TEST_CASE("bad state: a server database whose checkpoints are gone is refused, or resumed with the rounds lost") {
  const std::string dir = one_client_server("ckpt_gone", 4, "keep_checkpoints = 2\n");
  {
    auto server = start_server(dir, dir + "/server1.log");
    auto client = start_client(dir, 1, server_endpoint(*server), 100, 0);
    REQUIRE_MESSAGE(server->wait(120s) == std::optional<int>(0), log_tail(*server));
    client->wait(30s);
  }
  const std::string db = dir + "/server.db";
  SUBCASE("every checkpoint row deleted: refused") {
    sql(db, "DELETE FROM checkpoints");
    auto server = start_server(dir, dir + "/server2.log", {"rounds=6"});
    const auto rc = server->wait(60s);
    const std::string log = server->log();
    INFO(log);
    CHECK(rc == std::optional<int>(2));
    CHECK(log.find("records 4 completed round(s) but holds no checkpoint") != std::string::npos);
    CHECK(log.find("event=round_started") == std::string::npos);
  }
  SUBCASE("the newest deleted: resumed from the older one, with a warning naming the rounds lost") {
    sql(db, "DELETE FROM checkpoints WHERE round = 4");
    auto server = start_server(dir, dir + "/server2.log", {"rounds=6"});
    REQUIRE_MESSAGE(server->wait_for_log("event=resumed", 60s), server->log());
    const std::string log = server->log();
    CHECK(log.find("event=rounds_lost db=" + db + " checkpoint_round=3 recorded_rounds=4 lost=1") != std::string::npos);
    server->signal(SIGTERM);
    server->wait(30s);
  }
  fs::remove_all(dir);
}

TEST_CASE("bad state: an existing file that is not a sparrow database is never written to") {
  const std::string dir = one_client_server("foreign_db", 1);
  const std::string db = dir + "/server.db";
  struct Case {
    std::string name, make_sql, raw, expect;
  };
  for (const Case& c :
       {Case{"1 byte", "", "x", "is not an SQLite database"},
        Case{"text", "", std::string(300, 'a'), "is not an SQLite database"},
        Case{"another program's database", "CREATE TABLE notes(x)", "", "of something else"},
        Case{"an empty SQLite database", "CREATE TABLE t(x); DROP TABLE t", "", "is not a sparrow-server database"}}) {
    INFO(c.name);
    fs::remove(db);
    if (c.make_sql.empty())
      write_file(db, c.raw);
    else
      sql(db, c.make_sql);
    REQUIRE(fs::file_size(db) > 0);
    const std::string before = read_file(db);
    CHECK(run_tool({kServerBin, "--config", dir + "/server.toml"}, dir + "/server.log") == 2);
    const std::string log = read_file(dir + "/server.log");
    CHECK_MESSAGE(log.find(c.expect) != std::string::npos, log);
    CHECK(read_file(db) == before);
    CHECK_FALSE(fs::exists(db + "-wal"));
  }
  // The client's state_db too (the client stops before connecting anywhere).
  const std::string state = dir + "/client1.db";
  write_file(state, "x");
  auto client = start_client(dir, 1, "tcp://127.0.0.1:9", 100, 0);
  const auto rc = client->wait(60s);
  const std::string log = client->log();
  INFO(log);
  CHECK(rc == std::optional<int>(2));
  CHECK(log.find("'" + state + "' is not an SQLite database") != std::string::npos);
  CHECK(read_file(state) == "x");
  fs::remove_all(dir);
}

TEST_CASE("bad paths: exit 2 naming the key, nothing written") {
  const std::string dir = fresh_dir("bad_paths");
  keygen(dir, 1);
  const std::string folder = dir + "/a_folder", file = dir + "/a_file";
  fs::create_directories(folder);
  write_file(file, "not a folder");
  const std::string server_cfg = server_toml(dir, "rounds = 1\n");
  write_file(dir + "/client.toml",
             "server = \"tcp://127.0.0.1:9\"\ninsecure = true\nclient_id = \"c1\"\n"
             "model = \"mlp\"\ndata = \"fashion-mnist\"\npartition = \"iid\"\nclients = 100\n"
             "index = 0\n");
  write_file(dir + "/sim.toml",
             "dataset = \"synthetic:alpha=0.5,beta=0.5\"\nclients = 4\nclients_per_round = 2\n"
             "rounds = 1\nmodel = \"logreg\"\nworkers = 1\n");
  write_file(dir + "/cloud.toml", "listen = \"tcp://127.0.0.1:0\"\ninsecure = true\nmodel = \"mlp\"\ncut = \"fc1\"\n");
  write_file(dir + "/device.toml",
             "cloud = \"tcp://127.0.0.1:9\"\ninsecure = true\ndevice_id = \"d1\"\n"
             "model = \"mlp\"\ncut = \"fc1\"\nsteps = 1\ndata = \"fashion-mnist\"\n"
             "partition = \"iid\"\nclients = 100\nindex = 0\nprogress = \"\"\n");
  const std::string junk = dir + "/junk.bin";
  write_file(junk, "this is not a weights file");
  struct Case {
    std::vector<std::string> argv;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {{kServerBin, "--config", server_cfg, "--set", "db=" + folder}, "config key 'db': '" + folder + "' is a folder"},
      {{kServerBin, "--config", server_cfg, "--set", "db=" + dir + "/missing/x.db"},
       "config key 'db': '" + dir + "/missing/x.db' is in '" + dir + "/missing', which does not exist"},
      {{kServerBin, "status", "--db", folder}, "config key '--db': '" + folder + "' is a folder"},
      {{kServerBin, "--config", folder}, "config '" + folder + "' is a folder"},
      {{kClientBin, "--config", dir + "/client.toml", "--set", "state_db=" + folder},
       "config key 'state_db': '" + folder + "' is a folder"},
      {{kClientBin, "--config", folder}, "config '" + folder + "' is a folder"},
      {{kSimBin, "--config", dir + "/sim.toml", "--set", "out=/proc/sparrow_bad_paths"},
       "config key 'out': cannot create the folder '/proc/sparrow_bad_paths'"},
      {{kSimBin, "--config", dir + "/sim.toml", "--set", "out=" + file},
       "config key 'out': '" + file + "' is a file, not a folder"},
      {{kSimBin, "--config", folder}, "config '" + folder + "' is a folder"},
      {{kEdgeBin, "serve", "--config", dir + "/cloud.toml", "--set", "state=" + folder},
       "config key 'state': '" + folder + "' is a folder"},
      {{kEdgeBin, "serve", "--config", folder}, "config '" + folder + "' is a folder"},
      {{kEdgeBin, "--config", folder}, "config '" + folder + "' is a folder"},
      {{kEdgeBin, "--config", dir + "/device.toml", "--set", "weights=" + junk},
       "weights '" + junk + "' is not a weights file"},
      {{kEdgeBin, "--config", dir + "/device.toml", "--set", "progress=" + junk},
       "progress '" + junk + "' is not a progress file"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    std::string cmd;
    for (const auto& a : c.argv) cmd += a + " ";
    INFO(cmd);
    const std::string log = dir + "/case" + std::to_string(i) + ".log";
    CHECK(run_tool(c.argv, log) == 2);
    const std::string text = read_file(log);
    CHECK_MESSAGE(text.find(c.expect) != std::string::npos, text);
    CHECK(text.find(".cc:") == std::string::npos);  // no source file and line
    CHECK(fs::is_empty(folder));                    // nothing written
    CHECK(read_file(file) == "not a folder");
    CHECK(read_file(junk) == "this is not a weights file");
  }
  CHECK_FALSE(fs::exists(dir + "/missing"));
  CHECK_FALSE(fs::exists("/proc/sparrow_bad_paths"));
  fs::remove_all(dir);
}

TEST_CASE("bad paths: a secret key file others can read gets a warning at start") {
  const std::string dir = fresh_dir("key_mode");
  keygen(dir, 1);
  const std::string secret = dir + "/keys/server.key_secret";
  server_toml(dir, "rounds = 1\n");
  {
    auto server = start_server(dir, dir + "/private.log");
    server_endpoint(*server);
    CHECK(server->log().find("event=key_permissions") == std::string::npos);  // keygen writes 0600
    server->signal(SIGTERM);
    server->wait(30s);
  }
  REQUIRE(::chmod(secret.c_str(), 0644) == 0);
  auto server = start_server(dir, dir + "/readable.log");
  server_endpoint(*server);
  const std::string log = server->log();
  CHECK(log.find("event=key_permissions") != std::string::npos);
  CHECK(log.find("config key 'key': the secret key file '" + secret + "' can be read by other users (mode 644)") !=
        std::string::npos);
  CHECK(log.find("chmod 600") != std::string::npos);
  server->signal(SIGTERM);
  server->wait(30s);
  fs::remove_all(dir);
}
