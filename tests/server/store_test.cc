#include "tests/sparrow_test.h"

#include <sqlite3.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "core/error.h"
#include "core/sqlite_db.h"
#include "server/server.h"
#include "server/store.h"
#include "tests/core/full_disk_vfs.h"

using namespace sparrow;
using namespace sparrow::server;
namespace fs = std::filesystem;

namespace {
std::string fresh_db(const std::string& name) {
  const std::string p = "server_store_test_" + name + ".db";
  for (const char* s : {"", "-wal", "-shm"}) fs::remove(p + s);
  return p;
}
Checkpoint ck(int64_t r, const std::string& w) {
  Checkpoint c;
  c.round = r;
  c.weights = w;
  c.server_opt = "opt" + std::to_string(r);
  c.acp = "acp";
  c.rng = "seed=1";
  return c;
}
}  // namespace

TEST_CASE("server store round trip") {
  const std::string path = fresh_db("roundtrip");
  {
    auto s = ServerStore::open(path);
    CHECK_FALSE(s->run().has_value());
    s->create_run({"run-x", "abc", "model = 1\n", 17});
    RoundRow r;
    r.round = 1;
    r.selected = 3;
    r.updates = 2;
    r.stale = 1;
    r.bytes_in = 100;
    r.train_loss = 0.5;
    r.eval_loss = std::nan("");
    r.eval_accuracy = std::nan("");
    ClientRow c;
    c.client_id = "alice";
    c.public_key = "KEY";
    c.updates = 1;
    c.last_selected = 1;
    s->commit_round(r, {{"client.train_loss", 0.5}}, ck(1, "weights-1"), {c}, 2);
  }
  auto s = ServerStore::open(path);
  REQUIRE(s->run().has_value());
  CHECK(s->run()->run_id == "run-x");
  CHECK(s->run()->config_hash == "abc");
  CHECK(s->completed_rounds() == 1);
  auto rounds = s->rounds();
  REQUIRE(rounds.size() == 1);
  CHECK(rounds[0].updates == 2);
  CHECK(rounds[0].stale == 1);
  CHECK(rounds[0].train_loss == doctest::Approx(0.5));
  CHECK(std::isnan(rounds[0].eval_loss));
  auto cl = s->clients();
  REQUIRE(cl.size() == 1);
  CHECK(cl[0].public_key == "KEY");
  CHECK(s->metrics(1).at("client.train_loss") == doctest::Approx(0.5));
  auto c = s->latest_checkpoint();
  REQUIRE(c.has_value());
  CHECK(c->weights == "weights-1");
  CHECK(c->server_opt == "opt1");
  CHECK(c->rng == "seed=1");
}

TEST_CASE("server store keeps the newest checkpoints only") {
  const std::string path = fresh_db("keep");
  auto s = ServerStore::open(path);
  for (int r = 1; r <= 4; ++r) {
    RoundRow row;
    row.round = r;
    s->commit_round(row, {}, ck(r, "w" + std::to_string(r)), {}, 2);
  }
  CHECK(s->completed_rounds() == 4);
  CHECK(s->latest_checkpoint()->weights == "w4");
  CHECK(s->rounds().size() == 4);
}

TEST_CASE("server store commit is all or nothing") {
  const std::string path = fresh_db("atomic");
  auto s = ServerStore::open(path);
  RoundRow row;
  row.round = 1;
  s->commit_round(row, {}, ck(1, "w1"), {}, 3);
  // A checkpoint for another round than the row is refused before any write.
  RoundRow bad;
  bad.round = 2;
  CHECK_THROWS(s->commit_round(bad, {{"m", 1}}, ck(3, "w3"), {}, 3));
  CHECK(s->completed_rounds() == 1);
  CHECK(s->latest_checkpoint()->weights == "w1");
  CHECK(s->metrics(2).empty());
  // A failure inside the transaction (a reopened read-only handle cannot write) rolls back.
  auto ro = ServerStore::open_readonly(path);
  RoundRow two;
  two.round = 2;
  CHECK_THROWS(ro->commit_round(two, {{"m", 1}}, ck(2, "w2"), {}, 3));
  CHECK(s->completed_rounds() == 1);
}

TEST_CASE("server store refuses files that are not databases") {
  const std::string path = fresh_db("garbage");
  {
    FILE* f = std::fopen(path.c_str(), "wb");
    std::fputs("this is not sqlite, not at all, definitely not a database file...........", f);
    std::fclose(f);
  }
  CHECK_THROWS_AS(ServerStore::open(path), FormatError);
  CHECK_THROWS_AS(ServerStore::open_readonly("server_store_test_missing.db"), ConfigError);
}

TEST_CASE("weights serialisation is bit exact") {
  Weights w{{"a", at::randn({3, 4})}, {"b", at::randn({5})}};
  w["a"][0][0] = -0.0f;
  const std::string bytes = serialize_weights(w);
  Weights back = deserialize_weights(bytes);
  REQUIRE(back.size() == 2);
  CHECK(at::equal(back["a"], w["a"]));
  CHECK(std::signbit(back["a"][0][0].item<float>()));
  CHECK(serialize_weights(back) == bytes);
  CHECK_THROWS_AS(deserialize_weights("junk"), FormatError);
}

TEST_CASE("server store migrates a version 1 database and keeps the aggregator state") {
  const std::string path = fresh_db("v1");
  {
    // The version 1 checkpoints table, with one checkpoint, as an earlier sparrow-server wrote it.
    sqlite3* db = nullptr;
    REQUIRE(sqlite3_open(path.c_str(), &db) == SQLITE_OK);
    REQUIRE(sqlite3_exec(db,
                         "CREATE TABLE checkpoints(round INTEGER PRIMARY KEY, weights BLOB NOT NULL, server_opt BLOB, "
                         "control BLOB, broadcast BLOB, downlink_state BLOB, downlink_last BLOB, acp BLOB, rng TEXT);"
                         "INSERT INTO checkpoints(round, weights, rng) VALUES(3, x'0102', 'seed=1');"
                         "PRAGMA user_version=1;",
                         nullptr, nullptr, nullptr) == SQLITE_OK);
    sqlite3_close(db);
  }
  {
    auto s = ServerStore::open(path);
    auto c = s->latest_checkpoint();
    REQUIRE(c.has_value());
    CHECK(c->round == 3);
    CHECK(c->weights == std::string("\x01\x02", 2));
    CHECK(c->aggregator.empty());
    s->create_run({"run-y", "h", "", 1});
    RoundRow r;
    r.round = 4;
    Checkpoint k = ck(4, "weights-4");
    k.aggregator = "SPAG1-state";
    s->commit_round(r, {}, k, {}, 2);
  }
  auto s = ServerStore::open(path);  // reopening a migrated database changes nothing
  auto c = s->latest_checkpoint();
  REQUIRE(c.has_value());
  CHECK(c->round == 4);
  CHECK(c->aggregator == "SPAG1-state");
}

namespace {
// Runs SQL on the database file directly, as a damaged disk or another
// program would change it behind the server's back.
void raw_sql(const std::string& path, const std::string& sql) {
  sqlite3* db = nullptr;
  REQUIRE(sqlite3_open(path.c_str(), &db) == SQLITE_OK);
  char* err = nullptr;
  const int rc = sqlite3_exec(db, sql.c_str(), nullptr, nullptr, &err);
  if (err) sqlite3_free(err);
  sqlite3_close(db);
  REQUIRE(rc == SQLITE_OK);
}

void commit(ServerStore& s, int64_t round, const std::string& weights, int keep) {
  RoundRow row;
  row.round = round;
  s.commit_round(row, {}, ck(round, weights), {}, keep);
}
}  // namespace

TEST_CASE("server store: a checkpoint whose bytes changed is skipped, the newest intact one is used") {
  const std::string path = fresh_db("checksum");
  {
    auto s = ServerStore::open(path);
    s->create_run({"run-c", "h", "", 1});
    for (int r = 1; r <= 3; ++r) commit(*s, r, std::string(4096, static_cast<char>('a' + r)), 2);
  }
  // One byte of round 3's weights flipped inside the file's valid structure.
  raw_sql(path,
          "UPDATE checkpoints SET weights = substr(weights, 1, 100) || 'X' || substr(weights, 102) "
          "WHERE round = 3");
  {
    auto s = ServerStore::open(path);
    auto c = s->latest_checkpoint();
    REQUIRE(c.has_value());
    CHECK(c->round == 2);
    CHECK(c->weights == std::string(4096, 'c'));
    CHECK(s->damaged_checkpoints() == std::vector<int64_t>{3});
  }
  // Both kept checkpoints damaged: a clear error, not a fresh start.
  raw_sql(path, "UPDATE checkpoints SET rng = 'seed=2' WHERE round = 2");
  auto s = ServerStore::open(path);
  CHECK_THROWS_WITH_AS(s->latest_checkpoint(), doctest::Contains("every checkpoint fails its checksum"), FormatError);
  // Rows written before checksums existed (NULL) load as they are.
  raw_sql(path, "UPDATE checkpoints SET checksum = NULL WHERE round = 2");
  auto legacy = s->latest_checkpoint();
  REQUIRE(legacy.has_value());
  CHECK(legacy->round == 2);
}

TEST_CASE("server store: a damaged page is found at open") {
  const std::string path = fresh_db("zeroed");
  {
    auto s = ServerStore::open(path);
    s->create_run({"run-z", "h", "", 1});
    for (int r = 1; r <= 3; ++r) commit(*s, r, std::string(20000, static_cast<char>('a' + r)), 3);
  }
  const auto size = fs::file_size(path);
  REQUIRE(size > 5 * 4096);
  {
    // Page 2 zeroed (a table's root page), the way a bad sector reads back.
    FILE* f = std::fopen(path.c_str(), "r+b");
    REQUIRE(f != nullptr);
    std::fseek(f, 4096, SEEK_SET);
    const std::string zeros(4096, '\0');
    std::fwrite(zeros.data(), 1, zeros.size(), f);
    std::fclose(f);
  }
  CHECK_THROWS_AS(ServerStore::open(path), FormatError);
}

TEST_CASE("server store: an empty file or another program's database is not a new run") {
  const std::string empty = fresh_db("empty");
  std::fclose(std::fopen(empty.c_str(), "wb"));
  CHECK_THROWS_WITH_AS(ServerStore::open(empty), doctest::Contains("exists but is empty"), ConfigError);
  CHECK(fs::file_size(empty) == 0);  // left as it was
  const std::string foreign = fresh_db("foreign");
  raw_sql(foreign, "CREATE TABLE invoices(id INTEGER PRIMARY KEY, total REAL); INSERT INTO invoices VALUES(1, 9.5);");
  CHECK_THROWS_WITH_AS(ServerStore::open(foreign), doctest::Contains("something else"), ConfigError);
  CHECK(fs::exists(empty));
}

namespace {
std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}
}  // namespace

TEST_CASE("server store: a full disk fails the round's commit whole, and the store goes on once there is space") {
  const std::string path = fresh_db("full");
  sparrow::testing::FullDisk disk;  // before the store: it opens through it
  auto s = ServerStore::open(path);
  s->create_run({"run-f", "h", "", 1});
  commit(*s, 1, std::string(3000, 'a'), 2);
  disk.full(true);
  RoundRow two;
  two.round = 2;
  ClientRow c;
  c.client_id = "alice";
  std::string msg;
  try {
    s->commit_round(two, {{"m", 1.0}}, ck(2, std::string(50000, 'b')), {c}, 2);
  } catch (const Error& e) {
    msg = e.what();
  }
  CHECK(disk.refused() > 0);
  CHECK(msg.find("server database '" + path + "'") != std::string::npos);
  CHECK(msg.find("the disk is full; nothing of this transaction was written") != std::string::npos);
  disk.full(false);
  CHECK(s->completed_rounds() == 1);  // nothing of round 2: no row, metric, checkpoint or client
  CHECK(s->metrics(2).empty());
  CHECK(s->clients().empty());
  CHECK(s->latest_checkpoint()->round == 1);
  s->commit_round(two, {{"m", 1.0}}, ck(2, "w2"), {c}, 2);  // the same store, once there is space
  s.reset();
  auto again = ServerStore::open(path);
  CHECK(again->completed_rounds() == 2);
  CHECK(again->latest_checkpoint()->weights == "w2");

  SUBCASE("a new database on a full disk: a clear error, and no file left to refuse at the next start") {
    const std::string fresh = fresh_db("full_new");
    disk.full(true);
    CHECK_THROWS_WITH_AS(ServerStore::open(fresh), doctest::Contains("the disk is full"), Error);
    disk.full(false);
    CHECK_FALSE(fs::exists(fresh));
    CHECK_NOTHROW(ServerStore::open(fresh));
  }
}

TEST_CASE("server store: one server per database, a newer schema, and status beside a running server") {
  const std::string path = fresh_db("lock");
  auto s = ServerStore::open(path);
  s->create_run({"run-l", "h", "", 1});
  commit(*s, 1, "w1", 2);
  CHECK_THROWS_WITH_AS(ServerStore::open(path), doctest::Contains("is in use by another sparrow-server (locked)"),
                       ConfigError);
  auto status = ServerStore::open_readonly(path);  // reads while the server holds it
  CHECK(status->completed_rounds() == 1);
  CHECK(status->run()->run_id == "run-l");
  status.reset();
  s.reset();
  CHECK_NOTHROW(ServerStore::open(path));  // the lock goes with the store
  raw_sql(path, "PRAGMA user_version=99");
  CHECK_THROWS_WITH_AS(ServerStore::open(path), doctest::Contains("schema version 99 is newer than this build"),
                       FormatError);
  CHECK_THROWS_WITH_AS(ServerStore::open_readonly(path), doctest::Contains("use a newer sparrow"), FormatError);
}

TEST_CASE("server store: status refuses what is not a server database") {
  const std::string bare = fresh_db("ro_bare"), v1 = fresh_db("ro_v1"), junk = fresh_db("ro_junk");
  raw_sql(bare, "CREATE TABLE t(x); DROP TABLE t");
  CHECK_THROWS_WITH_AS(ServerStore::open_readonly(bare), doctest::Contains("is not a sparrow-server database"),
                       ConfigError);
  raw_sql(v1, "CREATE TABLE checkpoints(round INTEGER PRIMARY KEY, weights BLOB NOT NULL)");
  CHECK_THROWS_WITH_AS(ServerStore::open_readonly(v1), doctest::Contains("has no runs table"), FormatError);
  write_bytes(junk, std::string(200, 'j'));
  CHECK_THROWS_WITH_AS(ServerStore::open_readonly(junk), doctest::Contains("is not an SQLite database"), FormatError);
  CHECK_THROWS_WITH_AS(ServerStore::open_readonly("."), doctest::Contains("is a folder"), ConfigError);
}

TEST_CASE("server store: a damaged -wal file is refused by open and status, and left as it was") {
  const std::string path = fresh_db("wal"), copy = fresh_db("wal_copy");
  {
    auto s = ServerStore::open(path);
    s->create_run({"run-w", "h", "", 1});
    for (int r = 1; r <= 6; ++r) commit(*s, r, std::string(3000, static_cast<char>('a' + r)), 10);
    // As kill -9 leaves them: the database and its log while the server runs.
    fs::copy_file(path, copy, fs::copy_options::overwrite_existing);
    fs::copy_file(path + "-wal", copy + "-wal", fs::copy_options::overwrite_existing);
  }
  {
    auto intact = ServerStore::open_readonly(copy);
    CHECK(intact->completed_rounds() == 6);
  }
  const auto scan = sparrow::sqlite::scan_wal(copy + "-wal");
  REQUIRE(scan.frames >= 6);
  std::string wal = read_bytes(copy + "-wal");
  wal[32 + static_cast<size_t>((scan.frames / 2) * (24 + scan.page_size)) + 24 + 10] ^= 0x01;
  write_bytes(copy + "-wal", wal);
  const std::string db_before = read_bytes(copy);
  CHECK_THROWS_WITH_AS(ServerStore::open(copy), doctest::Contains("-wal' is damaged"), FormatError);
  CHECK_THROWS_WITH_AS(ServerStore::open_readonly(copy), doctest::Contains("-wal' is damaged"), FormatError);
  CHECK(read_bytes(copy + "-wal") == wal);
  CHECK(read_bytes(copy) == db_before);
}
