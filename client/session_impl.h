#pragma once
// Private to sparrow_session: ClientSession::Impl, the state of one deployed
// client, and the helpers its parts share. Its methods are defined by job:
//   session.cc             the public ClientSession, construction (config,
//                          model replica, data and holdout, keys), the loop
//                          and the dispatch of the server's messages
//   session_connection.cc  the connection (transport/client_link.h: handshake
//                          failures, when to give up, backoff), sends, Hello
//   session_state.cc       the state database: the held model B_h, its run,
//                          the persisted client state
//   session_task.cc        a Task: the broadcast model, its settings, training,
//                          the update (federation/client_pipeline.h), sent
//   session_secagg.cc      a SecAgg+ round: keys, shares, the masked update,
//                          the reveal
//   session_config.cc      SessionConfig: the keys, their checks, the loader
// Threads: everything here runs on the thread that called run() (or the
// constructor); only `n` and self.stop_/held_round_ are read from others.

#include <ATen/core/Tensor.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "aggregation/robust.h"
#include "client/session.h"
#include "client/trainer.h"
#include "compression/compressor.h"
#include "core/datasets.h"
#include "core/models.h"
#include "secagg/secagg.h"
#include "state/store.h"
#include "transport/client_link.h"
#include "transport/transport.h"
#include "wire/net.h"
#include "wire/wire.h"

namespace sparrow::client {

using Clock = std::chrono::steady_clock;

inline constexpr const char* kSoftware = "sparrow-client 0.1.0";
inline constexpr int64_t kStateKey = 0;  // one client per state database
// The state from before the last committed update, while the server has not
// answered it (an empty state once it has): a Task of that round asked again
// is trained from it (ClientSession::Impl::train).
inline constexpr int64_t kKeptStateKey = 1;

// Meta keys of the state database (state/store.h set_meta).
inline constexpr const char* kMetaClientId = "client.id";
inline constexpr const char* kMetaDigest = "client.digest";
inline constexpr const char* kMetaHeldRound = "held.round";
inline constexpr const char* kMetaHeldRun = "held.run_id";
inline constexpr const char* kMetaHeldWeights = "held.weights";
// The round of the last update committed ("0" or missing: none) and whether
// the server answered it ("1") or not ("0"), written with kKeptStateKey.
inline constexpr const char* kMetaCommitRound = "commit.round";
inline constexpr const char* kMetaCommitAnswered = "commit.answered";

inline Weights clone_weights(const Weights& w) {
  Weights out;
  for (const auto& [k, v] : w) out[k] = v.clone();
  return out;
}

inline std::string shape_text(const std::vector<int64_t>& s) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  return os.str() + ']';
}

inline wire::Message message(wire::Body body) {
  wire::Message m;
  m.body = std::move(body);
  return m;
}

struct ClientSession::Impl {
  enum class Outcome { kContinue, kFinished, kReconnect };

  ClientSession& self;
  SessionConfig cfg;
  core::Dataset data;
  core::Dataset holdout;  // empty unless cfg.holdout > 0
  at::Device device{at::kCPU};
  std::shared_ptr<core::Model> replica;
  std::vector<std::string> names;  // model order
  std::map<std::string, std::vector<int64_t>> shapes;
  int64_t total_numel = 0;
  uint64_t digest = 0;
  uint64_t max_bytes = 0;

  std::unique_ptr<state::ClientStateStore> store;
  state::ClientState st;  // the persisted state, key kStateKey
  Weights held;           // B_{held_round} on the CPU; empty: the seed-built model (held_round 0)
  std::string held_run_id;
  // The last committed update's round (0: none) and whether the server
  // answered it; the state before it is kKeptStateKey in the database.
  uint64_t committed_round = 0;
  bool committed_answered = true;
  Weights initial;  // W_0 from initial_seed (built on first need)
  std::optional<uint64_t> initial_seed;

  std::unique_ptr<LocalTrainer> trainer;
  std::unique_ptr<compression::Compressor> dense;  // "none": control deltas
  aggregation::DpSpec ldp;                         // local DP (cfg.dp)
  std::random_device entropy;                      // local DP noise keys

  transport::ClientLink link;  // to cfg.server: the connection, handshake failures, backoff
  bool welcomed = false;
  uint16_t server_minor = 0;  // the Welcome's protocol minor: updates go packed from 1.10 (wire::packs_well)
  wire::Welcome welcome;
  uint32_t hb_ms = 1000;
  uint64_t known_round = 0;
  std::optional<uint64_t> pending_round;  // update sent, awaiting Ack/Error
  std::optional<uint64_t> rehello_round;  // a Delta of this round was answered with a re-Hello
  Clock::time_point last_rx, next_hb;

  struct AtomicCounters {
    std::atomic<uint64_t> hellos{0}, welcomes{0}, tasks_done{0}, tasks_refused{0}, updates_acked{0},
        updates_rejected{0}, reconnects{0}, heartbeats{0}, errors_received{0};
  } n;

  TaskRunner runner;  // set: Tasks go to it instead of local training (a gateway)

  // A Task's settings, checked; once they pass, the client holds B_{r-1}.
  struct Prepared {
    TrainConfig tc;
    std::unique_ptr<compression::Compressor> comp;
    Weights shared, server_control;
    Weights masks;  // tcs: the server's mask per parameter (int64 positions)
  };
  // One round's training, before its update is encoded.
  struct Trained {
    TrainResult tr;
    double secs = 0;
    std::vector<std::pair<std::string, double>> metrics;
    Weights outgoing;         // the delta, local DP noise added when configured
    state::ClientState next;  // committed when the update is sent
    bool replay = false;      // the committed, unanswered round again: trained from the kept state
  };
  // The open SecAgg+ round: its Task, the model it trains, and the protocol
  // state (keys, shares held). In memory only: a restarted client is a
  // dropout of the round.
  struct SecAggRound {
    wire::Task task;
    Weights base;
    Prepared prepared;
    std::unique_ptr<secagg::Client> party;
  };
  std::unique_ptr<SecAggRound> sa;

  // ---- construction and the loop (session.cc) ----

  // Validates cfg as the loader would, builds the replica, checks the data
  // (or takes the runner), splits the holdout, loads the keys, opens the
  // state database.
  Impl(ClientSession& s, SessionConfig c, core::Dataset d, TaskRunner run = {});
  // The holdout: a fixed share of the samples (the same for the same client_id
  // and data), never trained on.
  void split_holdout();
  // Connects, serves, reconnects after a backoff; true when the run finished.
  bool run();
  // One connection: Hello, then messages and heartbeats until the run
  // finished, the server fell silent or said Bye, or stop().
  Outcome serve();
  Outcome handle(wire::Message& m);
  Outcome on_welcome(const wire::Welcome& w);
  Outcome on_error(const wire::ErrorBody& e);

  // ---- the connection (session_connection.cc) ----

  // A new connection (link.open()): not welcomed, no update pending on it.
  void open_connection();
  // Never blocks: a full queue (or no peer) counts as a failed send.
  bool send(const wire::Message& m);
  bool send_hello();
  wire::ParseLimits limits() const;

  // ---- local state (session_state.cc) ----

  void open_state();
  // Forgets everything that belongs to another run.
  void reset_state();
  // Holds B_round (`w`) from now on, also across a restart.
  void persist_held(uint64_t round, const Weights& w);
  // W_0 of the run's model_seed (a Delta against round 0 applies to it).
  const Weights& initial_model(uint64_t seed);
  // The server answered (Ack, or an Error naming it) the update of `round`:
  // the state kept from before it is dropped.
  void answered(uint64_t round);

  // ---- tasks (session_task.cc) ----

  // Checks a tensor list against the model: known names, unique, the
  // parameters' shapes (unless !same_shape: ACP's shared factors), and when
  // `exact`, every parameter exactly once.
  void check_tensors(const std::vector<wire::NamedTensor>& ts, const char* what, bool exact,
                     bool same_shape = true) const;
  Weights decode_all(const std::vector<wire::NamedTensor>& ts) const;
  // A Task: trained and answered with an update (or the SecAgg+ keys), or
  // refused with an Error naming the round.
  void on_task(const wire::Task& task);
  // B_{r-1} from the Task (Full, or Delta against what we hold), or nullopt
  // when a Delta's base is not ours (then Hello reports what we hold, once per
  // round; a second such Delta of the same round is an Error).
  std::optional<Weights> broadcast_model(const wire::Task& task);
  Prepared prepare(const wire::Task& task, const Weights& base);
  Trained train(const wire::Task& task, const Weights& base, Prepared& p);
  // Commits the state that produced an update and queues the update's bytes.
  void commit_and_send(uint64_t r, const Trained& t, const std::string& bytes);
  void train_and_send(const wire::Task& task, const Weights& base);

  // ---- secure aggregation (session_secagg.cc, docs/security.md) ----

  // Test aid (--fault): exit as a crash would, at the named point.
  void fault_point(const char* where);
  void start_secagg(const wire::Task& task, const Weights& base);
  void on_secagg(const wire::SecAgg& m);
  // Trains, quantises the weighted update into the ring, masks it and sends it.
  void masked_update();
};

}  // namespace sparrow::client
