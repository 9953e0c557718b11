#pragma once
// ClientStateStore: per-client state for up to ~10^5 clients in one SQLite file,
// with an LRU cache bounded by bytes in front of it. Clients are rows, loaded
// when a client is scheduled (get) and written back after (put).
//
// Write-back: put() only updates the cache and marks the entry dirty. Dirty
// entries are handed off for writing, all of them together, when
// Options::write_batch of them are pending, when a dirty entry is about to be
// evicted, on flush()/flush_async() and in the destructor. One hand-off is one
// SQLite transaction. Until it commits a crash loses them. See docs/state.md
// for the schema and the durability story.
//
// Options::background: the hand-off goes to a writer thread (serialise, write,
// commit) and put()/flush_async() return at once, so training overlaps the
// database work; the same thread loads prefetch()ed clients. Handed-off states
// stay readable (get() after put() always sees the put value) until they are
// in the database. Handed-off but unwritten bytes are bounded by cache_bytes:
// a hand-off waits for the writer beyond that. A failed background write keeps
// its states (still readable, retried later) and is thrown, once, by the next
// put()/flush()/flush_async(); flush() after that retries it.
//
// Options::explicit_flush (checkpoint mode): dirty entries reach the database
// only through flush()/flush_async(), never by write_batch or eviction (dirty
// entries are not evicted, so the cache may exceed cache_bytes by them), and
// the destructor drops the ones not handed off. The database then only ever
// holds what a flush wrote: with set_meta() (written in the same transaction)
// a caller can keep a checkpoint consistent with its client states.
//
// Values, not references: get() returns a deep copy and put() stores a deep
// copy, so callers may mutate what they hold (compressors update residuals in
// place) without silently changing the cached entry.
//
// Thread-safety: every public method takes one internal mutex, so a store may be
// shared between threads (calls serialise). Use one store per database file per
// process: two stores on the same file each cache on their own and do not see
// each other's unflushed writes.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "state/client_state.h"

namespace sparrow::state {

class ClientStateStore {
 public:
  struct Options {
    size_t cache_bytes = size_t{256} << 20;  // LRU limit on ClientState::approx_bytes(); 0 = no caching
    size_t write_batch = 64;                 // dirty entries that trigger a write-back transaction; >= 1
    bool background = false;                 // write back and prefetch on a background thread
    bool explicit_flush = false;             // dirty entries reach the database only via flush()/flush_async()
    // How rows are written (state/encoding.h). kBf16: put() rounds the state
    // it keeps to what a row holds (ClientState::round_to), so get() answers
    // the same from the cache and from the file, and a resumed run continues
    // as if it had not stopped. Rows of either encoding are read; only new
    // writes follow this.
    Encoding encoding = Encoding::kFp32;
  };
  struct Stats {
    uint64_t hits = 0;          // get() answered from memory (cache or not yet written hand-off)
    uint64_t misses = 0;        // get() that went to the database (found or not)
    uint64_t writes = 0;        // rows written to the database
    uint64_t transactions = 0;  // write-back transactions committed
    uint64_t evictions = 0;     // entries dropped from the cache
    uint64_t prefetched = 0;    // clients loaded into the cache by prefetch()
    uint64_t taken = 0;         // take() answers handed over without a copy
  };

  // Creates or opens the database at `path` (WAL journal, synchronous=NORMAL)
  // through core/sqlite_db.h, migrating an older schema. Throws ConfigError for
  // bad options, a folder, a 0-byte file, an existing file that is not a state
  // store (another program's tables, or none) or one held past the busy
  // timeout; FormatError when the file is not an SQLite database, its -wal file
  // is damaged, it fails quick_check, or it has a newer schema than this build
  // (nothing is written to a refused file); Error for other SQLite failures (a
  // full disk, permissions). A new file whose open fails is removed again.
  static std::unique_ptr<ClientStateStore> open(const std::string& path, Options options);
  static std::unique_ptr<ClientStateStore> open(const std::string& path) { return open(path, Options{}); }

  // Writes back what is handed off and (unless explicit_flush) every dirty
  // entry; failures are logged to stderr, never thrown.
  ~ClientStateStore();
  ClientStateStore(const ClientStateStore&) = delete;
  ClientStateStore& operator=(const ClientStateStore&) = delete;

  // The client's state, or nullopt when it has none. A row that does not
  // decode throws FormatError naming the client; the store stays usable.
  std::optional<ClientState> get(int64_t client);
  // The same for a caller that gives the state back with put() (the
  // simulator's worker): a cached state nothing else in the store refers to
  // (not in an unwritten hand-off, not marked, not dirty) leaves the cache and
  // is handed over without a copy; any other is copied as get() copies it. A
  // state read from the database is handed over without being cached (the
  // put() that follows caches it). The values returned equal get()'s.
  std::optional<ClientState> take(int64_t client);
  // Replaces the client's state (in the cache; see write-back above). Throws
  // sparrow::Error, changing nothing, for a state serialize() would refuse
  // (with Options::encoding bf16: a residual or control bf16 cannot hold).
  void put(int64_t client, const ClientState& state);
  // The same, taking the caller's state without a copy where it can
  // (ClientState::into_owned): the caller must not keep tensors of it.
  void put(int64_t client, ClientState&& state);
  // Writes every dirty entry (and the staged meta values) in one transaction
  // and waits for everything handed off before; on return they are in the WAL
  // (durable against a process crash; against power loss after the next
  // checkpoint, see docs/state.md).
  void flush();
  // The same hand-off as flush() without waiting for it (background mode;
  // without a background thread it is flush()).
  void flush_async();
  // Waits until everything handed off so far is in the database (hands off
  // nothing itself); throws a background write failure like flush().
  void wait_written();
  // Checkpoint mode (background + explicit_flush) only: mark() remembers the
  // states put since the last flush; rollback_to_mark() forgets every put()
  // after the mark, written to the open transaction or not, as if it had not
  // happened (the simulator's stop in the middle of a round). A flush between
  // the two, or a rollback without a mark, is an Error.
  void mark();
  void rollback_to_mark();
  // Background mode: loads these clients into the cache ahead of get(), in
  // order, as far as the cache has room: a prefetched state is not evicted
  // until a get() or take() has asked for it, and prefetching pauses while
  // such states fill half the cache (take() makes room again). A hint: errors
  // are ignored (get() reports them).
  void prefetch(const std::vector<int64_t>& clients);

  // A small named value committed in the same transaction as the next
  // flush()/flush_async() (or write-back) hand-off.
  void set_meta(const std::string& key, const std::string& value);
  // The value last set for `key` (committed or not), or nullopt.
  std::optional<std::string> get_meta(const std::string& key);

  size_t cached_bytes() const;
  size_t cached_entries() const;
  size_t dirty_bytes() const;  // approx_bytes() of the dirty (not yet handed off) entries
  Stats stats() const;
  const std::string& path() const;

 private:
  struct Impl;
  explicit ClientStateStore(std::unique_ptr<Impl> impl);
  void put_owned(int64_t client, std::shared_ptr<const ClientState> state);
  std::unique_ptr<Impl> impl_;
};

}  // namespace sparrow::state
