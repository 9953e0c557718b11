#pragma once
// A small SQLite layer for Sparrow's stores (library sparrow_sqlite): opening a
// file with the checks every store needs (docs/server.md, "What is checked at
// start-up"), prepared statements, and the CRC-32 the stores put next to their
// blobs. The server and client stores predate it and have their own copies of
// the rest, but run the same check_before_open() (a damaged -wal file, a file
// that is not SQLite) before SQLite opens their files.

#include <cstdint>
#include <string>
#include <vector>

struct sqlite3;
struct sqlite3_stmt;

namespace sparrow::sqlite {

struct OpenOptions {
  std::string what;                 // in messages: "split cloud state", ...
  std::vector<std::string> tables;  // this store's tables: a database holding only others is refused
  int schema_version = 1;           // user_version written; a newer file is refused
  bool fsync = true;                // synchronous=FULL (survives power loss) or NORMAL (survives a process crash)
  bool exclusive = false;           // one process at a time: a second one is refused (flock, held until close)
};

class Db {
 public:
  // Opens or creates `path`. Refused (ConfigError/FormatError, naming the file
  // and what to do): what check_before_open() refuses (a folder, 0 bytes, not
  // SQLite, a damaged -wal file), a newer schema, a failed quick_check, an
  // SQLite database of something else, and (exclusive) a file another Db
  // holds. Then WAL journal mode.
  Db(const std::string& path, const OpenOptions& options);
  ~Db();
  Db(const Db&) = delete;
  Db& operator=(const Db&) = delete;

  const std::string& path() const { return path_; }
  sqlite3* handle() { return db_; }
  int schema_version_found() const { return found_version_; }  // 0 for a new file
  void exec(const std::string& sql);
  // Throws for `rc`, naming the store: FormatError for a damaged file, Error otherwise.
  [[noreturn]] void fail(const std::string& what, int rc) const;
  const std::string& what() const { return what_; }

 private:
  void open(const OpenOptions& o);
  void close();
  std::string path_, what_;
  sqlite3* db_ = nullptr;
  int lock_fd_ = -1;
  int found_version_ = 0;
};

// A prepared statement. bind_* return *this; step() is true while rows come.
class Stmt {
 public:
  Stmt(Db& db, const std::string& sql);
  ~Stmt();
  Stmt(const Stmt&) = delete;
  Stmt& operator=(const Stmt&) = delete;

  Stmt& bind(int i, int64_t v);
  Stmt& bind_text(int i, const std::string& v);
  Stmt& bind_blob(int i, const std::string& v);  // the bytes must outlive step()
  bool step();
  void reset();  // for another step() with new bindings
  int64_t i64(int c) const;
  bool is_null(int c) const;
  std::string blob(int c) const;  // also text columns

 private:
  Db& db_;
  sqlite3_stmt* st_ = nullptr;
};

// One transaction: BEGIN IMMEDIATE now, ROLLBACK in the destructor unless commit().
class Transaction {
 public:
  explicit Transaction(Db& db);
  ~Transaction();
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

// CRC-32 (zlib) over the pieces, each preceded by its length, so that a flipped
// bit or a moved boundary between two pieces changes it.
int64_t checksum(const std::vector<const std::string*>& pieces, int64_t seed = 0);

}  // namespace sparrow::sqlite
