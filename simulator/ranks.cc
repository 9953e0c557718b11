// The simulator over MPI ranks (docs/simulator.md, "Several machines"): rank 0
// sends each round's model and each rank its clients with their states; the
// ranks train them on their workers and send back each client's wire update
// and new state; rank 0 folds them in client-id order.
//
// The rank messages (core/bytes.h: fields in host byte order, byte strings as
// a u64 length then the bytes; only rank 0 and the ranks it started exchange
// them, so one build on one kind of machine):
//   round (broadcast): u64 1, u64 t, u64 clients selected, bytes model,
//                      bytes SCAFFOLD's c, bytes ACP's factors (empty: none);
//                      u64 0 alone ends the run
//   task (to rank r):  per worker of r: u64 n, then n x (u64 client, bytes state)
//   results (to 0):    per client, in the task's order: u64 client,
//                      u64 flags (1 trained, 2 kept), u64 samples, f64 train_s,
//                      f64 sim_s, f64 train_loss, u64 bytes_up, bytes state,
//                      bytes update, bytes SCAFFOLD's delta c
#include <spdlog/spdlog.h>

#include <optional>

#include "core/bytes.h"
#include "core/error.h"
#include "federation/client_pipeline.h"
#include "simulator/impl.h"

namespace sparrow::simulator {
namespace {

using compression::deserialize_weights;
using compression::serialize_weights;

constexpr const char* kWhat = "rank message";

std::string weights_or_empty(const client::Weights& w) { return w.empty() ? std::string() : serialize_weights(w); }
client::Weights weights_from(const std::string& b) { return b.empty() ? client::Weights{} : deserialize_weights(b); }

void put_result(core::ByteWriter& o, const ClientResult& r) {
  o.put<uint64_t>(static_cast<uint64_t>(r.client));
  o.put<uint64_t>((r.trained ? 1u : 0u) | (r.kept ? 2u : 0u));
  o.put<uint64_t>(static_cast<uint64_t>(r.samples));
  o.put<double>(r.train_s);
  o.put<double>(r.sim_s);
  o.put<double>(r.train_loss);
  o.put<uint64_t>(r.bytes_up);
  o.put_bytes(r.trained ? r.state.serialize() : std::string());
  o.put_bytes(r.update);
  o.put_bytes(weights_or_empty(r.control_delta));
}

void get_result(core::ByteReader& in, ClientResult& r, int64_t expected) {
  r.client = static_cast<int64_t>(in.get<uint64_t>());
  SPARROW_CHECK_T(FormatError, r.client == expected,
                  "rank message: client " << r.client << " where " << expected << " was sent");
  const auto flags = in.get<uint64_t>();
  r.trained = (flags & 1u) != 0;
  r.kept = (flags & 2u) != 0;
  r.samples = static_cast<int64_t>(in.get<uint64_t>());
  r.train_s = in.get<double>();
  r.sim_s = in.get<double>();
  r.train_loss = in.get<double>();
  r.bytes_up = in.get<uint64_t>();
  const std::string st = in.get_bytes();
  r.state = st.empty() ? state::ClientState{} : state::ClientState::deserialize(st);
  r.update = in.get_bytes();
  r.control_delta = weights_from(in.get_bytes());
}

}  // namespace

void Simulator::Impl::send_round(int t, int n_sel, const std::vector<std::vector<int64_t>>& wids) {
  const int ranks = cluster->size();
  const size_t nw = workers.size();
  std::string h;
  core::ByteWriter(h)
      .put<uint64_t>(1)
      .put<uint64_t>(static_cast<uint64_t>(t))
      .put<uint64_t>(static_cast<uint64_t>(n_sel))
      .put_bytes(serialize_weights(start_model()))
      .put_bytes(weights_or_empty(gm->control()))
      .put_bytes(weights_or_empty(gm->shared()));
  cluster->broadcast(h);
  rank_sent.assign(static_cast<size_t>(ranks), 0);
  rank_sent[0] = h.size() * static_cast<uint64_t>(ranks - 1);
  for (int r = 1; r < ranks; ++r) {
    msg_out.clear();
    core::ByteWriter task(msg_out);
    for (size_t w = 0; w < nw; ++w) {
      const std::vector<int64_t>& ids = wids[static_cast<size_t>(r) * nw + w];
      task.put<uint64_t>(ids.size());
      for (const int64_t c : ids) {
        task.put<uint64_t>(static_cast<uint64_t>(c));
        const std::optional<state::ClientState> got = store->get(c);
        task.put_bytes(got ? got->serialize() : std::string());
      }
    }
    cluster->send(r, msg_out);
    rank_sent[0] += msg_out.size();
  }
}

void Simulator::Impl::receive_round(const std::vector<std::vector<int64_t>>& wids,
                                    const std::vector<std::vector<ClientResult*>>& wout) {
  const size_t nw = workers.size();
  for (int r = 1; r < cluster->size(); ++r) {
    std::string& msg = msg_in;
    cluster->receive(r, msg);
    rank_sent[static_cast<size_t>(r)] = msg.size();
    core::ByteReader in(msg, kWhat);
    for (size_t w = 0; w < nw; ++w) {
      const size_t slot = static_cast<size_t>(r) * nw + w;
      for (size_t j = 0; j < wids[slot].size(); ++j) get_result(in, *wout[slot][j], wids[slot][j]);
    }
    SPARROW_CHECK_T(FormatError, in.done(), "rank message: " << in.left() << " bytes left over");
  }
}

void Simulator::Impl::fold_ranked(std::vector<ClientResult>& results) {
  for (ClientResult& r : results) {  // ids ascend
    store->put(r.client, std::move(r.state));
    if (r.kept)
      fold(0, r.client, r.update, r.control_delta);
    else
      engine->skip(federation::sim_client_id(r.client));
    r.update.clear();
    r.control_delta.clear();
  }
}

bool Simulator::Impl::serve_round() {
  std::string h;
  cluster->broadcast(h);
  core::ByteReader in(h, kWhat);
  if (in.get<uint64_t>() == 0) return false;
  const int t = static_cast<int>(in.get<uint64_t>());
  const int n_sel = static_cast<int>(in.get<uint64_t>());
  load_weights(in.get_bytes(), gm->broadcast(), "the round's model");
  gm->control() = weights_from(in.get_bytes());
  gm->shared() = weights_from(in.get_bytes());
  round_ctxs = gm->contexts(static_cast<uint64_t>(t) + 1, n_sel);
  const auto r0 = Clock::now();
  std::string& task = msg_in;
  cluster->receive(0, task);
  const double recv_s = seconds_since(r0);
  core::ByteReader tin(task, kWhat);
  const size_t nw = workers.size();
  std::vector<std::vector<int64_t>> wids(nw);
  std::vector<std::vector<std::string>> states(nw);
  size_t total = 0;
  for (size_t w = 0; w < nw; ++w) {
    const auto n = tin.get<uint64_t>();
    SPARROW_CHECK_T(FormatError, n <= static_cast<uint64_t>(cfg.clients), "rank message: " << n << " clients");
    for (uint64_t j = 0; j < n; ++j) {
      const auto c = static_cast<int64_t>(tin.get<uint64_t>());
      SPARROW_CHECK_T(FormatError, c >= 0 && c < cfg.clients, "rank message: client " << c);
      wids[w].push_back(c);
      states[w].push_back(tin.get_bytes());
    }
    total += n;
  }
  std::vector<ClientResult> results(total);
  std::vector<std::vector<ClientResult*>> wout(nw);
  size_t k = 0;
  for (size_t w = 0; w < nw; ++w)
    for (size_t j = 0; j < wids[w].size(); ++j, ++k) {
      ClientResult& r = results[k];
      r.client = wids[w][j];  // also for a client a stop leaves untrained: rank 0 checks every id
      r.state = states[w][j].empty() ? state::ClientState{} : state::ClientState::deserialize(states[w][j]);
      wout[w].push_back(&r);
    }
  const double unpack_s = seconds_since(r0) - recv_s;
  run_local(t, wids, wout);
  const double train_s = seconds_since(r0) - recv_s - unpack_s;
  msg_out.clear();
  core::ByteWriter o(msg_out);
  for (size_t w = 0; w < nw; ++w)
    for (const ClientResult* r : wout[w]) put_result(o, *r);
  const double pack_s = seconds_since(r0) - recv_s - unpack_s - train_s;
  cluster->send(0, msg_out);
  spdlog::debug(
      "round {}: rank {}: task received in {:.3f} s, unpacked {:.3f} s, trained {:.3f} s, packed {:.3f} s, "
      "sent {:.3f} s",
      t + 1, cluster->rank(), recv_s, unpack_s, train_s, pack_s,
      seconds_since(r0) - recv_s - unpack_s - train_s - pack_s);
  return true;
}
void Simulator::Impl::end_ranks() {
  std::string o;
  core::ByteWriter(o).put<uint64_t>(0);
  cluster->broadcast(o);
}

}  // namespace sparrow::simulator
