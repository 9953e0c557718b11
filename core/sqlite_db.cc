#include "core/sqlite_db.h"

#include <fcntl.h>
#include <sqlite3.h>
#include <sys/file.h>
#include <unistd.h>
#include <zlib.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>

#include "core/error.h"

namespace sparrow::sqlite {
namespace {

uint32_t be32(const unsigned char* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

// SQLite's WAL checksum: 32-bit words in the byte order the magic names,
// added in pairs; `s` carries the running sums from frame to frame.
void wal_checksum(bool big_endian, const unsigned char* p, size_t n, uint32_t s[2]) {
  for (size_t i = 0; i + 8 <= n; i += 8) {
    uint32_t x0 = be32(p + i), x1 = be32(p + i + 4);
    if (!big_endian) {
      x0 = __builtin_bswap32(x0);
      x1 = __builtin_bswap32(x1);
    }
    s[0] += x0 + s[1];
    s[1] += x1 + s[0];
  }
}

std::string quoted(const std::string& s) { return "'" + s + "'"; }

}  // namespace

WalScan scan_wal(const std::string& wal_path) {
  WalScan out;
  std::error_code ec;
  if (!std::filesystem::exists(wal_path, ec)) return out;
  std::ifstream in(wal_path, std::ios::binary);
  SPARROW_CHECK_T(Error, in, "cannot read " << quoted(wal_path));
  const auto size = static_cast<int64_t>(std::filesystem::file_size(wal_path, ec));
  SPARROW_CHECK_T(Error, !ec, "cannot read " << quoted(wal_path) << ": " << ec.message());
  out.present = size > 0;
  unsigned char h[32];
  // Shorter than a header: SQLite ignores it, and so nothing can be lost.
  if (size < 32 || !in.read(reinterpret_cast<char*>(h), sizeof h)) return out;
  const uint32_t magic = be32(h), page_size = be32(h + 8);
  const bool big_endian = (magic & 1) != 0;
  uint32_t sum[2] = {0, 0};
  wal_checksum(big_endian, h, 24, sum);
  const bool header_ok = (magic & ~1u) == 0x377f0682u && be32(h + 4) == 3007000u && page_size >= 512 &&
                         page_size <= 65536 && (page_size & (page_size - 1)) == 0 && sum[0] == be32(h + 24) &&
                         sum[1] == be32(h + 28);
  if (!header_ok) {
    // SQLite then ignores every frame. Only a damaged header makes a file
    // this long: SQLite writes the header with the first frame after it.
    out.header_damaged = size >= 32 + 24 + 512;
    return out;
  }
  out.page_size = page_size;
  const int64_t frame_bytes = 24 + static_cast<int64_t>(page_size);
  out.frames = (size - 32) / frame_bytes;
  const uint32_t salt1 = be32(h + 16), salt2 = be32(h + 20);
  std::vector<unsigned char> frame(static_cast<size_t>(frame_bytes));
  uint32_t stored_before[2] = {be32(h + 24), be32(h + 28)};  // the previous frame's stored sums
  bool in_prefix = true;
  for (int64_t i = 1; i <= out.frames; ++i) {
    if (!in.read(reinterpret_cast<char*>(frame.data()), frame_bytes)) break;
    const unsigned char* f = frame.data();
    const bool ours = be32(f + 8) == salt1 && be32(f + 12) == salt2 && be32(f) != 0;
    const bool commit = be32(f + 4) != 0;
    const uint32_t stored[2] = {be32(f + 16), be32(f + 20)};
    // This frame's checksum, chained from the stored sums of the one before:
    // equal to SQLite's cumulative check while every frame so far is intact,
    // and still a check of this frame alone after a damaged one.
    uint32_t s2[2] = {stored_before[0], stored_before[1]};
    wal_checksum(big_endian, f, 8, s2);
    wal_checksum(big_endian, f + 24, page_size, s2);
    const bool intact = ours && s2[0] == stored[0] && s2[1] == stored[1];
    if (in_prefix) {
      if (intact) {
        if (commit) {
          ++out.commits;
          out.intact_bytes = 32 + i * frame_bytes;
        }
      } else {
        // The end of what SQLite replays. Frames of other salts after it are
        // an older log this one wrote over (normal), never a later commit.
        in_prefix = false;
        out.first_bad_frame = i;
      }
    } else if (intact && commit) {
      // A commit of this log after the damaged frame: SQLite never reaches it.
      // (Frames an uncommitted transaction left behind carry no commit.)
      ++out.commits_after_bad;
    }
    stored_before[0] = stored[0];
    stored_before[1] = stored[1];
  }
  return out;
}

void check_before_open(const std::string& path, const std::string& what) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  SPARROW_CHECK_T(ConfigError, !fs::is_directory(st), what << " " << quoted(path) << " is a folder, not a file");
  const fs::path parent = fs::path(path).parent_path();
  if (!fs::exists(st)) {
    SPARROW_CHECK_T(ConfigError, parent.empty() || fs::is_directory(parent, ec),
                    what << " " << quoted(path) << ": the folder " << quoted(parent.string())
                         << (fs::exists(parent, ec) ? " is not a folder" : " does not exist"));
    // A -wal file without its database: SQLite would replay it into a new,
    // empty file (or a later run would pick up a stale log).
    const auto wal = fs::file_size(path + "-wal", ec);
    SPARROW_CHECK_T(ConfigError, ec || wal == 0,
                    what << " " << quoted(path) << " does not exist but its write-ahead log " << quoted(path + "-wal")
                         << " does: restore the database file next to it, or move the -wal file aside to start "
                            "afresh");
    return;
  }
  SPARROW_CHECK_T(ConfigError, fs::is_regular_file(st), what << " " << quoted(path) << " is not a regular file");
  const auto size = fs::file_size(path, ec);
  // An existing file of 0 bytes is not a new store: it lost its content (or is
  // a placeholder). Starting afresh over it would hide that.
  SPARROW_CHECK_T(ConfigError, ec || size != 0,
                  what << " " << quoted(path)
                       << " exists but is empty (0 bytes): if it held state, restore it from a backup; to start "
                          "afresh, remove the file");
  {
    // SQLite opens a file shorter than its 100-byte header as a new database
    // and writes over it: whatever it was would be lost.
    char magic[16] = {};
    std::ifstream in(path, std::ios::binary);
    SPARROW_CHECK_T(ConfigError, in, what << " " << quoted(path) << " cannot be read (permissions?)");
    in.read(magic, sizeof magic);
    SPARROW_CHECK_T(FormatError, in && std::memcmp(magic, "SQLite format 3", 16) == 0,
                    what << " " << quoted(path)
                         << " is not an SQLite database; nothing was written to it. Use another path, or restore "
                            "the file from a backup");
  }
  const std::string wal = path + "-wal";
  const WalScan w = scan_wal(wal);
  if (w.header_damaged)
    throw FormatError(what + " " + quoted(path) + ": its write-ahead log " + quoted(wal) +
                      " has a damaged header, so SQLite would silently drop every commit in it. Restore the "
                      "database and its -wal file from a backup, or move " +
                      quoted(wal) +
                      " aside to go back to the state before that log (losing what it holds); nothing was "
                      "written");
  if (w.commits_after_bad > 0)
    throw FormatError(what + " " + quoted(path) + ": its write-ahead log " + quoted(wal) + " is damaged: frame " +
                      std::to_string(w.first_bad_frame) + " of " + std::to_string(w.frames) +
                      " fails its checksum, so SQLite would silently drop the " + std::to_string(w.commits_after_bad) +
                      " committed transaction(s) after it. Restore the database and its -wal file from a backup, "
                      "or keep the " +
                      std::to_string(w.commits) +
                      " intact commit(s) before the damage and lose the later ones: copy the -wal file aside, then "
                      "truncate -s " +
                      std::to_string(w.intact_bytes) + " " + quoted(wal) + "; nothing was written");
}

namespace {
constexpr int kBusyTimeoutMs = 5000;
}  // namespace

Db::Db(const std::string& path, const OpenOptions& o) : path_(path), options_(o) {
  try {
    open();
  } catch (...) {
    close();
    // A file this open created and could not finish (a full disk while the
    // schema was written, a quick_check of nothing...) is removed: left
    // behind, the next start would refuse it as an empty or foreign file.
    if (created_) {
      for (const char* suffix : {"", "-wal", "-shm", "-journal"}) ::unlink((path_ + suffix).c_str());
    }
    throw;
  }
}

Db::Db(const Db& first, Again) : path_(first.path_), options_(first.options_) {
  options_.exclusive = false;  // the first connection holds the lock
  options_.migrate = nullptr;
  found_version_ = first.found_version_;
  try {
    const int flags = (options_.read_only ? SQLITE_OPEN_READONLY : SQLITE_OPEN_READWRITE) |
                      (options_.one_thread_at_a_time ? SQLITE_OPEN_NOMUTEX : 0);
    const int rc = sqlite3_open_v2(path_.c_str(), &db_, flags, nullptr);
    if (rc != SQLITE_OK) fail("open", rc);
    set_pragmas();
  } catch (...) {
    close();
    throw;
  }
}

std::unique_ptr<Db> Db::another_connection() const { return std::unique_ptr<Db>(new Db(*this, Again{})); }

void Db::close() {
  if (db_) sqlite3_close_v2(db_);
  db_ = nullptr;
  if (lock_fd_ >= 0) ::close(lock_fd_);
  lock_fd_ = -1;
}

// Error codes in full, the busy timeout, and (read-write) synchronous.
void Db::set_pragmas() {
  sqlite3_extended_result_codes(db_, 1);
  sqlite3_busy_timeout(db_, kBusyTimeoutMs);
  if (!options_.read_only) exec(options_.fsync ? "PRAGMA synchronous=FULL" : "PRAGMA synchronous=NORMAL");
}

void Db::open() {
  namespace fs = std::filesystem;
  const OpenOptions& o = options_;
  const std::string& path = path_;
  const std::string& what = o.what;
  const std::string holder = o.owner.empty() ? std::string("process") : o.owner;
  std::error_code ec;
  const bool existed = fs::exists(path, ec);
  if (o.read_only) {
    SPARROW_CHECK_T(ConfigError, !fs::is_directory(path, ec),
                    what << " " << quoted(path) << " is a folder, not a file");
    SPARROW_CHECK_T(ConfigError, existed, what << " " << quoted(path) << " does not exist");
    // The -wal check only when no exclusive Db holds the file: a running
    // writer checked it at its start and may be rewriting the log now.
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    const bool idle = fd >= 0 && ::flock(fd, LOCK_SH | LOCK_NB) == 0;
    if (fd >= 0) ::close(fd);
    if (idle) check_before_open(path, what);
  } else {
    check_before_open(path, what);
    if (!existed) {
      // Created here (O_EXCL: known to be this open's own file), so that a
      // failed open can remove it. SQLite's permissions.
      const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
      SPARROW_CHECK_T(ConfigError, fd >= 0 || errno == EEXIST,
                      what << " " << quoted(path) << " cannot be created: " << std::strerror(errno));
      if (fd >= 0) {
        ::close(fd);
        created_ = true;
      }
    }
  }
  const int flags = (o.read_only ? SQLITE_OPEN_READONLY : SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE) |
                    (o.one_thread_at_a_time ? SQLITE_OPEN_NOMUTEX : 0);
  const int rc = sqlite3_open_v2(path.c_str(), &db_, flags, nullptr);
  if (rc != SQLITE_OK) fail("open", rc);
  if (o.exclusive && !o.read_only) {
    // One writer process per file, held until close. flock() locks are apart
    // from the fcntl() locks SQLite uses, so `sqlite3 FILE ".backup ..."` and
    // read-only opens still read the file while it is held.
    lock_fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    SPARROW_CHECK_T(Error, lock_fd_ >= 0, what << " " << quoted(path) << ": cannot open it to lock it");
    SPARROW_CHECK_T(ConfigError, ::flock(lock_fd_, LOCK_EX | LOCK_NB) == 0,
                    what << " " << quoted(path) << " is in use by another " << holder << " (locked); stop that "
                         << holder << " or use another path");
  }
  sqlite3_extended_result_codes(db_, 1);
  sqlite3_busy_timeout(db_, kBusyTimeoutMs);
  {
    Stmt v(*this, "PRAGMA user_version");  // reads the header: a file that is not SQLite fails here
    v.step();
    found_version_ = static_cast<int>(v.i64(0));
  }
  SPARROW_CHECK_T(FormatError, found_version_ <= o.schema_version,
                  what << " " << quoted(path) << ": schema version " << found_version_ << " is newer than this build ("
                       << o.schema_version << "); use a newer sparrow");
  if (!o.read_only) {
    // The whole file's structure (pages, b-trees, indexes), before anything
    // is read from it or written to it.
    Stmt q(*this, "PRAGMA quick_check");
    const std::string result = q.step() ? q.blob(0) : std::string("no result");
    SPARROW_CHECK_T(
        FormatError, result == "ok",
        what << " " << quoted(path) << " is damaged (SQLite quick_check: " << result << "); restore it from a backup");
  }
  int64_t tables = 0;
  {
    std::string names = "''";
    for (const auto& t : o.tables) names += ", " + quoted(t);
    Stmt t(*this,
           "SELECT (SELECT COUNT(*) FROM sqlite_master WHERE type = 'table'), (SELECT COUNT(*) FROM "
           "sqlite_master WHERE type = 'table' AND name IN (" +
               names + "))");
    t.step();
    tables = t.i64(0);
    const std::string kind = o.owner.empty() ? "a " + what : "a " + o.owner + " database";
    if (!o.tables.empty())
      SPARROW_CHECK_T(ConfigError, tables == 0 || t.i64(1) > 0,
                      what << " " << quoted(path) << " is an SQLite database of something else (" << tables
                           << " tables, none of " << kind << "): nothing was written to it; use another path");
    // An existing file is written to only when it is this store's: an
    // SQLite file without tables is someone's too (or a store that lost them).
    SPARROW_CHECK_T(ConfigError, !(o.existing_needs_tables || o.read_only) || !existed || tables > 0,
                    what << " " << quoted(path) << " exists but is not " << kind << " (no tables)"
                         << (o.read_only ? "; check the path"
                                         : "; nothing was written to it: use another path, or remove the file to "
                                           "start afresh"));
  }
  if (o.read_only) return;
  // Only a new database takes a page size (and only before WAL is switched on).
  if (o.page_size > 0 && tables == 0 && found_version_ == 0) exec("PRAGMA page_size=" + std::to_string(o.page_size));
  exec("PRAGMA journal_mode=WAL");
  exec(o.fsync ? "PRAGMA synchronous=FULL" : "PRAGMA synchronous=NORMAL");
  if (o.migrate && found_version_ < o.schema_version) {
    Transaction t(*this);
    o.migrate(*this, found_version_);
    exec("PRAGMA user_version=" + std::to_string(o.schema_version));
    t.commit();
  }
}

Db::~Db() { close(); }

void Db::fail(const std::string& doing, int rc) const {
  const std::string& what = options_.what;
  const std::string detail = db_ ? sqlite3_errmsg(db_) : sqlite3_errstr(rc);
  const std::string file = what + " " + quoted(path_);
  switch (rc & 0xff) {
    case SQLITE_NOTADB:
    case SQLITE_CORRUPT:
      throw FormatError(file + ": " + doing + ": " + detail + "; the file is damaged: restore it from a backup");
    case SQLITE_BUSY:
    case SQLITE_LOCKED:
      throw ConfigError(file + " is in use by another " + (options_.owner.empty() ? "process" : options_.owner) + " (" +
                        doing + ": " + detail + "); stop it or use another path");
    case SQLITE_FULL:
      throw Error(file + ": " + doing +
                  ": the disk is full; nothing of this transaction was written. Free some space (or move the file "
                  "to a larger disk) and try again");
    case SQLITE_READONLY:
      throw Error(file + ": " + doing + ": " + detail + " (is the file or its folder read-only?)");
    default:
      throw Error(file + ": " + doing + ": " + detail + " (sqlite code " + std::to_string(rc) + ")");
  }
}

void Db::exec(const std::string& sql) {
  char* err = nullptr;
  const int rc = sqlite3_exec(db_, sql.c_str(), nullptr, nullptr, &err);
  if (err) sqlite3_free(err);
  if (rc != SQLITE_OK) fail(quoted(sql), rc);
}

bool Db::has_column(const std::string& table, const std::string& column) {
  Stmt s(*this, "SELECT COUNT(*) FROM pragma_table_info(?) WHERE name = ?");
  s.bind_text(1, table).bind_text(2, column);
  s.step();
  return s.i64(0) > 0;
}

void Db::begin() { exec("BEGIN IMMEDIATE"); }
void Db::commit() { exec("COMMIT"); }
void Db::rollback() noexcept {
  if (in_transaction()) sqlite3_exec(db_, "ROLLBACK", nullptr, nullptr, nullptr);
}
bool Db::in_transaction() const { return db_ && sqlite3_get_autocommit(db_) == 0; }

Stmt::Stmt(Db& db, const std::string& sql, bool reused) : db_(db) {
  const int rc =
      sqlite3_prepare_v3(db.handle(), sql.c_str(), -1, reused ? SQLITE_PREPARE_PERSISTENT : 0, &st_, nullptr);
  if (rc != SQLITE_OK) db.fail("prepare " + quoted(sql), rc);
}
Stmt::~Stmt() { sqlite3_finalize(st_); }

Stmt& Stmt::bind(int i, int64_t v) {
  sqlite3_bind_int64(st_, i, v);
  return *this;
}
Stmt& Stmt::bind_real(int i, double v) {
  if (std::isnan(v))
    sqlite3_bind_null(st_, i);
  else
    sqlite3_bind_double(st_, i, v);
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
bool Stmt::step(const char* doing) {
  const int rc = sqlite3_step(st_);
  if (rc == SQLITE_ROW) return true;
  if (rc == SQLITE_DONE) return false;
  try {
    db_.fail(doing ? doing : "step", rc);  // reads the message before reset() could change it
  } catch (...) {
    sqlite3_reset(st_);
    throw;
  }
}
void Stmt::reset() {
  sqlite3_reset(st_);
  sqlite3_clear_bindings(st_);
}
int64_t Stmt::i64(int c) const { return sqlite3_column_int64(st_, c); }
double Stmt::real(int c) const {
  return sqlite3_column_type(st_, c) == SQLITE_NULL ? std::numeric_limits<double>::quiet_NaN()
                                                    : sqlite3_column_double(st_, c);
}
bool Stmt::is_null(int c) const { return sqlite3_column_type(st_, c) == SQLITE_NULL; }
std::string Stmt::blob(int c) const {
  const void* p = sqlite3_column_blob(st_, c);
  const int n = sqlite3_column_bytes(st_, c);
  return p ? std::string(static_cast<const char*>(p), static_cast<size_t>(n)) : std::string();
}

Transaction::Transaction(Db& db) : db_(db) { db_.begin(); }
Transaction::~Transaction() {
  if (!done_) db_.rollback();
}
void Transaction::commit() {
  db_.commit();
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

int64_t crc32_of(const void* data, size_t n) {
  return static_cast<int64_t>(crc32_z(crc32_z(0L, Z_NULL, 0), static_cast<const Bytef*>(data), n));
}

}  // namespace sparrow::sqlite
