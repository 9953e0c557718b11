// core/sqlite_db.h: the checks made before SQLite opens a file, the WAL scan, and
// Db/Stmt/Transaction (migration, refusals, errors, a full disk).
#include <sqlite3.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <fstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/sqlite_db.h"
#include "tests/core/full_disk_vfs.h"
#include "tests/sparrow_test.h"

namespace fs = std::filesystem;
using sparrow::ConfigError;
using sparrow::FormatError;
using sparrow::sqlite::check_before_open;
using sparrow::sqlite::scan_wal;

namespace {

struct TempDir {
  fs::path dir;
  TempDir() {
    char tmpl[] = "/tmp/sparrow_sqlite_db_test_XXXXXX";
    dir = ::mkdtemp(tmpl);
  }
  ~TempDir() { fs::remove_all(dir); }
  std::string operator/(const std::string& name) const { return (dir / name).string(); }
};

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
void write_all(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

void exec(sqlite3* db, const std::string& sql) {
  REQUIRE(sqlite3_exec(db, sql.c_str(), nullptr, nullptr, nullptr) == SQLITE_OK);
}

int64_t count_rows(const std::string& path) {
  sqlite3* db = nullptr;
  REQUIRE(sqlite3_open(path.c_str(), &db) == SQLITE_OK);
  sqlite3_stmt* st = nullptr;
  REQUIRE(sqlite3_prepare_v2(db, "SELECT COUNT(*) FROM t", -1, &st, nullptr) == SQLITE_OK);
  REQUIRE(sqlite3_step(st) == SQLITE_ROW);
  const int64_t n = sqlite3_column_int64(st, 0);
  sqlite3_finalize(st);
  sqlite3_close(db);
  return n;
}

// `commits` transactions of one row each into a WAL database, copied (file and
// -wal) to `copy` while the connection is open, as a kill -9 would leave them.
void wal_database(const std::string& path, const std::string& copy, int commits) {
  sqlite3* db = nullptr;
  REQUIRE(sqlite3_open(path.c_str(), &db) == SQLITE_OK);
  exec(db, "PRAGMA journal_mode=WAL; PRAGMA wal_autocheckpoint=0; CREATE TABLE t(x BLOB)");
  for (int i = 0; i < commits; ++i) exec(db, "INSERT INTO t VALUES(randomblob(3000))");
  fs::copy_file(path, copy, fs::copy_options::overwrite_existing);
  fs::copy_file(path + "-wal", copy + "-wal", fs::copy_options::overwrite_existing);
  sqlite3_close(db);
}

void put_be32(std::string& s, size_t at, uint32_t v) {
  for (int i = 0; i < 4; ++i) s[at + i] = static_cast<char>(v >> (24 - 8 * i));
}

// A WAL of `pages` frames of 512 bytes, every one a commit, with checksums in
// big-endian words (magic 0x377f0683), built here byte by byte.
std::string big_endian_wal(int pages) {
  auto sum = [](const std::string& s, size_t from, size_t n, uint32_t c[2]) {
    auto be = [&](size_t i) {
      return (uint32_t(uint8_t(s[i])) << 24) | (uint32_t(uint8_t(s[i + 1])) << 16) |
             (uint32_t(uint8_t(s[i + 2])) << 8) | uint32_t(uint8_t(s[i + 3]));
    };
    for (size_t i = from; i < from + n; i += 8) {
      c[0] += be(i) + c[1];
      c[1] += be(i + 4) + c[0];
    }
  };
  std::string w(32, '\0');
  put_be32(w, 0, 0x377f0683u);
  put_be32(w, 4, 3007000u);
  put_be32(w, 8, 512);
  put_be32(w, 16, 0x11223344u);
  put_be32(w, 20, 0x55667788u);
  uint32_t c[2] = {0, 0};
  sum(w, 0, 24, c);
  put_be32(w, 24, c[0]);
  put_be32(w, 28, c[1]);
  for (int p = 1; p <= pages; ++p) {
    const size_t at = w.size();
    w.resize(at + 24 + 512);
    for (size_t i = 0; i < 512; ++i) w[at + 24 + i] = static_cast<char>((i * 7 + p) & 0xff);
    put_be32(w, at, p);      // page number
    put_be32(w, at + 4, p);  // database size after commit: a commit frame
    put_be32(w, at + 8, 0x11223344u);
    put_be32(w, at + 12, 0x55667788u);
    sum(w, at, 8, c);
    sum(w, at + 24, 512, c);
    put_be32(w, at + 16, c[0]);
    put_be32(w, at + 20, c[1]);
  }
  return w;
}

}  // namespace

TEST_CASE("scan_wal: SQLite's own log, intact and with one flipped byte") {
  TempDir t;
  const std::string db = t / "a.db", copy = t / "copy.db";
  wal_database(db, copy, 6);
  const auto intact = scan_wal(copy + "-wal");
  CHECK(intact.present);
  CHECK(intact.commits == 7);  // CREATE TABLE and six inserts
  CHECK_FALSE(intact.damaged());
  CHECK(intact.first_bad_frame == 0);
  CHECK_NOTHROW(check_before_open(copy, "test store"));

  SUBCASE("a byte in the middle: later commits would be dropped, refused with what to do") {
    std::string wal = read_all(copy + "-wal");
    const int64_t frame = 24 + intact.page_size;
    const int64_t bad = intact.frames / 2 + 1;  // 1-based
    wal[32 + (bad - 1) * frame + 24 + 100] ^= 0x01;
    write_all(copy + "-wal", wal);
    const auto w = scan_wal(copy + "-wal");
    CHECK(w.damaged());
    CHECK(w.first_bad_frame == bad);
    CHECK(w.commits + w.commits_after_bad <= 7);
    CHECK(w.commits_after_bad >= 1);
    std::string msg;
    try {
      check_before_open(copy, "test store");
    } catch (const FormatError& e) {
      msg = e.what();
    }
    CHECK(msg.find("copy.db-wal' is damaged") != std::string::npos);
    CHECK(msg.find("Restore the database and its -wal file from a backup") != std::string::npos);
    CHECK(msg.find("truncate -s " + std::to_string(w.intact_bytes)) != std::string::npos);
    CHECK(read_all(copy + "-wal") == wal);  // nothing written
    // The advice holds: cut there, the log is clean and SQLite keeps its intact commits.
    fs::resize_file(copy + "-wal", static_cast<uintmax_t>(w.intact_bytes));
    CHECK_NOTHROW(check_before_open(copy, "test store"));
    CHECK(count_rows(copy) == w.commits - 1);
  }
  SUBCASE("a byte in a frame's salt") {
    std::string wal = read_all(copy + "-wal");
    wal[32 + 24 + intact.page_size + 9] ^= 0x40;  // frame 2's salt-1
    write_all(copy + "-wal", wal);
    CHECK(scan_wal(copy + "-wal").first_bad_frame == 2);
    CHECK_THROWS_AS(check_before_open(copy, "test store"), FormatError);
  }
  SUBCASE("a byte in the header") {
    std::string wal = read_all(copy + "-wal");
    wal[17] ^= 0x01;  // salt-1
    write_all(copy + "-wal", wal);
    CHECK(scan_wal(copy + "-wal").header_damaged);
    CHECK_THROWS_WITH_AS(check_before_open(copy, "test store"), doctest::Contains("damaged header"), FormatError);
  }
  SUBCASE("the last frame: indistinguishable from a write cut short, not refused") {
    std::string wal = read_all(copy + "-wal");
    wal[wal.size() - 5] ^= 0x01;
    write_all(copy + "-wal", wal);
    const auto w = scan_wal(copy + "-wal");
    CHECK_FALSE(w.damaged());
    CHECK(w.commits == 6);
  }
  SUBCASE("a torn last frame (file cut mid-frame) is not damage") {
    fs::resize_file(copy + "-wal", fs::file_size(copy + "-wal") - 100);
    CHECK_FALSE(scan_wal(copy + "-wal").damaged());
  }
}

TEST_CASE("scan_wal: big-endian checksums") {
  TempDir t;
  const std::string path = t / "be.db-wal";
  std::string wal = big_endian_wal(5);
  write_all(path, wal);
  auto w = scan_wal(path);
  CHECK(w.commits == 5);
  CHECK(w.frames == 5);
  CHECK_FALSE(w.damaged());
  wal[32 + 2 * (24 + 512) + 24 + 3] ^= 0x80;  // frame 3's page
  write_all(path, wal);
  w = scan_wal(path);
  CHECK(w.first_bad_frame == 3);
  CHECK(w.commits == 2);
  CHECK(w.commits_after_bad == 2);
  CHECK(w.intact_bytes == 32 + 2 * (24 + 512));
}

TEST_CASE("check_before_open: what is refused before SQLite sees the file") {
  TempDir t;
  SUBCASE("a new file in an existing folder is fine") { CHECK_NOTHROW(check_before_open(t / "new.db", "store")); }
  SUBCASE("a folder") {
    CHECK_THROWS_WITH_AS(check_before_open(t.dir.string(), "store"), doctest::Contains("is a folder"), ConfigError);
  }
  SUBCASE("a missing folder") {
    CHECK_THROWS_WITH_AS(check_before_open(t / "nowhere/x.db", "store"), doctest::Contains("does not exist"),
                         ConfigError);
  }
  SUBCASE("0 bytes") {
    write_all(t / "empty.db", "");
    CHECK_THROWS_WITH_AS(check_before_open(t / "empty.db", "store"), doctest::Contains("0 bytes"), ConfigError);
  }
  SUBCASE("1 byte, and text: not SQLite, left as it was") {
    for (const std::string& bytes : {std::string("x"), std::string(4096, 'a')}) {
      write_all(t / "junk.db", bytes);
      CHECK_THROWS_WITH_AS(check_before_open(t / "junk.db", "store"), doctest::Contains("not an SQLite database"),
                           FormatError);
      CHECK(read_all(t / "junk.db") == bytes);
    }
  }
  SUBCASE("a -wal file without its database") {
    write_all(t / "gone.db-wal", big_endian_wal(1));
    CHECK_THROWS_WITH_AS(check_before_open(t / "gone.db", "store"), doctest::Contains("gone.db-wal"), ConfigError);
  }
  SUBCASE("sqlite::Db refuses a damaged -wal file") {
    const std::string db = t / "s.db", copy = t / "c.db";
    wal_database(db, copy, 4);
    std::string wal = read_all(copy + "-wal");
    wal[32 + 24 + 10] ^= 0x01;  // frame 1's page
    write_all(copy + "-wal", wal);
    CHECK_THROWS_AS(sparrow::sqlite::Db(copy, sparrow::sqlite::OpenOptions{"test store", {"t"}}), FormatError);
    CHECK(read_all(copy + "-wal") == wal);
  }
}

// ---- Db: what the stores build on -------------------------------------------------

namespace {

using sparrow::Error;
using sparrow::sqlite::Db;
using sparrow::sqlite::OpenOptions;
using sparrow::sqlite::Stmt;
using sparrow::sqlite::Transaction;

// A store of table `t`, version 2, whose migration records what it was called with.
struct Opened {
  std::vector<int> migrations;  // from_version of each call
  OpenOptions options(int version = 2) {
    OpenOptions o;
    o.what = "test store";
    o.tables = {"t"};
    o.schema_version = version;
    o.existing_needs_tables = true;
    o.migrate = [this](Db& db, int from) {
      migrations.push_back(from);
      db.exec("CREATE TABLE IF NOT EXISTS t(k INTEGER PRIMARY KEY, v BLOB)");
      if (!db.has_column("t", "note")) db.exec("ALTER TABLE t ADD COLUMN note TEXT");
    };
    return o;
  }
};

int64_t user_version(Db& db) {
  Stmt s(db, "PRAGMA user_version");
  s.step();
  return s.i64(0);
}

int64_t rows(Db& db) {
  Stmt s(db, "SELECT COUNT(*) FROM t");
  s.step();
  return s.i64(0);
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("checksum and crc32_of: the values already stored in files") {
  // The standard CRC-32 check value: the client-state store's row checksum.
  CHECK(sparrow::sqlite::crc32_of(std::string("123456789")) == 0xCBF43926);
  CHECK(sparrow::sqlite::crc32_of(std::string()) == 0);
  // checksum(): the seed's 8 bytes, then each piece's 8-byte length and bytes (the
  // server's checkpoints, the cloud store). Built here by hand with zlib.
  const std::string a = "weights", b;
  const int64_t seed = 7;
  std::string bytes(reinterpret_cast<const char*>(&seed), 8);
  for (const std::string* s : {&a, &b}) {
    const uint64_t n = s->size();
    bytes.append(reinterpret_cast<const char*>(&n), 8);
    bytes += *s;
  }
  CHECK(sparrow::sqlite::checksum({&a, &b}, seed) == sparrow::sqlite::crc32_of(bytes));
  const std::string a2 = "weight", b2 = "s";  // a moved boundary changes it
  CHECK(sparrow::sqlite::checksum({&a2, &b2}, seed) != sparrow::sqlite::checksum({&a, &b}, seed));
}

TEST_CASE("Db: migrate runs once per version, with user_version, in one transaction") {
  TempDir t;
  const std::string path = t / "m.db";
  Opened o;
  {
    Db db(path, o.options());
    CHECK(db.schema_version_found() == 0);
    CHECK(user_version(db) == 2);
    CHECK(db.has_column("t", "note"));
    CHECK_FALSE(db.has_column("t", "nothing"));
    Stmt(db, "INSERT INTO t(k, v) VALUES(1, x'00')").step();
  }
  { Db again(path, o.options()); }  // same version: no migration
  CHECK(o.migrations == std::vector<int>{0});
  {
    Db v3(path, o.options(3));  // a newer build migrates from 2
    CHECK(user_version(v3) == 3);
    CHECK(rows(v3) == 1);
  }
  CHECK(o.migrations == std::vector<int>{0, 2});
  // An older build refuses the file, naming it and what to do.
  CHECK_THROWS_WITH_AS(Db(path, o.options(2)), doctest::Contains("schema version 3 is newer than this build (2)"),
                       FormatError);

  SUBCASE("a migration that fails leaves the file as it was") {
    OpenOptions bad = o.options(4);
    bad.migrate = [](Db& db, int) {
      db.exec("ALTER TABLE t ADD COLUMN half_done INTEGER");
      throw Error("migration step failed");
    };
    CHECK_THROWS_WITH(Db(path, bad), doctest::Contains("migration step failed"));
    Db db(path, o.options(3));
    CHECK(user_version(db) == 3);
    CHECK_FALSE(db.has_column("t", "half_done"));
    CHECK(rows(db) == 1);
  }
  SUBCASE("a new file whose open fails is removed again") {
    const std::string fresh = t / "fresh.db";
    OpenOptions bad = o.options();
    bad.migrate = [](Db&, int) { throw Error("no"); };
    CHECK_THROWS(Db(fresh, bad));
    for (const char* s : {"", "-wal", "-shm", "-journal"}) CHECK_FALSE(fs::exists(fresh + s));
    CHECK_NOTHROW(Db(fresh, o.options()));  // and the next open starts afresh
  }
}

TEST_CASE("Db: files that are not this store's") {
  TempDir t;
  Opened o;
  SUBCASE("another program's database, and an SQLite file without tables, are left as they were") {
    const std::string foreign = t / "foreign.db", bare = t / "bare.db";
    {
      sqlite3* h = nullptr;
      REQUIRE(sqlite3_open(foreign.c_str(), &h) == SQLITE_OK);
      exec(h, "CREATE TABLE songs(title TEXT)");
      sqlite3_close(h);
      REQUIRE(sqlite3_open(bare.c_str(), &h) == SQLITE_OK);
      exec(h, "CREATE TABLE x(a); DROP TABLE x");
      sqlite3_close(h);
    }
    const std::string before = read_all(foreign), bare_before = read_all(bare);
    CHECK_THROWS_WITH_AS(Db(foreign, o.options()), doctest::Contains("is an SQLite database of something else"),
                         ConfigError);
    CHECK_THROWS_WITH_AS(Db(bare, o.options()), doctest::Contains("exists but is not a test store (no tables)"),
                         ConfigError);
    CHECK(read_all(foreign) == before);
    CHECK(read_all(bare) == bare_before);
    CHECK(o.migrations.empty());
    OpenOptions named = o.options();
    named.owner = "sparrow-test";
    CHECK_THROWS_WITH_AS(Db(bare, named), doctest::Contains("is not a sparrow-test database"), ConfigError);
  }
  SUBCASE("a damaged page: quick_check") {
    const std::string path = t / "pages.db";
    {
      OpenOptions small = o.options();
      small.page_size = 1024;
      Db db(path, small);
      Transaction tx(db);
      for (int i = 0; i < 50; ++i) Stmt(db, "INSERT INTO t(k, v) VALUES(?, randomblob(900))").bind(1, i).step();
      tx.commit();
    }
    std::string bytes = read_all(path);
    REQUIRE(bytes.size() > 8 * 1024);
    std::fill(bytes.begin() + 2048, bytes.begin() + 3072, '\0');  // page 3
    write_all(path, bytes);
    CHECK_THROWS_WITH_AS(Db(path, o.options()), doctest::Contains("is damaged (SQLite quick_check"), FormatError);
  }
}

TEST_CASE("Db: page_size applies to a new file only") {
  TempDir t;
  Opened o;
  OpenOptions big = o.options();
  big.page_size = 65536;
  auto page_size = [](Db& db) {
    Stmt s(db, "PRAGMA page_size");
    s.step();
    return s.i64(0);
  };
  {
    Db db(t / "p.db", big);
    CHECK(page_size(db) == 65536);
  }
  { Db plain(t / "q.db", o.options()); }
  Db later(t / "q.db", big);
  CHECK(page_size(later) == 4096);
}

TEST_CASE("Db: exclusive, read-only and another connection") {
  TempDir t;
  const std::string path = t / "x.db";
  Opened o;
  OpenOptions ex = o.options();
  ex.exclusive = true;
  ex.owner = "sparrow-test";
  auto first = std::make_unique<Db>(path, ex);
  Stmt(*first, "INSERT INTO t(k) VALUES(1)").step();
  CHECK_THROWS_WITH_AS(Db(path, ex), doctest::Contains("is in use by another sparrow-test (locked)"), ConfigError);

  OpenOptions ro = o.options();
  ro.read_only = true;
  {
    Db reader(path, ro);  // while the writer holds it
    CHECK(rows(reader) == 1);
    CHECK_THROWS_AS(Stmt(reader, "INSERT INTO t(k) VALUES(2)").step(), Error);
  }
  {
    auto again = first->another_connection();
    CHECK(rows(*again) == 1);
    Stmt(*again, "INSERT INTO t(k) VALUES(3)").step();
    CHECK(rows(*first) == 2);
  }
  first.reset();
  CHECK_NOTHROW(Db(path, ex));  // the lock goes with the Db
  CHECK_THROWS_WITH_AS(Db(t / "missing.db", ro), doctest::Contains("does not exist"), ConfigError);
  CHECK_FALSE(fs::exists(t / "missing.db"));
}

TEST_CASE("Db: errors name the store and the file") {
  TempDir t;
  const std::string path = t / "e.db";
  Opened o;
  Db db(path, o.options());
  CHECK_THROWS_WITH_AS(db.fail("read", SQLITE_CORRUPT), doctest::Contains(("test store '" + path + "': read").c_str()),
                       FormatError);
  CHECK_THROWS_WITH_AS(db.fail("write", SQLITE_BUSY), doctest::Contains("is in use by another process"), ConfigError);
  CHECK_THROWS_WITH_AS(db.fail("write", SQLITE_FULL), doctest::Contains("the disk is full"), Error);
  CHECK_THROWS_WITH_AS(db.fail("write", SQLITE_IOERR_WRITE), doctest::Contains("sqlite code 778"), Error);
  // A failed step resets its statement: the same statement runs again.
  Stmt ins(db, "INSERT INTO t(k) VALUES(?)", /*reused=*/true);
  ins.bind(1, 5).step();
  ins.reset();
  ins.bind(1, 5);
  CHECK_THROWS_WITH_AS(ins.step("insert"), doctest::Contains("insert: UNIQUE constraint failed"), Error);
  ins.reset();
  ins.bind(1, 6).step();
  CHECK(rows(db) == 2);
}

TEST_CASE("Stmt: reals, NULLs and blobs") {
  TempDir t;
  Opened o;
  Db db(t / "s.db", o.options());
  const std::string bytes("\0\1\2", 3), empty;
  Stmt(db, "INSERT INTO t(k, v, note) VALUES(1, ?, ?)").bind_blob(1, bytes).bind_text(2, "n").step();
  Stmt(db, "INSERT INTO t(k, v) VALUES(2, ?)").bind_blob(1, empty).step();
  Stmt s(db, "SELECT v, note, typeof(v) FROM t ORDER BY k");
  REQUIRE(s.step());
  CHECK(s.blob(0) == bytes);
  CHECK(s.blob(1) == "n");
  REQUIRE(s.step());
  CHECK(s.blob(0).empty());
  CHECK(s.blob(2) == "blob");  // a 0-byte blob, not NULL
  CHECK(s.is_null(1));
  CHECK_FALSE(s.step());
  Stmt r(db, "SELECT ?, ?");
  r.bind_real(1, std::nan("")).bind_real(2, 2.5);
  REQUIRE(r.step());
  CHECK(r.is_null(0));
  CHECK(std::isnan(r.real(0)));
  CHECK(r.real(1) == 2.5);
}

TEST_CASE("Db: a full disk is a clear error and leaves nothing of the transaction") {
  TempDir t;
  const std::string path = t / "full.db";
  Opened o;
  sparrow::testing::FullDisk disk;
  Db db(path, o.options());
  Stmt(db, "INSERT INTO t(k, v) VALUES(1, randomblob(100))").step();
  disk.full(true);
  const std::string msg = error_of([&] {
    Transaction tx(db);
    for (int i = 2; i < 40; ++i) Stmt(db, "INSERT INTO t(k, v) VALUES(?, randomblob(5000))").bind(1, i).step();
    tx.commit();
  });
  CHECK(disk.refused() > 0);
  CHECK(msg.find("test store '" + path + "'") != std::string::npos);
  CHECK(msg.find("the disk is full; nothing of this transaction was written") != std::string::npos);
  CHECK_FALSE(db.in_transaction());
  disk.full(false);
  CHECK(rows(db) == 1);
  Stmt(db, "INSERT INTO t(k) VALUES(2)").step();  // usable once there is space
  CHECK(rows(db) == 2);

  SUBCASE("a new file on a full disk is not left behind") {
    disk.full(true);
    CHECK_THROWS_WITH_AS(Db(t / "new.db", o.options()), doctest::Contains("the disk is full"), Error);
    disk.full(false);
    CHECK_FALSE(fs::exists(t / "new.db"));
  }
}
