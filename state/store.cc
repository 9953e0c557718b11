#include "state/store.h"

#include <algorithm>
#include <condition_variable>
#include <ctime>
#include <deque>
#include <exception>
#include <iostream>
#include <list>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/sqlite_db.h"

namespace sparrow::state {
namespace {

// PRAGMA user_version of a database this build writes. Bump it (and migrate
// below) when the table changes; an older build then refuses the file.
// 2: table meta(key, value) for set_meta(). 3: a CRC-32 column in both
// (NULL for rows written before it, which are read unverified).
constexpr int kSchemaVersion = 3;

// Creates the tables of a new file; version 1 gains `meta`, versions 1 and 2
// the crc columns. In the transaction that writes user_version.
void migrate(sqlite::Db& db, int /*from_version*/) {
  db.exec(
      "CREATE TABLE IF NOT EXISTS client_state("
      "client_id INTEGER PRIMARY KEY, blob BLOB NOT NULL, updated INTEGER, crc INTEGER)");
  db.exec("CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value BLOB NOT NULL, crc INTEGER)");
  for (const char* table : {"client_state", "meta"}) {
    if (!db.has_column(table, "crc")) db.exec(std::string("ALTER TABLE ") + table + " ADD COLUMN crc INTEGER");
  }
}

sqlite::OpenOptions open_options() {
  sqlite::OpenOptions o;
  o.what = "client state store";
  o.tables = {"client_state", "meta"};
  o.schema_version = kSchemaVersion;
  o.fsync = false;                 // NORMAL: a commit survives a process crash (docs/state.md, Durability)
  o.existing_needs_tables = true;  // an existing file is written to only when it is a state store
  // Client states are blobs of hundreds of KB to MB (DGC keeps u and v per
  // parameter): 64 KiB pages cut the overflow-page chains of each blob 16x.
  o.page_size = 65536;
  o.one_thread_at_a_time = true;  // each Conn is used by one thread at a time
  o.migrate = migrate;
  return o;
}

// One SQLite connection with its prepared statements. The caller threads use
// one (under the store's mutex), the background thread its own
// (Db::another_connection): neither is used by two threads at once.
struct Conn {
  std::unique_ptr<sqlite::Db> db;  // declared first: the statements go before it
  std::unique_ptr<sqlite::Stmt> select, upsert, meta_select, meta_upsert;

  void open(std::unique_ptr<sqlite::Db> d) {
    db = std::move(d);
    select = std::make_unique<sqlite::Stmt>(*db, "SELECT blob, crc FROM client_state WHERE client_id = ?1", true);
    upsert = std::make_unique<sqlite::Stmt>(
        *db, "INSERT OR REPLACE INTO client_state(client_id, blob, updated, crc) VALUES(?1, ?2, ?3, ?4)", true);
    meta_select = std::make_unique<sqlite::Stmt>(*db, "SELECT value, crc FROM meta WHERE key = ?1", true);
    meta_upsert =
        std::make_unique<sqlite::Stmt>(*db, "INSERT OR REPLACE INTO meta(key, value, crc) VALUES(?1, ?2, ?3)", true);
  }

  // The row's bytes, or nullopt.
  std::optional<std::string> read(int64_t client) {
    sqlite::ResetOnExit g(*select);
    select->bind(1, client);
    if (!select->step("read client state")) return std::nullopt;
    return checked_blob(*select, "the state of client " + std::to_string(client));
  }

  // Column 0's bytes of the current row, verified against column 1's CRC-32
  // (NULL: written before checksums). `what` names the value in the error.
  std::string checked_blob(const sqlite::Stmt& st, const std::string& what) {
    std::string out = st.blob(0);
    SPARROW_CHECK_T(FormatError, st.is_null(1) || st.i64(1) == sqlite::crc32_of(out),
                    "client state store '" << db->path() << "': " << what
                                           << " fails its checksum: the file is damaged; restore it from a backup");
    return out;
  }

  std::optional<std::string> read_meta(const std::string& key) {
    sqlite::ResetOnExit g(*meta_select);
    meta_select->bind_text(1, key);
    if (!meta_select->step("read meta")) return std::nullopt;
    return checked_blob(*meta_select, "'" + key + "'");
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

void begin_tx(Conn& c) { c.db->begin(); }

void write_row(Conn& c, int64_t id, const ClientState& state, Encoding encoding) {
  const std::string blob = state.serialize(encoding);
  sqlite::ResetOnExit g(*c.upsert);
  c.upsert->bind(1, id)
      .bind_blob(2, blob)
      .bind(3, static_cast<int64_t>(std::time(nullptr)))
      .bind(4, sqlite::crc32_of(blob));
  c.upsert->step("write client state");
}

void write_meta_and_commit(Conn& c, const std::map<std::string, std::string>& meta) {
  for (const auto& [key, value] : meta) {
    sqlite::ResetOnExit g(*c.meta_upsert);
    c.meta_upsert->bind_text(1, key).bind_blob(2, value).bind(3, sqlite::crc32_of(value));
    c.meta_upsert->step("write meta");
  }
  c.db->commit();
}

void rollback_if_open(Conn& c) { c.db->rollback(); }

// Writes a batch in one transaction; on failure rolls back and throws.
void write_batch(Conn& c, const Batch& b, Encoding encoding) {
  begin_tx(c);
  try {
    for (const auto& [id, state] : b.rows) write_row(c, id, *state, encoding);
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
    bool pinned = false;  // prefetched and not yet asked for: not evicted
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
  size_t pinned_bytes = 0;                         // of the pinned entries
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

  void unpin(Entry& e) {
    if (!e.pinned) return;
    e.pinned = false;
    pinned_bytes -= e.bytes;
    cv.notify_all();  // the prefetcher may go on
  }

  // Prefetching pauses while pinned states fill half the cache.
  bool prefetch_room() const { return pinned_bytes < options.cache_bytes / 2; }

  // Removes an entry from the cache (its state goes with the iterator's owner).
  void erase_entry(std::list<Entry>::iterator it) {
    unpin(*it);
    mark_clean(*it);
    bytes -= it->bytes;
    index.erase(it->client);
    lru.erase(it);
  }

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
      write_batch(fg, queue.front(), options.encoding);
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
      if (victim->pinned) {
        it = victim;
        continue;
      }
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
      unpin(e);
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
        return stop || (!prefetch_ids.empty() && prefetch_room()) || !graveyard.empty() ||
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
      if (!prefetch_ids.empty() && prefetch_room() && !stop) {
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
          Entry& e = *index.at(id);
          e.pinned = true;  // kept until asked for: later prefetches and puts must not evict it
          pinned_bytes += e.bytes;
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
          write_batch(bg, b, options.encoding);
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
        write_row(bg, id, *state, options.encoding);
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
  impl->fg.open(std::make_unique<sqlite::Db>(path, open_options()));
  if (options.background) {
    impl->bg.open(impl->fg.db->another_connection());
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
    m.unpin(*found->second);
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

std::optional<ClientState> ClientStateStore::take(int64_t client) {
  std::unique_lock<std::mutex> lock(impl_->mu);
  Impl& m = *impl_;
  auto found = m.index.find(client);
  if (found != m.index.end()) {
    m.stats.hits += 1;
    Impl::Entry& e = *found->second;
    m.unpin(e);
    // use_count 1: no hand-off, mark or writer holds this snapshot, so the
    // database (or nothing, for a state never written) has what the cache
    // held, and the tensors can change hands.
    if (!e.dirty && e.state.use_count() == 1) {
      Snapshot s = std::move(e.state);
      m.erase_entry(found->second);
      m.stats.taken += 1;
      return std::move(const_cast<ClientState&>(*s));
    }
    m.touch(found->second);
    return e.state->deep_copy();
  }
  if (Snapshot s = m.unwritten(client)) {
    m.stats.hits += 1;
    return s->deep_copy();
  }
  m.stats.misses += 1;
  std::optional<std::string> blob = m.fg.read(client);
  if (!blob) return std::nullopt;
  return decode(m.path, client, *blob);
}

void ClientStateStore::put(int64_t client, const ClientState& state) {
  ClientState copy = state.deep_copy();    // validates before anything changes
  copy.round_to(impl_->options.encoding);  // bf16: the values the row will hold; throws before any change
  put_owned(client, std::make_shared<const ClientState>(std::move(copy)));
}

void ClientStateStore::put(int64_t client, ClientState&& state) {
  ClientState owned = ClientState::into_owned(std::move(state));
  owned.round_to(impl_->options.encoding);
  put_owned(client, std::make_shared<const ClientState>(std::move(owned)));
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
    m.erase_entry(it->second);
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
    // A new hint replaces the old pins: states prefetched before and never
    // asked for (a round given up) must not hold the cache for ever.
    for (Impl::Entry& e : impl_->lru) impl_->unpin(e);
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
