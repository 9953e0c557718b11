#pragma once
// The split cloud's state on disk (docs/split.md, "What survives a restart"):
// one SQLite file holding a snapshot (the top's weights and optimiser state,
// every session with its codec state, the SplitFed round) and a write-ahead log
// of the messages that changed the state since. The cloud commits a message's
// log entry before it applies the message and before it answers, so every step
// a device has seen acknowledged is on disk; a restarted cloud loads the
// snapshot and applies the log again, in order, with the same code.
//
// Why a log rather than a snapshot per step: the top can be large (the CNN cut
// after conv2 leaves fc1, 1.6M parameters: 12.8 MB of weights and momentum per
// snapshot) while a step's input is one activation (25 KB for the MLP cut after
// fc1; a low-rank one a few KB). The snapshot is written every
// checkpoint_every entries and at a clean stop, which also empties the log.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace sparrow::edge {

struct CloudSessionRow {
  std::string client_id, key;
  uint64_t last_step = 0;
  std::string last_reply;  // serialized SplitGradient of last_step ("" = none): a device's retry gets it
  std::string codec;       // serialize_codec_state bytes ("" = none)
};

struct CloudSnapshot {
  int64_t seq = 0;         // the last log entry it includes
  std::string top;         // compression::serialize_weights: "w/NAME" weights, "m/NAME" momentum
  uint64_t fed_round = 0;  // last completed SplitFed round
  std::string fed_task;    // its serialized Task ("" = none)
  std::vector<CloudSessionRow> sessions;
};

enum class LogKind : int { kHello = 1, kStep = 2, kUpdate = 3 };

struct LogEntry {
  int64_t seq = 0;
  LogKind kind = LogKind::kStep;
  std::string client_id, key;
  uint64_t number = 0;  // hello: the device's last step; step: the step; update: the round
  std::string body;     // the message's frame bytes (step, update); "" for hello
};

class CloudStore {
 public:
  // Opens or creates the file (the checks of core/sqlite_db.h; the file stays
  // locked while this object lives). `label` names the model and cut and
  // `digest` the bottom: a store of another model is refused (ConfigError).
  // fsync: every log entry survives power loss (synchronous=FULL), otherwise a
  // process crash (NORMAL, the default: one fsync per step costs more than the step).
  CloudStore(const std::string& path, const std::string& label, uint64_t digest, bool fsync);
  ~CloudStore();
  CloudStore(const CloudStore&) = delete;
  CloudStore& operator=(const CloudStore&) = delete;

  const std::string& path() const;
  // The run id of this store (made on first use).
  std::string run_id(const std::string& fresh);
  // The training settings the log's entries were applied with ("" when none
  // recorded); set_replay_config records the current ones.
  std::string replay_config();
  void set_replay_config(const std::string& config);

  // The snapshot, checksum verified (FormatError naming the file when it fails).
  std::optional<CloudSnapshot> snapshot();
  // What a restart applies after the snapshot, in order: every entry after its
  // seq, and the SplitFed updates of the round that was open when it was
  // taken. Each entry's checksum is verified (FormatError).
  std::vector<LogEntry> replay_log(const CloudSnapshot& s);
  // Commits one entry (its own transaction) and returns its seq.
  int64_t append(LogEntry e);
  // Removes an entry whose message was refused after it was logged.
  void drop(int64_t seq);
  // One transaction: replaces the snapshot and the sessions, removes the log up
  // to s.seq except the updates of the open round (number > s.fed_round).
  void write_snapshot(const CloudSnapshot& s);
  int64_t last_seq() const;
  int64_t entries_since_snapshot() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace sparrow::edge
