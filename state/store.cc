#include "state/store.h"

#include <sqlite3.h>
#include <zlib.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <exception>
#include <filesystem>
#include <map>
#include <thread>
#include <ctime>
#include <iostream>
#include <list>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/sqlite_db.h"

namespace sparrow::state {
namespace {

// PRAGMA user_version of a database this build writes. Bump it (and migrate in
// open()) when the table changes; an older build then refuses the file.
// 2: table meta(key, value) for set_meta(). 3: a CRC-32 column in both
// (NULL for rows written before it, which are read unverified).
constexpr int kSchemaVersion = 3;

int64_t crc_of(const void* p, size_t n) {
  return static_cast<int64_t>(crc32_z(crc32_z(0L, Z_NULL, 0), static_cast<const Bytef*>(p), n));
}

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

// One SQLite connection with its prepared statements. The caller threads use
// one (under the store's mutex), the background thread its own: a connection
// opened NOMUTEX must not be used by two threads at once.
struct Conn {
  std::string path;
  sqlite3* db = nullptr;
  Statement select, upsert, meta_select, meta_upsert, begin, commit, rollback;

  ~Conn() {
    select = Statement();
    upsert = Statement();
    meta_select = Statement();
    meta_upsert = Statement();
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

  // Opens the file; `create` also checks, creates and migrates the schema.
  void open(const std::string& p, bool create) {
    path = p;
    // Before SQLite touches the file: a folder, 0 bytes (states lost), not
    // SQLite (SQLite would write over a short file), a damaged -wal file.
    const bool existed = create && std::filesystem::exists(path);
    if (create) sqlite::check_before_open(path, "client state store");
    int rc =
        sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX, nullptr);
    if (rc != SQLITE_OK) throw_sqlite(db, path, "open", rc);
    sqlite3_extended_result_codes(db, 1);
    sqlite3_busy_timeout(db, 5000);
    if (create) {
      // The first statement reads the header: a file that is not SQLite fails here.
      const int version = user_version();
      SPARROW_CHECK_T(FormatError, version <= kSchemaVersion,
                      "client state store '" << path << "': schema version " << version
                                             << " is newer than this build supports (" << kSchemaVersion
                                             << "); use a newer sparrow");
      // Client states are blobs of hundreds of KB to MB (DGC keeps u and v per
      // parameter): 64 KiB pages cut the overflow-page chains of each blob 16x.
      // Only takes effect on a new database (before WAL is switched on).
      {
        Statement q(db, path, "PRAGMA quick_check");
        const std::string result = q.step("quick_check")
                                       ? std::string(reinterpret_cast<const char*>(sqlite3_column_text(q.get(), 0)))
                                       : std::string("no result");
        SPARROW_CHECK_T(FormatError, result == "ok",
                        "client state store '" << path << "' is damaged (SQLite quick_check: " << result
                                               << "); restore it from a backup");
        Statement t(db, path,
                    "SELECT (SELECT COUNT(*) FROM sqlite_master WHERE type = 'table'), (SELECT COUNT(*) FROM "
                    "sqlite_master WHERE type = 'table' AND name IN ('client_state', 'meta'))");
        t.step("list tables");
        SPARROW_CHECK_T(
            ConfigError, sqlite3_column_int64(t.get(), 0) == 0 || sqlite3_column_int64(t.get(), 1) > 0,
            "client state store '" << path << "' is an SQLite database of something else: use another path");
        // An existing file is written to only when it is a state store.
        SPARROW_CHECK_T(ConfigError, !existed || version > 0 || sqlite3_column_int64(t.get(), 1) > 0,
                        "client state store '" << path
                                               << "' exists but is not a sparrow state store; nothing was written to "
                                                  "it: use another path, or remove the file to start afresh");
      }
      if (version == 0) exec("PRAGMA page_size=65536");
      exec("PRAGMA journal_mode=WAL");
      if (version < kSchemaVersion) {
        exec("BEGIN IMMEDIATE");
        try {
          exec(
              "CREATE TABLE IF NOT EXISTS client_state("
              "client_id INTEGER PRIMARY KEY, blob BLOB NOT NULL, updated INTEGER, crc INTEGER)");
          exec("CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value BLOB NOT NULL, crc INTEGER)");
          for (const char* table : {"client_state", "meta"}) {  // version 1 and 2 tables lack crc
            Statement cols(
                db, path,
                (std::string("SELECT COUNT(*) FROM pragma_table_info('") + table + "') WHERE name = 'crc'").c_str());
            cols.step("read columns");
            if (sqlite3_column_int64(cols.get(), 0) == 0)
              exec((std::string("ALTER TABLE ") + table + " ADD COLUMN crc INTEGER").c_str());
          }
          exec(("PRAGMA user_version=" + std::to_string(kSchemaVersion)).c_str());
          exec("COMMIT");
        } catch (...) {
          sqlite3_exec(db, "ROLLBACK", nullptr, nullptr, nullptr);
          throw;
        }
      }
    }
    exec("PRAGMA synchronous=NORMAL");
    select = Statement(db, path, "SELECT blob, crc FROM client_state WHERE client_id = ?1");
    upsert = Statement(db, path,
                       "INSERT OR REPLACE INTO client_state(client_id, blob, updated, crc) VALUES(?1, ?2, ?3, ?4)");
    meta_select = Statement(db, path, "SELECT value, crc FROM meta WHERE key = ?1");
    meta_upsert = Statement(db, path, "INSERT OR REPLACE INTO meta(key, value, crc) VALUES(?1, ?2, ?3)");
    begin = Statement(db, path, "BEGIN IMMEDIATE");
    commit = Statement(db, path, "COMMIT");
    rollback = Statement(db, path, "ROLLBACK");
  }

  // The row's bytes, or nullopt.
  std::optional<std::string> read(int64_t client) {
    ResetGuard g{select};
    sqlite3_bind_int64(select.get(), 1, client);
    if (!select.step("read client state")) return std::nullopt;
    return checked_blob(select, "the state of client " + std::to_string(client));
  }

  // Column 0's bytes of the current row, verified against column 1's CRC-32
  // (NULL: written before checksums). `what` names the value in the error.
  std::string checked_blob(Statement& st, const std::string& what) {
    const void* p = sqlite3_column_blob(st.get(), 0);
    const int n = sqlite3_column_bytes(st.get(), 0);
    std::string out(static_cast<const char*>(p), static_cast<size_t>(n));
    SPARROW_CHECK_T(FormatError,
                    sqlite3_column_type(st.get(), 1) == SQLITE_NULL ||
                        sqlite3_column_int64(st.get(), 1) == crc_of(out.data(), out.size()),
                    "client state store '" << path << "': " << what
                                           << " fails its checksum: the file is damaged; restore it from a backup");
    return out;
  }

  std::optional<std::string> read_meta(const std::string& key) {
    ResetGuard g{meta_select};
    sqlite3_bind_text(meta_select.get(), 1, key.data(), static_cast<int>(key.size()), SQLITE_STATIC);
    if (!meta_select.step("read meta")) return std::nullopt;
    return checked_blob(meta_select, "'" + key + "'");
  }
};

using Snapshot = std::shared_ptr<const ClientState>;

// One hand-off: written in one transaction.
struct Batch {
  std::map<int64_t, Snapshot> rows;  // sorted: B-tree friendly order
  std::map<std::string, std::string> meta;
  size_t bytes = 0;
  // Streaming (background + explicit_flush): the batch is open while put()
  // adds rows; the writer writes `todo` inside a transaction it began and
  // commits once the batch is closed by a flush. Otherwise closed at birth.
  bool closed = true;
  bool begun = false;
  bool restart = false;  // rolled back to a mark: the writer starts the transaction over
  std::deque<int64_t> todo;
};

void begin_tx(Conn& c) {
  ResetGuard g{c.begin};
  c.begin.step("begin write-back");
}

void write_row(Conn& c, int64_t id, const ClientState& state) {
  const std::string blob = state.serialize();
  ResetGuard g{c.upsert};
  sqlite3_bind_int64(c.upsert.get(), 1, id);
  sqlite3_bind_blob64(c.upsert.get(), 2, blob.data(), blob.size(), SQLITE_STATIC);
  sqlite3_bind_int64(c.upsert.get(), 3, static_cast<int64_t>(std::time(nullptr)));
  sqlite3_bind_int64(c.upsert.get(), 4, crc_of(blob.data(), blob.size()));
  c.upsert.step("write client state");
}

void write_meta_and_commit(Conn& c, const std::map<std::string, std::string>& meta) {
  for (const auto& [key, value] : meta) {
    ResetGuard g{c.meta_upsert};
    sqlite3_bind_text(c.meta_upsert.get(), 1, key.data(), static_cast<int>(key.size()), SQLITE_STATIC);
    sqlite3_bind_blob64(c.meta_upsert.get(), 2, value.data(), value.size(), SQLITE_STATIC);
    sqlite3_bind_int64(c.meta_upsert.get(), 3, crc_of(value.data(), value.size()));
    c.meta_upsert.step("write meta");
  }
  ResetGuard g{c.commit};
  c.commit.step("commit write-back");
}

void rollback_if_open(Conn& c) {
  if (sqlite3_get_autocommit(c.db) == 0) {
    ResetGuard g{c.rollback};
    sqlite3_step(c.rollback.get());
  }
}

// Writes a batch in one transaction; on failure rolls back and throws.
void write_batch(Conn& c, const Batch& b) {
  begin_tx(c);
  try {
    for (const auto& [id, state] : b.rows) write_row(c, id, *state);
    write_meta_and_commit(c, b.meta);
  } catch (...) {
    rollback_if_open(c);
    throw;
  }
}

ClientState decode(const std::string& path, int64_t client, const std::string& blob) {
  try {
    return ClientState::deserialize(blob);
  } catch (const FormatError& e) {
    throw FormatError("client state store '" + path + "': client " + std::to_string(client) + ": " + e.what());
  }
}

}  // namespace

struct ClientStateStore::Impl {
  struct Entry {
    int64_t client;
    Snapshot state;
    size_t bytes;
    bool dirty;
  };

  std::string path;
  Options options;
  Conn fg;  // caller threads, under mu
  Conn bg;  // the background thread only

  mutable std::mutex mu;
  std::condition_variable cv;  // any change to queue, writing, prefetch_ids, error, stop
  std::list<Entry> lru;        // front = most recently used
  std::unordered_map<int64_t, std::list<Entry>::iterator> index;
  std::unordered_set<int64_t> dirty;
  size_t bytes = 0, dirty_bytes = 0;
  std::map<std::string, std::string> staged_meta;  // set_meta() not yet handed off
  // Handed off, oldest first; the background thread writes the front. A batch
  // stays at the front while it is written (`writing`) and after a failure.
  std::deque<Batch> queue;
  size_t queued_bytes = 0;
  bool writing = false;
  std::exception_ptr error;  // a failed background write, not yet reported
  std::deque<int64_t> prefetch_ids;
  // mark(): the open batch's rows then (empty: none was open), and the number
  // of closed batches handed off so far (a flush in between voids the mark).
  std::optional<std::map<int64_t, Snapshot>> marked;
  uint64_t closes = 0, marked_closes = 0;
  std::vector<Snapshot> graveyard;  // evicted states for the background thread to free
  bool stop = false;
  Stats stats;
  std::thread thread;  // declared last: started after the rest exists

  // The newest handed-off value of `client`, or null.
  Snapshot unwritten(int64_t client) const {
    for (auto b = queue.rbegin(); b != queue.rend(); ++b) {
      auto it = b->rows.find(client);
      if (it != b->rows.end()) return it->second;
    }
    return nullptr;
  }

  void touch(std::list<Entry>::iterator it) { lru.splice(lru.begin(), lru, it); }

  void mark_clean(Entry& e) {
    if (!e.dirty) return;
    e.dirty = false;
    dirty.erase(e.client);
    dirty_bytes -= e.bytes;
  }

  // Moves every dirty entry and the staged meta into a new batch. Waits (in
  // background mode) while too much is handed off but unwritten.
  bool streaming() const { return options.background && options.explicit_flush; }
  bool front_open() const { return !queue.empty() && !queue.front().closed; }
  // Nothing handed off and closed is left to write (an open batch may be).
  bool closed_written() const { return queue.empty() || front_open(); }

  // Streaming: a batch still takes put()s (it is the last in the queue).
  bool has_open_batch() const { return !queue.empty() && !queue.back().closed; }
  // Streaming: the open batch (created when needed).
  Batch& open_batch() {
    if (!has_open_batch()) {
      queue.emplace_back();
      queue.back().closed = false;
    }
    return queue.back();
  }

  void hand_off(std::unique_lock<std::mutex>& lock) {
    if (streaming()) {
      if (staged_meta.empty() && (queue.empty() || queue.back().closed)) return;
      // At most one closed batch in flight: wait for the previous one.
      if (std::this_thread::get_id() != thread.get_id())
        cv.wait(lock, [&] { return closed_written() || error != nullptr; });
      Batch& b = open_batch();
      for (auto& [k, v] : staged_meta) b.meta[k] = std::move(v);
      staged_meta.clear();
      b.closed = true;
      ++closes;
      cv.notify_all();
      return;
    }
    if (dirty.empty() && staged_meta.empty()) return;
    // Never on the background thread itself (its prefetch may evict): it is
    // the one that drains the queue.
    if (options.background && std::this_thread::get_id() != thread.get_id()) {
      cv.wait(lock, [&] { return queued_bytes <= options.cache_bytes || queue.empty() || error != nullptr; });
    }
    Batch b;
    for (int64_t id : dirty) {
      Entry& e = *index.at(id);
      b.rows.emplace(id, e.state);
      b.bytes += e.bytes;
      e.dirty = false;
    }
    dirty.clear();
    dirty_bytes = 0;
    b.meta = std::move(staged_meta);
    staged_meta.clear();
    queued_bytes += b.bytes;
    queue.push_back(std::move(b));
    if (options.background)
      cv.notify_all();
    else
      drain_here();
  }

  // Without a background thread: writes the queue on the caller's thread; a
  // failure leaves the batch at the front (retried next time) and throws.
  void drain_here() {
    while (!queue.empty()) {
      write_batch(fg, queue.front());
      finish_front();
    }
  }

  void finish_front() {
    Batch& b = queue.front();
    stats.writes += b.rows.size();
    stats.transactions += 1;
    queued_bytes -= b.bytes;
    queue.pop_front();
  }

  void rethrow_error() {
    if (!error) return;
    std::exception_ptr e = error;
    error = nullptr;  // the writer retries the failed batch
    cv.notify_all();
    std::rethrow_exception(e);
  }

  // Drops least recently used clean entries until the cache fits. A dirty
  // victim first triggers a hand-off of all dirty entries, except with
  // explicit_flush, where dirty entries are skipped.
  void evict(std::unique_lock<std::mutex>& lock) {
    auto it = lru.end();
    while (bytes > options.cache_bytes && it != lru.begin()) {
      auto victim = std::prev(it);
      if (victim->dirty) {
        if (options.explicit_flush) {
          it = victim;
          continue;
        }
        hand_off(lock);
        it = lru.end();  // hand_off may have waited: start again from the tail
        continue;
      }
      bytes -= victim->bytes;
      // Background mode: the writer thread frees it (unmapping megabytes of
      // tensor memory costs the worker time otherwise).
      if (options.background) graveyard.push_back(std::move(victim->state));
      index.erase(victim->client);
      lru.erase(victim);
      stats.evictions += 1;
    }
    if (!graveyard.empty()) cv.notify_all();
  }

  void insert(int64_t client, Snapshot state, bool is_dirty) {
    const size_t n = state->approx_bytes();
    auto found = index.find(client);
    if (found != index.end()) {
      Entry& e = *found->second;
      const bool was_dirty = e.dirty;
      mark_clean(e);
      bytes -= e.bytes;
      e.state = std::move(state);
      e.bytes = n;
      e.dirty = was_dirty || is_dirty;
      touch(found->second);
    } else {
      lru.push_front(Entry{client, std::move(state), n, is_dirty});
      index.emplace(client, lru.begin());
    }
    bytes += n;
    if (index.at(client)->dirty) {
      dirty.insert(client);
      dirty_bytes += n;
    }
  }

  // The background thread: prefetches first (a worker waits for those), then
  // writes the oldest batch. Stops once asked to and nothing is left to write
  // (or the write failed: the destructor reports it).
  void run() {
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      cv.wait(lock, [&] {
        return stop || !prefetch_ids.empty() || !graveyard.empty() ||
               (!queue.empty() && !error &&
                (queue.front().closed || queue.front().restart || !queue.front().todo.empty()));
      });
      if (!graveyard.empty()) {
        std::vector<Snapshot> dead;
        dead.swap(graveyard);
        lock.unlock();
        dead.clear();  // outside the lock
        lock.lock();
        continue;
      }
      if (stop && front_open()) {
        // Checkpoint mode, closing: states never flushed are dropped.
        if (queue.front().begun) rollback_if_open(bg);
        queued_bytes -= queue.front().bytes;
        queue.pop_front();
        cv.notify_all();
        continue;
      }
      if (!prefetch_ids.empty() && !stop) {
        const int64_t id = prefetch_ids.front();
        prefetch_ids.pop_front();
        if (index.count(id) || unwritten(id) || options.cache_bytes == 0) continue;
        lock.unlock();
        // Only this thread writes, so the row cannot change under this read;
        // a put() meanwhile makes the entry present, and the result is dropped.
        std::optional<ClientState> s;
        try {
          if (auto blob = bg.read(id)) s = ClientState::deserialize(*blob);
        } catch (...) {
          s.reset();  // a hint only: get() reads and reports it
        }
        lock.lock();
        if (s && !index.count(id) && !unwritten(id) && s->approx_bytes() <= options.cache_bytes) {
          insert(id, std::make_shared<const ClientState>(std::move(*s)), /*is_dirty=*/false);
          stats.prefetched += 1;
          evict(lock);
        }
        continue;
      }
      if (streaming() && !queue.empty() && !error) {
        if (stream_step(lock)) continue;
      }
      if (!streaming() && !queue.empty() && !error) {
        writing = true;
        Batch& b = queue.front();  // stays in place: only this thread pops it
        lock.unlock();
        std::exception_ptr failed;
        try {
          write_batch(bg, b);
        } catch (...) {
          failed = std::current_exception();
        }
        lock.lock();
        writing = false;
        if (failed)
          error = failed;
        else
          finish_front();
        cv.notify_all();
        continue;
      }
      if (stop) return;
    }
  }

  // Streaming: one step on the front batch (begin, one row, or meta and
  // commit) with the lock released around the database work. False when
  // there is nothing to do now.
  bool stream_step(std::unique_lock<std::mutex>& lock) {
    Batch& b = queue.front();  // stays in place (deque): only this thread pops it
    if (b.restart) {           // rollback_to_mark(): everything written so far goes
      lock.unlock();
      rollback_if_open(bg);
      lock.lock();
      b.begun = false;
      b.restart = false;
      return true;
    }
    if (!b.closed && b.todo.empty()) return false;
    std::exception_ptr failed;
    if (!b.begun) {
      lock.unlock();
      try {
        begin_tx(bg);
      } catch (...) {
        failed = std::current_exception();
      }
      lock.lock();
      if (!failed) b.begun = true;
    } else if (!b.todo.empty()) {
      const int64_t id = b.todo.front();
      b.todo.pop_front();
      Snapshot state = b.rows.at(id);  // the newest put of this client
      lock.unlock();
      try {
        write_row(bg, id, *state);
      } catch (...) {
        failed = std::current_exception();
      }
      lock.lock();
    } else {
      // Closed: nobody changes it any more.
      lock.unlock();
      try {
        write_meta_and_commit(bg, b.meta);
      } catch (...) {
        failed = std::current_exception();
      }
      lock.lock();
      if (!failed) {
        finish_front();
        cv.notify_all();
        return true;
      }
    }
    if (failed) {
      // Start the batch over (all of it) once the error has been reported.
      rollback_if_open(bg);
      b.begun = false;
      b.todo.clear();
      for (const auto& [id, st] : b.rows) b.todo.push_back(id);
      error = failed;
      cv.notify_all();
    }
    return true;
  }

  // Waits until everything handed off is written; throws a write failure.
  void wait_written(std::unique_lock<std::mutex>& lock) {
    if (!options.background) {
      drain_here();
      return;
    }
    rethrow_error();
    cv.wait(lock, [&] { return closed_written() || error != nullptr; });
    rethrow_error();
  }
};

ClientStateStore::ClientStateStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

std::unique_ptr<ClientStateStore> ClientStateStore::open(const std::string& path, Options options) {
  SPARROW_CHECK_T(ConfigError, !path.empty(), "client state store: empty database path");
  SPARROW_CHECK_T(ConfigError, options.write_batch >= 1, "client state store: write_batch must be >= 1");
  auto impl = std::make_unique<Impl>();
  impl->path = path;
  impl->options = options;
  impl->fg.open(path, /*create=*/true);
  if (options.background) {
    impl->bg.open(path, /*create=*/false);
    Impl* m = impl.get();
    impl->thread = std::thread([m] { m->run(); });
  }
  return std::unique_ptr<ClientStateStore>(new ClientStateStore(std::move(impl)));
}

ClientStateStore::~ClientStateStore() {
  Impl& m = *impl_;
  size_t lost = 0;
  try {
    std::unique_lock<std::mutex> lock(m.mu);
    m.prefetch_ids.clear();
    if (!m.options.explicit_flush) m.hand_off(lock);
    m.wait_written(lock);
  } catch (const std::exception& e) {
    std::unique_lock<std::mutex> lock(m.mu);
    for (const auto& b : m.queue) lost += b.rows.size();
    std::cerr << "sparrow: client state store '" << m.path << "': write-back on close failed, " << lost
              << " client state(s) lost: " << e.what() << "\n";
  } catch (...) {
    std::cerr << "sparrow: client state store '" << m.path << "': write-back on close failed\n";
  }
  if (m.thread.joinable()) {
    {
      std::lock_guard<std::mutex> lock(m.mu);
      m.stop = true;
      // A failed batch must not be retried forever: give up on it.
      if (m.error) m.queue.clear();
    }
    m.cv.notify_all();
    m.thread.join();
  }
}

std::optional<ClientState> ClientStateStore::get(int64_t client) {
  std::unique_lock<std::mutex> lock(impl_->mu);
  Impl& m = *impl_;
  auto found = m.index.find(client);
  if (found != m.index.end()) {
    m.stats.hits += 1;
    m.touch(found->second);
    return found->second->state->deep_copy();
  }
  if (Snapshot s = m.unwritten(client)) {
    m.stats.hits += 1;
    return s->deep_copy();
  }
  m.stats.misses += 1;
  std::optional<std::string> blob = m.fg.read(client);
  if (!blob) return std::nullopt;
  ClientState state = decode(m.path, client, *blob);
  blob.reset();
  if (state.approx_bytes() > m.options.cache_bytes) return state;  // would be evicted at once
  ClientState copy = state.deep_copy();
  m.insert(client, std::make_shared<const ClientState>(std::move(state)), /*is_dirty=*/false);
  m.evict(lock);
  return copy;
}

void ClientStateStore::put(int64_t client, const ClientState& state) {
  put_owned(client, std::make_shared<const ClientState>(state.deep_copy()));  // validates before anything changes
}

void ClientStateStore::put(int64_t client, ClientState&& state) {
  put_owned(client, std::make_shared<const ClientState>(ClientState::into_owned(std::move(state))));
}

void ClientStateStore::put_owned(int64_t client, std::shared_ptr<const ClientState> copy) {
  std::unique_lock<std::mutex> lock(impl_->mu);
  Impl& m = *impl_;
  m.rethrow_error();
  if (m.streaming()) {
    // Straight to the writer (into the open transaction), clean in the cache.
    Batch& b = m.open_batch();
    const size_t n = copy->approx_bytes();
    auto [it, fresh] = b.rows.emplace(client, copy);
    if (!fresh) {
      b.bytes -= it->second->approx_bytes();
      m.queued_bytes -= it->second->approx_bytes();
      it->second = copy;
    }
    b.bytes += n;
    m.queued_bytes += n;
    b.todo.push_back(client);
    m.insert(client, std::move(copy), /*is_dirty=*/false);
    m.cv.notify_all();
    m.evict(lock);
    return;
  }
  m.insert(client, std::move(copy), /*is_dirty=*/true);
  if (!m.options.explicit_flush && m.dirty.size() >= m.options.write_batch) m.hand_off(lock);
  m.evict(lock);
}

void ClientStateStore::mark() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl& m = *impl_;
  SPARROW_CHECK(m.streaming(), "client state store: mark() needs background + explicit_flush");
  m.marked = m.has_open_batch() ? m.queue.back().rows : std::map<int64_t, Snapshot>{};
  m.marked_closes = m.closes;
}

void ClientStateStore::rollback_to_mark() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl& m = *impl_;
  SPARROW_CHECK(m.marked.has_value() && m.marked_closes == m.closes,
                "client state store: rollback_to_mark() without a mark since the last flush");
  std::map<int64_t, Snapshot> keep = std::move(*m.marked);
  m.marked.reset();
  m.prefetch_ids.clear();
  if (!m.has_open_batch()) return;  // nothing put since the mark
  Batch& b = m.queue.back();
  // The cache must not answer with a state the rollback forgets.
  for (const auto& [id, st] : b.rows) {
    auto k = keep.find(id);
    if (k != keep.end() && k->second == st) continue;
    auto it = m.index.find(id);
    if (it == m.index.end()) continue;
    m.mark_clean(*it->second);
    m.bytes -= it->second->bytes;
    m.lru.erase(it->second);
    m.index.erase(it);
  }
  m.queued_bytes -= b.bytes;
  b.rows = std::move(keep);
  b.bytes = 0;
  for (const auto& [id, st] : b.rows) b.bytes += st->approx_bytes();
  m.queued_bytes += b.bytes;
  b.todo.clear();
  for (const auto& [id, st] : b.rows) b.todo.push_back(id);
  if (b.begun) b.restart = true;  // only the front batch is ever begun
  m.cv.notify_all();
}

void ClientStateStore::flush() {
  std::unique_lock<std::mutex> lock(impl_->mu);
  impl_->rethrow_error();
  impl_->hand_off(lock);
  impl_->wait_written(lock);
}

void ClientStateStore::flush_async() {
  std::unique_lock<std::mutex> lock(impl_->mu);
  impl_->rethrow_error();
  impl_->hand_off(lock);
}

void ClientStateStore::wait_written() {
  std::unique_lock<std::mutex> lock(impl_->mu);
  impl_->wait_written(lock);
}

void ClientStateStore::prefetch(const std::vector<int64_t>& clients) {
  if (!impl_->options.background) return;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->prefetch_ids.insert(impl_->prefetch_ids.end(), clients.begin(), clients.end());
  }
  impl_->cv.notify_all();
}

void ClientStateStore::set_meta(const std::string& key, const std::string& value) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->staged_meta[key] = value;
}

std::optional<std::string> ClientStateStore::get_meta(const std::string& key) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl& m = *impl_;
  auto staged = m.staged_meta.find(key);
  if (staged != m.staged_meta.end()) return staged->second;
  for (auto b = m.queue.rbegin(); b != m.queue.rend(); ++b) {
    auto it = b->meta.find(key);
    if (it != b->meta.end()) return it->second;
  }
  return m.fg.read_meta(key);
}

size_t ClientStateStore::cached_bytes() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->bytes;
}

size_t ClientStateStore::cached_entries() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->lru.size();
}

size_t ClientStateStore::dirty_bytes() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  const Impl& m = *impl_;
  size_t open = 0;
  if (!m.queue.empty() && !m.queue.back().closed) open = m.queue.back().bytes;
  return m.dirty_bytes + open;
}

ClientStateStore::Stats ClientStateStore::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->stats;
}

const std::string& ClientStateStore::path() const { return impl_->path; }

}  // namespace sparrow::state
