#pragma once
// ClientStateStore: per-client state for up to ~10^5 clients in one SQLite file,
// with an LRU cache bounded by bytes in front of it. Clients are rows, loaded
// when a client is scheduled (get) and written back after (put).
//
// Write-back: put() only updates the cache and marks the entry dirty. Dirty
// entries reach the database, all of them in one transaction, when
// Options::write_batch of them are pending, when a dirty entry is about to be
// evicted, on flush() and in the destructor. Until then a crash loses them.
// See docs/state.md for the schema and the durability story.
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

#include "state/client_state.h"

namespace sparrow::state {

class ClientStateStore {
 public:
  struct Options {
    size_t cache_bytes = size_t{256} << 20;  // LRU limit on ClientState::approx_bytes(); 0 = no caching
    size_t write_batch = 64;                 // dirty entries that trigger a write-back transaction; >= 1
  };
  struct Stats {
    uint64_t hits = 0;          // get() answered from the cache
    uint64_t misses = 0;        // get() that went to the database (found or not)
    uint64_t writes = 0;        // rows written to the database
    uint64_t transactions = 0;  // write-back transactions committed
    uint64_t evictions = 0;     // entries dropped from the cache
  };

  // Creates or opens the database at `path` (WAL journal, synchronous=NORMAL).
  // Throws ConfigError for bad options, FormatError when the file is not an
  // SQLite database or has a newer schema than this build, Error for other
  // SQLite failures (permissions, locked).
  static std::unique_ptr<ClientStateStore> open(const std::string& path, Options options);
  static std::unique_ptr<ClientStateStore> open(const std::string& path) { return open(path, Options{}); }

  // Flushes dirty entries; failures are logged to stderr, never thrown.
  ~ClientStateStore();
  ClientStateStore(const ClientStateStore&) = delete;
  ClientStateStore& operator=(const ClientStateStore&) = delete;

  // The client's state, or nullopt when it has none. A row that does not
  // decode throws FormatError naming the client; the store stays usable.
  std::optional<ClientState> get(int64_t client);
  // Replaces the client's state (in the cache; see write-back above). Throws
  // sparrow::Error, changing nothing, for a state serialize() would refuse.
  void put(int64_t client, const ClientState& state);
  // Writes every dirty entry in one transaction; on return they are in the
  // WAL (durable against a process crash; against power loss after the next
  // checkpoint, see docs/state.md).
  void flush();

  size_t cached_bytes() const;
  size_t cached_entries() const;
  Stats stats() const;
  const std::string& path() const;

 private:
  struct Impl;
  explicit ClientStateStore(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace sparrow::state
