#pragma once
// Private to sparrow_lite_client: Session::Impl, the state of one lite
// client. Its methods are defined by job:
//   session.cc         construction, the loop, the dispatch of the server's
//                      messages, the connection (sends, Hello; handshake
//                      failures and backoff: transport/client_link.h)
//   session_task.cc    a Task: the broadcast model, its settings, training,
//                      the encoded update, the state file
//   session_secagg.cc  a SecAgg+ round: keys, shares, the masked update, the reveal
// Threads: everything runs on run()'s thread; only `n` and self.stop_ are
// read from others.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "compression/flat_codec.h"
#include "liteclient/local_dp.h"
#include "liteclient/session.h"
#include "liteclient/state_file.h"
#include "secagg/secagg.h"
#include "transport/client_link.h"
#include "transport/transport.h"
#include "wire/net.h"
#include "wire/wire.h"

namespace sparrow::liteclient {

using Clock = std::chrono::steady_clock;
namespace flat = compression::flat;

inline constexpr const char* kSoftware = "sparrow-client-lite 0.1.0";

inline wire::Message message(wire::Body body) {
  wire::Message m;
  m.body = std::move(body);
  return m;
}

struct Session::Impl {
  enum class Outcome { kContinue, kFinished, kReconnect };

  Session& self;
  Config cfg;
  std::unique_ptr<SessionTrainer> trainer;
  const Layout& layout;
  uint64_t digest = 0;
  uint64_t max_bytes = 0;

  // The persisted state (state_file.h): st.held is the one copy of B_h the
  // client keeps (a Task trains from it), st.codec and st.prev_codec the
  // codec states now and before st.committed_round.
  ClientState st;
  LocalDp ldp;                 // cfg.dp
  std::random_device entropy;  // local DP's noise and SecAgg+'s rounding keys: this device's own

  transport::ClientLink link;  // to cfg.server: the connection, handshake failures, backoff
  bool welcomed = false;
  uint16_t server_minor = 0;  // the Welcome's protocol minor: updates go packed from 1.10 (wire::packs_well)
  wire::Welcome welcome;
  uint32_t hb_ms = 1000;
  uint64_t known_round = 0;
  std::optional<uint64_t> pending_round;
  std::optional<uint64_t> rehello_round;
  Clock::time_point last_rx, next_hb;

  struct AtomicCounters {
    std::atomic<uint64_t> hellos{0}, welcomes{0}, tasks_done{0}, tasks_refused{0}, updates_acked{0},
        updates_rejected{0}, reconnects{0}, heartbeats{0}, errors_received{0};
  } n;

  // A Task's settings, checked; once they pass, the client holds B_{r-1}.
  struct Prepared {
    std::unique_ptr<flat::Codec> codec;
    std::vector<float> server_control;                  // SCAFFOLD's c (empty: none sent)
    std::map<std::string, std::vector<int64_t>> masks;  // tcs: the server's mask per parameter
    std::map<std::string, flat::Tensor> shared;         // acp: the round's shared factor per parameter ({k, r})
  };
  // One round's training and the state it leads to (committed when sent).
  struct Trained {
    LocalUpdate update;
    double secs = 0;
    std::vector<std::pair<std::string, double>> metrics;
    std::vector<float> next_control;
    CodecStates next_codec;
    bool replay = false;  // the round committed last, asked again: trained from the state before it
  };
  struct SecAggRound {
    wire::Task task;
    std::vector<float> base;
    Prepared prepared;
    std::unique_ptr<secagg::Client> party;
  };
  std::unique_ptr<SecAggRound> sa;

  Impl(Session& s, Config c, std::unique_ptr<SessionTrainer> t);

  // ---- the loop and the connection (session.cc) ----
  bool run();
  Outcome serve();
  Outcome handle(wire::Message& m);
  Outcome on_welcome(const wire::Welcome& w);
  Outcome on_error(const wire::ErrorBody& e);
  void open_connection();  // link.open(): not welcomed, no update pending
  bool send(const wire::Message& m);
  bool send_hello();
  wire::ParseLimits limits() const;

  // ---- tasks and state (session_task.cc) ----
  void open_state();
  void save();
  void reset_state(const std::string& run_id);
  void persist_held(uint64_t round, std::vector<float> w);
  // The server answered (Ack or Error) the update of `round`.
  void answered(uint64_t round);
  // Each of ts names a parameter once (all of them when exact), with the
  // parameter's shape unless !same_shape (acp's {k, r} shared factors).
  void check_tensors(const std::vector<wire::NamedTensor>& ts, const char* what, bool exact,
                     bool same_shape = true) const;
  // out (layout.total floats) += the tensors, each at its parameter's offset.
  void decode_into(const std::vector<wire::NamedTensor>& ts, std::vector<float>& out) const;
  // Drops the Task's broadcast weights once decoded (they are a model's worth).
  void on_task(wire::Task& task);
  std::optional<std::vector<float>> broadcast_model(const wire::Task& task);
  // Checks the Task's settings; once they pass, `base` becomes st.held.
  Prepared prepare(const wire::Task& task, std::vector<float> base);
  Trained train(const wire::Task& task, const std::vector<float>& base, Prepared& p);
  // Commits the state, then sends `bytes` and frees them.
  void commit_and_send(uint64_t r, Trained& t, std::string bytes);
  void train_and_send(const wire::Task& task, std::vector<float> base);

  // ---- secure aggregation (session_secagg.cc) ----
  void start_secagg(const wire::Task& task, std::vector<float> base);
  void on_secagg(const wire::SecAgg& m);
  void masked_update();
};

}  // namespace sparrow::liteclient
