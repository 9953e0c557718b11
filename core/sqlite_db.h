#pragma once
// Sparrow's one SQLite layer (library sparrow_sqlite): every store opens its
// file through Db, which makes the checks each store needs before anything is
// read or written (docs/server.md, "What is checked at start"), maps SQLite
// errors to Sparrow's (naming the store and the file), and holds the store's
// schema migration in one transaction with user_version. Also prepared
// statements, transactions, and the CRC-32s the stores put next to their blobs.
// Used by the server's store (server/store.h), the client-state store
// (state/store.h) and the split cloud's store (edge/cloud_store.h).

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

struct sqlite3;
struct sqlite3_stmt;

namespace sparrow::sqlite {

class Db;

struct OpenOptions {
  std::string what{};                 // in messages: "split cloud state", "server database", ...
  std::vector<std::string> tables{};  // this store's tables: a database holding only others is refused
  int schema_version = 1;             // a newer file is refused; `migrate` brings an older one to it
  bool fsync = true;                  // synchronous=FULL (survives power loss) or NORMAL (survives a process crash)
  bool exclusive = false;             // one process at a time: a second one is refused (flock, held until close)
  // The program whose files these are, in messages ("sparrow-server"): "in use
  // by another sparrow-server", "is not a sparrow-server database". Empty:
  // "another process", "is not a <what>".
  std::string owner{};
  // An existing file that is an SQLite database without tables is refused
  // (ConfigError) rather than taken as a new store: someone else made it.
  bool existing_needs_tables = false;
  int page_size = 0;  // a new file's page size, set before WAL; 0 = SQLite's default
  // The caller never uses this Db (or its statements) from two threads at
  // once: SQLite's own mutexes are skipped (SQLITE_OPEN_NOMUTEX).
  bool one_thread_at_a_time = false;
  // Read-only (status tools): the file must exist; no quick_check (a writer
  // checked it, and a read must stay quick), no pragmas, no migration; the
  // -wal check only while no exclusive Db holds the file (a running writer
  // checked it at its start and may be rewriting the log while it is read).
  bool read_only = false;
  // Creates or upgrades the schema of a file whose user_version is below
  // schema_version (0: a new file): called inside one transaction that also
  // writes user_version = schema_version, so a crash leaves the old version
  // or the new one, never a mix. Unset: the caller manages user_version.
  std::function<void(Db& db, int from_version)> migrate{};
};

class Db {
 public:
  // Opens or creates `path`. Refused (ConfigError/FormatError, naming the file
  // and what to do; nothing is written to a refused file): what
  // check_before_open() refuses (a folder, 0 bytes, not SQLite, a damaged
  // -wal file), a newer schema, a failed quick_check, an SQLite database of
  // something else (and, with existing_needs_tables, one without tables), and
  // (exclusive) a file another Db holds. Then WAL journal mode, synchronous,
  // and `migrate`. A new file whose open fails (a full disk while `migrate`
  // writes) is removed again. Busy timeout 5 s: readers (status,
  // `sqlite3 .backup`) make a writer wait briefly, never fail.
  Db(const std::string& path, const OpenOptions& options);
  ~Db();
  Db(const Db&) = delete;
  Db& operator=(const Db&) = delete;

  // Another connection to this file for another thread (same synchronous and
  // thread settings), without the checks: this Db made them. Not exclusive-
  // locked itself: the first Db's lock covers the process.
  std::unique_ptr<Db> another_connection() const;

  const std::string& path() const { return path_; }
  sqlite3* handle() { return db_; }
  int schema_version_found() const { return found_version_; }  // 0 for a new file
  void exec(const std::string& sql);
  bool has_column(const std::string& table, const std::string& column);
  // Transactions that span calls (Transaction below is the scoped form).
  void begin();              // BEGIN IMMEDIATE: takes the write lock now
  void commit();             // throws, leaving the transaction open, when COMMIT fails
  void rollback() noexcept;  // when a transaction is open; errors are ignored
  bool in_transaction() const;
  // Throws for `rc`, naming the store: FormatError for a damaged file,
  // ConfigError for a file another process holds, Error otherwise (SQLITE_FULL:
  // "the disk is full", with what to do).
  [[noreturn]] void fail(const std::string& what, int rc) const;
  const std::string& what() const { return options_.what; }

 private:
  struct Again {};
  Db(const Db& first, Again);
  void open();
  void set_pragmas();
  void close();
  std::string path_;
  OpenOptions options_;
  sqlite3* db_ = nullptr;
  int lock_fd_ = -1;
  int found_version_ = 0;
  bool created_ = false;  // the file did not exist: this open made it
};

// A prepared statement. bind_* return *this; step() is true while rows come.
// A failed step() resets the statement (its read or write lock is released)
// before it throws.
class Stmt {
 public:
  // `reused`: kept and stepped many times (SQLITE_PREPARE_PERSISTENT).
  Stmt(Db& db, const std::string& sql, bool reused = false);
  ~Stmt();
  Stmt(const Stmt&) = delete;
  Stmt& operator=(const Stmt&) = delete;

  Stmt& bind(int i, int64_t v);
  Stmt& bind_real(int i, double v);  // NaN is stored as NULL
  Stmt& bind_text(int i, const std::string& v);
  Stmt& bind_blob(int i, const std::string& v);  // the bytes must outlive step(); empty is a 0-byte blob
  // `doing` names the step in an error ("write client state"); null: "step".
  bool step(const char* doing = nullptr);
  void reset();  // for another step() with new bindings
  int64_t i64(int c) const;
  double real(int c) const;  // NULL reads as NaN
  bool is_null(int c) const;
  std::string blob(int c) const;  // also text columns

 private:
  Db& db_;
  sqlite3_stmt* st_ = nullptr;
};

// Resets a (reused) statement when the scope ends, an exception included.
class ResetOnExit {
 public:
  explicit ResetOnExit(Stmt& s) : s_(s) {}
  ~ResetOnExit() { s_.reset(); }
  ResetOnExit(const ResetOnExit&) = delete;
  ResetOnExit& operator=(const ResetOnExit&) = delete;

 private:
  Stmt& s_;
};

// One transaction: BEGIN IMMEDIATE now, ROLLBACK in the destructor unless
// commit() succeeded (so an exception anywhere, a failed COMMIT included,
// leaves nothing of it in the file).
class Transaction {
 public:
  explicit Transaction(Db& db);
  ~Transaction();
  Transaction(const Transaction&) = delete;
  Transaction& operator=(const Transaction&) = delete;
  void commit();

 private:
  Db& db_;
  bool done_ = false;
};

// What an SQLite write-ahead log (the `-wal` file next to a database) holds,
// read byte by byte without SQLite (https://www.sqlite.org/fileformat2.html#walformat).
// SQLite replays the frames that carry the header's salts and chain the
// cumulative checksum from the header, up to the last commit frame before the
// first one that does not: a damaged frame silently drops every later commit.
struct WalScan {
  bool present = false;           // the file exists and is not empty
  int64_t page_size = 0;          // from the header (0 when the header is bad)
  int64_t frames = 0;             // whole frames in the file
  int64_t commits = 0;            // commits SQLite replays
  int64_t intact_bytes = 32;      // the header and the frames SQLite replays
  int64_t first_bad_frame = 0;    // 1-based: the first frame SQLite does not replay; 0 when none
  int64_t commits_after_bad = 0;  // later commit frames with the header's salts, intact on their own
  bool header_damaged = false;    // the header fails its checksum (or magic) while frames follow it
  // Committed transactions SQLite would drop without a word.
  bool damaged() const { return header_damaged || commits_after_bad > 0; }
};
// Scans `wal_path` (not the database). Error when the file cannot be read.
WalScan scan_wal(const std::string& wal_path);

// Checks made before SQLite opens `path` (so before anything can be read or
// written through it), each naming `what` and the file: ConfigError when
// `path` is a folder, its folder is missing, or it exists with 0 bytes, or
// its `-wal` file exists without it; FormatError when it exists and is not an
// SQLite database (its first 16 bytes; SQLite would otherwise take a file
// shorter than its header as a new database and write over it), or when its
// `-wal` file is damaged (scan_wal) with what to do. Db's constructor calls it.
void check_before_open(const std::string& path, const std::string& what);

// CRC-32 (zlib) over the seed's 8 bytes, then the pieces, each preceded by
// its length (8 bytes), so that a flipped bit or a moved boundary between two
// pieces changes it. Stored in files: never change how it is computed.
int64_t checksum(const std::vector<const std::string*>& pieces, int64_t seed = 0);

// Plain CRC-32 (zlib) of the bytes: the client-state store's row checksum.
// Stored in files: never change how it is computed.
int64_t crc32_of(const void* data, size_t n);
inline int64_t crc32_of(const std::string& bytes) { return crc32_of(bytes.data(), bytes.size()); }

}  // namespace sparrow::sqlite
