#include "core/sqlite_db.h"

#include <fcntl.h>
#include <sqlite3.h>
#include <sys/file.h>
#include <unistd.h>
#include <zlib.h>

#include <filesystem>

#include "core/error.h"

namespace sparrow::sqlite {

Db::Db(const std::string& path, const OpenOptions& o) : path_(path), what_(o.what) {
  try {
    open(o);
  } catch (...) {
    close();
    throw;
  }
}

void Db::close() {
  if (db_) sqlite3_close_v2(db_);
  db_ = nullptr;
  if (lock_fd_ >= 0) ::close(lock_fd_);
  lock_fd_ = -1;
}

void Db::open(const OpenOptions& o) {
  const std::string& path = path_;
  // An existing file of 0 bytes is not a new store: it lost its content (or is
  // a placeholder). Starting afresh over it would hide that.
  std::error_code ec;
  SPARROW_CHECK_T(ConfigError, !std::filesystem::exists(path, ec) || std::filesystem::file_size(path, ec) != 0 || ec,
                  what_ << " '" << path
                        << "' exists but is empty (0 bytes): if it held state, restore it from a backup; to start "
                           "afresh, remove the file");
  const int rc = sqlite3_open_v2(path.c_str(), &db_, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE, nullptr);
  if (rc != SQLITE_OK) fail("open", rc);
  if (o.exclusive) {
    // One writer process per file, held until close. flock() locks are apart
    // from the fcntl() locks SQLite uses, so `sqlite3 FILE ".backup ..."` still
    // reads the file while it is held.
    lock_fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    SPARROW_CHECK_T(Error, lock_fd_ >= 0, what_ << " '" << path << "': cannot open it to lock it");
    SPARROW_CHECK_T(ConfigError, ::flock(lock_fd_, LOCK_EX | LOCK_NB) == 0,
                    what_ << " '" << path << "' is in use by another process (locked)");
  }
  sqlite3_extended_result_codes(db_, 1);
  sqlite3_busy_timeout(db_, o.exclusive ? 0 : 5000);
  {
    Stmt v(*this, "PRAGMA user_version");  // reads the header: a file that is not SQLite fails here
    v.step();
    found_version_ = static_cast<int>(v.i64(0));
  }
  SPARROW_CHECK_T(FormatError, found_version_ <= o.schema_version,
                  what_ << " '" << path << "': schema version " << found_version_ << " is newer than this build ("
                        << o.schema_version << "); use a newer sparrow");
  {
    Stmt q(*this, "PRAGMA quick_check");
    const std::string result = q.step() ? q.blob(0) : std::string("no result");
    SPARROW_CHECK_T(
        FormatError, result == "ok",
        what_ << " '" << path << "' is damaged (SQLite quick_check: " << result << "); restore it from a backup");
  }
  if (!o.tables.empty()) {
    std::string names;
    for (const auto& t : o.tables) names += (names.empty() ? "'" : ", '") + t + "'";
    Stmt t(*this,
           "SELECT (SELECT COUNT(*) FROM sqlite_master WHERE type = 'table'), (SELECT COUNT(*) FROM "
           "sqlite_master WHERE type = 'table' AND name IN (" +
               names + "))");
    t.step();
    SPARROW_CHECK_T(ConfigError, t.i64(0) == 0 || t.i64(1) > 0,
                    what_ << " '" << path << "' is an SQLite database of something else (" << t.i64(0)
                          << " tables, none of this store's): use another path");
  }
  exec("PRAGMA journal_mode=WAL");
  exec(o.fsync ? "PRAGMA synchronous=FULL" : "PRAGMA synchronous=NORMAL");
}

Db::~Db() { close(); }

void Db::fail(const std::string& what, int rc) const {
  const std::string detail = db_ ? sqlite3_errmsg(db_) : sqlite3_errstr(rc);
  if ((rc & 0xff) == SQLITE_NOTADB || (rc & 0xff) == SQLITE_CORRUPT)
    throw FormatError(what_ + " '" + path_ + "': " + what + ": " + detail);
  if ((rc & 0xff) == SQLITE_BUSY || (rc & 0xff) == SQLITE_LOCKED)
    throw ConfigError(what_ + " '" + path_ + "' is in use by another process (" + what + ": " + detail + ")");
  if ((rc & 0xff) == SQLITE_FULL)
    throw Error(what_ + " '" + path_ + "': " + what + ": the disk is full (nothing was written)");
  throw Error(what_ + " '" + path_ + "': " + what + ": " + detail + " (sqlite code " + std::to_string(rc) + ")");
}

void Db::exec(const std::string& sql) {
  char* err = nullptr;
  const int rc = sqlite3_exec(db_, sql.c_str(), nullptr, nullptr, &err);
  if (err) sqlite3_free(err);
  if (rc != SQLITE_OK) fail("'" + sql + "'", rc);
}

Stmt::Stmt(Db& db, const std::string& sql) : db_(db) {
  const int rc = sqlite3_prepare_v2(db.handle(), sql.c_str(), -1, &st_, nullptr);
  if (rc != SQLITE_OK) db.fail("prepare '" + sql + "'", rc);
}
Stmt::~Stmt() { sqlite3_finalize(st_); }

Stmt& Stmt::bind(int i, int64_t v) {
  sqlite3_bind_int64(st_, i, v);
  return *this;
}
Stmt& Stmt::bind_text(int i, const std::string& v) {
  sqlite3_bind_text(st_, i, v.data(), static_cast<int>(v.size()), SQLITE_TRANSIENT);
  return *this;
}
Stmt& Stmt::bind_blob(int i, const std::string& v) {
  if (v.empty())
    sqlite3_bind_zeroblob(st_, i, 0);
  else
    sqlite3_bind_blob64(st_, i, v.data(), v.size(), SQLITE_STATIC);
  return *this;
}
bool Stmt::step() {
  const int rc = sqlite3_step(st_);
  if (rc == SQLITE_ROW) return true;
  if (rc == SQLITE_DONE) return false;
  db_.fail("step", rc);
}
void Stmt::reset() {
  sqlite3_reset(st_);
  sqlite3_clear_bindings(st_);
}
int64_t Stmt::i64(int c) const { return sqlite3_column_int64(st_, c); }
bool Stmt::is_null(int c) const { return sqlite3_column_type(st_, c) == SQLITE_NULL; }
std::string Stmt::blob(int c) const {
  const void* p = sqlite3_column_blob(st_, c);
  const int n = sqlite3_column_bytes(st_, c);
  return p ? std::string(static_cast<const char*>(p), static_cast<size_t>(n)) : std::string();
}

Transaction::Transaction(Db& db) : db_(db) { db_.exec("BEGIN IMMEDIATE"); }
Transaction::~Transaction() {
  if (!done_) sqlite3_exec(db_.handle(), "ROLLBACK", nullptr, nullptr, nullptr);
}
void Transaction::commit() {
  db_.exec("COMMIT");
  done_ = true;
}

int64_t checksum(const std::vector<const std::string*>& pieces, int64_t seed) {
  uLong crc = crc32_z(0L, Z_NULL, 0);
  auto add = [&crc](const void* p, size_t n) { crc = crc32_z(crc, static_cast<const Bytef*>(p), n); };
  add(&seed, sizeof seed);
  for (const std::string* s : pieces) {
    const uint64_t n = s->size();
    add(&n, sizeof n);
    add(s->data(), s->size());
  }
  return static_cast<int64_t>(crc);
}

}  // namespace sparrow::sqlite
