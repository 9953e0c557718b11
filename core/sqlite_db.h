#pragma once
// A small SQLite layer for Sparrow's stores (library sparrow_sqlite): opening a
// file with the checks every store needs (docs/server.md, "What is checked at
// start-up"), prepared statements, and the CRC-32 the stores put next to their
// blobs. The server and client stores predate it and have their own copies.

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
  // and what to do): an existing file of 0 bytes, a file that is not SQLite, a
  // newer schema, a failed quick_check, an SQLite database of something else,
  // and (exclusive) a file another Db holds. Then WAL journal mode.
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

// CRC-32 (zlib) over the pieces, each preceded by its length, so that a flipped
// bit or a moved boundary between two pieces changes it.
int64_t checksum(const std::vector<const std::string*>& pieces, int64_t seed = 0);

}  // namespace sparrow::sqlite
