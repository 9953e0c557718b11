#pragma once
// ServerStore: sparrow-server's SQLite database (one file, WAL journal).
//
// Tables (docs/server.md, "Persistence"):
//   runs(run_id, config_hash, config, created)           one row: the run this database belongs to
//   rounds(round, started, finished, selected, updates, rejected, stale, bytes_in, bytes_out,
//          train_loss, eval_loss, eval_accuracy)          one row per completed round
//   metrics(round, name, value)                           per-round named figures
//   clients(client_id, public_key, first_seen, last_seen, last_selected, selected, updates,
//           rejects, num_samples, software, bytes_up, bytes_down)   one row per client ever seen
//   checkpoints(round, weights, server_opt, control, broadcast, downlink_state, downlink_last,
//               acp, rng)                                 the newest keep_checkpoints rounds
//   async_updates(seq, step, client_id, body)             mode = "async": the acknowledged updates
//                                                         of the buffer not yet stepped (docs/async.md)
//
// commit_round() writes the round row, its metrics, the checkpoint and the
// changed client rows in ONE transaction: after a crash at any moment the
// database holds either all of round r or none of it, and the newest
// checkpoint is the state after the last completed round.
//
// Not thread-safe: one thread at a time (the server's round thread; in mode =
// "async" the worker that holds the async fold lock) uses a store.

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace sparrow::server {

struct RunRow {
  std::string run_id;
  std::string config_hash;
  std::string config;   // the identity text (config.h identity_text)
  int64_t created = 0;  // unix seconds
};

struct RoundRow {
  int64_t round = 0;
  double started = 0, finished = 0;  // unix seconds
  int64_t selected = 0, updates = 0, rejected = 0, stale = 0;
  uint64_t bytes_in = 0, bytes_out = 0;
  double train_loss = 0;                    // NaN = none (stored as NULL)
  double eval_loss = 0, eval_accuracy = 0;  // NaN = not evaluated
};

struct ClientRow {
  std::string client_id;
  std::string public_key;                 // Z85; empty on plain TCP
  int64_t first_seen = 0, last_seen = 0;  // unix seconds
  int64_t last_selected = 0;              // round; 0 = never
  int64_t selected = 0, updates = 0, rejects = 0;
  uint64_t num_samples = 0;
  std::string software;
  uint64_t bytes_up = 0;    // frames of its accepted updates
  uint64_t bytes_down = 0;  // frames of the tasks queued to it (sent unless its connection failed)
};

// One acknowledged update of an asynchronous step not yet taken: `body` is
// the wire ModelUpdate as folded (its round says the version it started from).
struct AsyncUpdateRow {
  int64_t seq = 0;   // the fold order
  int64_t step = 0;  // the step (round) whose buffer holds it
  std::string client_id;
  std::string body;
};

// Everything needed to continue after round `round` with identical results.
// Blobs are self-describing bytes (compression::State, ServerOptimizer state,
// serialized wire messages); empty = absent.
struct Checkpoint {
  int64_t round = 0;
  std::string weights;     // global model W_r (compression::State bytes)
  std::string server_opt;  // ServerOptimizer::serialize_state()
  std::string control;     // SCAFFOLD server control c (State bytes)
  std::string broadcast;   // downlink: broadcast model B_r (State bytes)
  std::string
      downlink_state;  // downlink: per-tensor compressor states (written before the shared round engine; now empty)
  std::string downlink_last;  // downlink: C_r, the last encoded delta (a wire ModelUpdate)
  std::string acp;            // ACP shared factors for round r + 1 (State bytes)
  std::string rng;            // RNG counters ("key=value;..." text)
  std::string aggregator;     // aggregation::Aggregator::serialize_state() (adaptive DP clip)
};

class ServerStore {
 public:
  // Opens or creates the database (core/sqlite_db.h), migrating an older
  // schema in one transaction, and holds it (flock) until closed. FormatError
  // when the file is not an SQLite database, its -wal file is damaged, it fails
  // SQLite's quick_check (a damaged page, index or b-tree) or has a newer
  // schema; ConfigError when it is a folder, exists with 0 bytes (a lost
  // database is not a new run), is another program's database or an SQLite
  // file without tables, or another sparrow-server holds it; nothing is
  // written to a refused file. Error for other SQLite failures (a full disk:
  // "the disk is full"). A new file whose open fails is removed again.
  static std::unique_ptr<ServerStore> open(const std::string& path);
  // Read-only open (status): the refusals above except quick_check (the -wal
  // check only when no server holds the file); ConfigError when missing or a
  // folder; FormatError without a runs table.
  static std::unique_ptr<ServerStore> open_readonly(const std::string& path);
  ~ServerStore();
  ServerStore(const ServerStore&) = delete;
  ServerStore& operator=(const ServerStore&) = delete;

  std::optional<RunRow> run();
  void create_run(const RunRow& run);

  // Round row + metrics + checkpoint + client rows, one transaction. Deletes
  // checkpoints older than the newest `keep` (>= 1). On failure (a full disk
  // included) rolls back and throws sparrow::Error: nothing of the round is in
  // the database, and the store stays usable.
  void commit_round(const RoundRow& round, const std::map<std::string, double>& metrics, const Checkpoint& ckpt,
                    const std::vector<ClientRow>& clients, int keep);
  // Mode "async": acknowledged updates (their `step`, `client_id`, `body`;
  // `seq` is assigned in this order), durable (one synced transaction) when
  // this returns; their Acks are sent after. commit_round of their step
  // deletes them in the transaction that writes the checkpoint holding them,
  // so a crash at any moment finds every acknowledged update either in the
  // newest checkpoint or here.
  void put_async_updates(const std::vector<const AsyncUpdateRow*>& rows);
  // The rows of put_async_updates in fold order (seq).
  std::vector<AsyncUpdateRow> async_updates();
  // Client rows outside a round (shutdown; new clients' key bindings).
  void put_clients(const std::vector<ClientRow>& clients);

  // The newest checkpoint whose CRC-32 matches its blobs (rows written before
  // checksums existed are taken as they are); nullopt when there is none.
  // Damaged newer ones are skipped and listed by damaged_checkpoints();
  // FormatError when checkpoints exist and none is intact.
  std::optional<Checkpoint> latest_checkpoint();
  std::vector<int64_t> damaged_checkpoints() const;  // rounds skipped by the last latest_checkpoint()
  int64_t completed_rounds();                        // newest round row, 0 when none
  std::vector<RoundRow> rounds();
  std::vector<ClientRow> clients();
  std::map<std::string, double> metrics(int64_t round);
  // One named metric over every round that has it: round -> value.
  std::map<int64_t, double> metric_series(const std::string& name);

  const std::string& path() const;

  struct Impl;

 private:
  void write_clients(const std::vector<ClientRow>& clients);  // inside a transaction
  explicit ServerStore(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace sparrow::server
