#include "state/store.h"

#include <sqlite3.h>

#include <algorithm>
#include <ctime>
#include <iostream>
#include <list>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "core/error.h"

namespace sparrow::state {
namespace {

// PRAGMA user_version of a database this build writes. Bump it (and migrate in
// open()) when the table changes; an older build then refuses the file.
constexpr int kSchemaVersion = 1;

[[noreturn]] void throw_sqlite(sqlite3* db, const std::string& path, const std::string& what, int rc) {
  const std::string msg = "client state store '" + path + "': " + what + ": " +
                          (db ? sqlite3_errmsg(db) : sqlite3_errstr(rc)) + " (sqlite code " + std::to_string(rc) + ")";
  if ((rc & 0xff) == SQLITE_NOTADB) {
    throw FormatError("client state store '" + path + "': not an SQLite database (" +
                      (db ? sqlite3_errmsg(db) : sqlite3_errstr(rc)) + ")");
  }
  if ((rc & 0xff) == SQLITE_CORRUPT) throw FormatError(msg);
  throw Error(msg);
}

// A prepared statement, reset after each use so it can be reused.
class Statement {
 public:
  Statement() = default;
  Statement(sqlite3* db, const std::string& path, const char* sql) : db_(db), path_(path) {
    const int rc = sqlite3_prepare_v3(db, sql, -1, SQLITE_PREPARE_PERSISTENT, &stmt_, nullptr);
    if (rc != SQLITE_OK) throw_sqlite(db, path, std::string("prepare '") + sql + "'", rc);
  }
  ~Statement() { sqlite3_finalize(stmt_); }
  Statement(const Statement&) = delete;
  Statement& operator=(Statement&& o) noexcept {
    std::swap(stmt_, o.stmt_);
    std::swap(db_, o.db_);
    std::swap(path_, o.path_);
    return *this;
  }
  sqlite3_stmt* get() const { return stmt_; }
  // Steps once; returns true for a row, false when done. Throws on error.
  bool step(const char* what) {
    const int rc = sqlite3_step(stmt_);
    if (rc == SQLITE_ROW) return true;
    if (rc == SQLITE_DONE) return false;
    sqlite3_reset(stmt_);
    throw_sqlite(db_, path_, what, rc);
  }
  void reset() {
    sqlite3_reset(stmt_);
    sqlite3_clear_bindings(stmt_);
  }

 private:
  sqlite3_stmt* stmt_ = nullptr;
  sqlite3* db_ = nullptr;
  std::string path_;
};

// Resets a statement on scope exit (also when an exception leaves the scope).
struct ResetGuard {
  Statement& s;
  ~ResetGuard() { s.reset(); }
};

}  // namespace

struct ClientStateStore::Impl {
  struct Entry {
    int64_t client;
    ClientState state;
    size_t bytes;
    bool dirty;
  };

  std::string path;
  Options options;
  sqlite3* db = nullptr;
  // Declared after db so they are finalized before ~Impl closes it.
  Statement select, upsert, begin, commit, rollback;

  mutable std::mutex mu;
  std::list<Entry> lru;  // front = most recently used
  std::unordered_map<int64_t, std::list<Entry>::iterator> index;
  std::unordered_set<int64_t> dirty;
  size_t bytes = 0;
  Stats stats;

  ~Impl() {
    select = Statement();
    upsert = Statement();
    begin = Statement();
    commit = Statement();
    rollback = Statement();
    if (db) sqlite3_close_v2(db);
  }

  void exec(const char* sql) {
    char* err = nullptr;
    const int rc = sqlite3_exec(db, sql, nullptr, nullptr, &err);
    if (err) sqlite3_free(err);
    if (rc != SQLITE_OK) throw_sqlite(db, path, std::string("'") + sql + "'", rc);
  }

  int user_version() {
    Statement s(db, path, "PRAGMA user_version");
    SPARROW_CHECK(s.step("read user_version"), "client state store '" << path << "': no user_version");
    return sqlite3_column_int(s.get(), 0);
  }

  void open_db() {
    int rc =
        sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX, nullptr);
    if (rc != SQLITE_OK) throw_sqlite(db, path, "open", rc);
    sqlite3_extended_result_codes(db, 1);
    sqlite3_busy_timeout(db, 5000);
    // The first statement reads the header: a file that is not SQLite fails here.
    const int version = user_version();
    SPARROW_CHECK_T(FormatError, version <= kSchemaVersion,
                    "client state store '" << path << "': schema version " << version
                                           << " is newer than this build supports (" << kSchemaVersion
                                           << "); use a newer sparrow");
    // Client states are blobs of hundreds of KB to MB (DGC keeps u and v per
    // parameter): 64 KiB pages cut the overflow-page chains of each blob 16x.
    // Only takes effect on a new database (before WAL is switched on).
    if (version == 0) exec("PRAGMA page_size=65536");
    exec("PRAGMA journal_mode=WAL");
    exec("PRAGMA synchronous=NORMAL");
    if (version < kSchemaVersion) {
      exec("BEGIN IMMEDIATE");
      try {
        exec(
            "CREATE TABLE IF NOT EXISTS client_state("
            "client_id INTEGER PRIMARY KEY, blob BLOB NOT NULL, updated INTEGER)");
        exec("PRAGMA user_version=1");
        exec("COMMIT");
      } catch (...) {
        sqlite3_exec(db, "ROLLBACK", nullptr, nullptr, nullptr);
        throw;
      }
    }
    select = Statement(db, path, "SELECT blob FROM client_state WHERE client_id = ?1");
    upsert = Statement(db, path, "INSERT OR REPLACE INTO client_state(client_id, blob, updated) VALUES(?1, ?2, ?3)");
    begin = Statement(db, path, "BEGIN IMMEDIATE");
    commit = Statement(db, path, "COMMIT");
    rollback = Statement(db, path, "ROLLBACK");
  }

  // Writes every dirty entry in one transaction. On failure rolls back, keeps
  // them dirty and throws.
  void write_dirty() {
    if (dirty.empty()) return;
    std::vector<int64_t> ids(dirty.begin(), dirty.end());
    std::sort(ids.begin(), ids.end());  // B-tree friendly order
    const int64_t now = static_cast<int64_t>(std::time(nullptr));
    {
      ResetGuard g{begin};
      begin.step("begin write-back");
    }
    try {
      for (int64_t id : ids) {
        const std::string blob = index.at(id)->state.serialize();
        ResetGuard g{upsert};
        sqlite3_bind_int64(upsert.get(), 1, id);
        sqlite3_bind_blob64(upsert.get(), 2, blob.data(), blob.size(), SQLITE_STATIC);
        sqlite3_bind_int64(upsert.get(), 3, now);
        upsert.step("write client state");
      }
      ResetGuard g{commit};
      commit.step("commit write-back");
    } catch (...) {
      if (sqlite3_get_autocommit(db) == 0) {
        ResetGuard g{rollback};
        sqlite3_step(rollback.get());
      }
      throw;
    }
    for (int64_t id : ids) index.at(id)->dirty = false;
    dirty.clear();
    stats.writes += ids.size();
    stats.transactions += 1;
  }

  void touch(std::list<Entry>::iterator it) { lru.splice(lru.begin(), lru, it); }

  // Drops least recently used entries until the cache fits; a dirty victim
  // first triggers a write-back of all dirty entries (one transaction).
  void evict() {
    while (bytes > options.cache_bytes && !lru.empty()) {
      auto victim = std::prev(lru.end());
      if (victim->dirty) write_dirty();
      bytes -= victim->bytes;
      index.erase(victim->client);
      lru.erase(victim);
      stats.evictions += 1;
    }
  }

  void insert(int64_t client, ClientState state, bool is_dirty) {
    const size_t n = state.approx_bytes();
    auto found = index.find(client);
    if (found != index.end()) {
      bytes -= found->second->bytes;
      found->second->state = std::move(state);
      found->second->bytes = n;
      found->second->dirty = found->second->dirty || is_dirty;
      touch(found->second);
    } else {
      lru.push_front(Entry{client, std::move(state), n, is_dirty});
      index.emplace(client, lru.begin());
    }
    bytes += n;
    if (is_dirty) dirty.insert(client);
  }
};

ClientStateStore::ClientStateStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

std::unique_ptr<ClientStateStore> ClientStateStore::open(const std::string& path, Options options) {
  SPARROW_CHECK_T(ConfigError, !path.empty(), "client state store: empty database path");
  SPARROW_CHECK_T(ConfigError, options.write_batch >= 1, "client state store: write_batch must be >= 1");
  auto impl = std::make_unique<Impl>();
  impl->path = path;
  impl->options = options;
  impl->open_db();
  return std::unique_ptr<ClientStateStore>(new ClientStateStore(std::move(impl)));
}

ClientStateStore::~ClientStateStore() {
  try {
    flush();
  } catch (const std::exception& e) {
    std::cerr << "sparrow: client state store '" << impl_->path << "': write-back on close failed, "
              << impl_->dirty.size() << " client state(s) lost: " << e.what() << "\n";
  } catch (...) {
    std::cerr << "sparrow: client state store '" << impl_->path << "': write-back on close failed\n";
  }
}

std::optional<ClientState> ClientStateStore::get(int64_t client) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl& m = *impl_;
  auto found = m.index.find(client);
  if (found != m.index.end()) {
    m.stats.hits += 1;
    m.touch(found->second);
    return found->second->state.deep_copy();
  }
  m.stats.misses += 1;
  std::string blob;
  {
    ResetGuard g{m.select};
    sqlite3_bind_int64(m.select.get(), 1, client);
    if (!m.select.step("read client state")) return std::nullopt;
    const void* p = sqlite3_column_blob(m.select.get(), 0);
    const int n = sqlite3_column_bytes(m.select.get(), 0);
    blob.assign(static_cast<const char*>(p), static_cast<size_t>(n));
  }
  ClientState state;
  try {
    state = ClientState::deserialize(blob);
  } catch (const FormatError& e) {
    throw FormatError("client state store '" + m.path + "': client " + std::to_string(client) + ": " + e.what());
  }
  if (state.approx_bytes() > m.options.cache_bytes) return state;  // would be evicted at once
  ClientState copy = state.deep_copy();
  m.insert(client, std::move(state), /*is_dirty=*/false);
  m.evict();
  return copy;
}

void ClientStateStore::put(int64_t client, const ClientState& state) {
  ClientState copy = state.deep_copy();  // validates before anything changes
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl& m = *impl_;
  m.insert(client, std::move(copy), /*is_dirty=*/true);
  if (m.dirty.size() >= m.options.write_batch) m.write_dirty();
  m.evict();
}

void ClientStateStore::flush() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->write_dirty();
}

size_t ClientStateStore::cached_bytes() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->bytes;
}

size_t ClientStateStore::cached_entries() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->lru.size();
}

ClientStateStore::Stats ClientStateStore::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->stats;
}

const std::string& ClientStateStore::path() const { return impl_->path; }

}  // namespace sparrow::state
