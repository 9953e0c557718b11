// core/sqlite_db.h: the checks made before SQLite opens a file, the WAL scan.
#include <sqlite3.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/sqlite_db.h"
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
    for (const std::string bytes : {std::string("x"), std::string(4096, 'a')}) {
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
