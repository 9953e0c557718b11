// The simulator over MPI ranks (docs/simulator.md, "Several machines"). Client
// c's state lives on its owner rank, c mod R, in that rank's own store: rank
// 0's is client_state.db (which also holds the checkpoints), rank r's is
// client_state.rank<r>.db in the run folder on its machine. Rank 0 sends each
// round's model to every rank and each rank the ids of the clients it owns;
// the ranks train them on their workers, keep the new states, and send back
// each client's wire update; rank 0 folds them in client-id order. States
// never cross: only models, client ids and updates do.
//
// The rank messages (core/bytes.h: fields in host byte order, byte strings as
// a u64 length then the bytes; only rank 0 and the ranks it started exchange
// them, so one build on one kind of machine). Broadcast by rank 0, a kind
// first:
//   start       u64 4, u64 resume, u64 round, u64 ranks   (the constructor's)
//   round       u64 1, u64 t, u64 clients selected, bytes model, bytes
//               SCAFFOLD's c, bytes ACP's factors (empty: none)
//   checkpoint  u64 2, u64 completed rounds
//   give up     u64 3: forget the states put in the round in progress
//   end         u64 0, u64 drop (1: delete the store, keep_client_state = false)
// Point to point:
//   task (0 to r):    per worker of r: u64 n, then n x u64 client
//   results (r to 0): u64 the rank's unflushed store bytes, then per client
//                     in the task's order: u64 client, u64 flags (1 trained,
//                     2 kept), u64 samples, f64 train_s, f64 sim_s,
//                     f64 train_loss, u64 bytes_up, bytes update, bytes
//                     SCAFFOLD's delta c
//   ack (r to 0, after start and checkpoint): bytes error (empty: done)
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <optional>

#include "core/bytes.h"
#include "core/error.h"
#include "core/error_text.h"
#include "federation/client_pipeline.h"
#include "simulator/impl.h"

namespace sparrow::simulator {
namespace {

using compression::deserialize_weights;
using compression::serialize_weights;

constexpr const char* kWhat = "rank message";
enum Kind : uint64_t { kEnd = 0, kRound = 1, kCheckpoint = 2, kGiveUp = 3, kStart = 4 };

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
  r.update = in.get_bytes();
  r.control_delta = weights_from(in.get_bytes());
}

void remove_store_files(const fs::path& p) {
  for (const char* ext : {"", "-wal", "-shm"}) fs::remove(p.string() + ext);
}

// The round a rank's store was last checkpointed at (nullopt: none).
std::optional<int> store_round(state::ClientStateStore& s) {
  const std::optional<std::string> v = s.get_meta("checkpoint.round");
  if (!v) return std::nullopt;
  try {
    return std::stoi(*v);
  } catch (const std::exception&) {
    throw FormatError("resume: bad checkpoint round '" + *v + "' in " + s.path());
  }
}

}  // namespace

fs::path Simulator::Impl::rank_store_path(int rank) const {
  return rank == 0 ? dir / "client_state.db" : dir / ("client_state.rank" + std::to_string(rank) + ".db");
}

int Simulator::Impl::owner(int64_t c) const {
  return distributed() ? static_cast<int>(c % static_cast<int64_t>(cluster->size())) : 0;
}

std::vector<int64_t> Simulator::Impl::owned(const std::vector<int64_t>& ids) const {
  if (!distributed()) return ids;
  std::vector<int64_t> mine;
  for (const int64_t c : ids)
    if (owner(c) == cluster->rank()) mine.push_back(c);
  return mine;
}

Assignment Simulator::Impl::schedule_owners(const std::vector<int64_t>& ids, const std::vector<double>& jobs) const {
  // schedule_lpt with each client restricted to its owner's slots (r*workers
  // .. (r+1)*workers-1): largest first, by its mean predicted cost, to the
  // owner's slot that would finish earliest.
  const int slots = cost.workers();
  const int nw = static_cast<int>(workers.size());
  Assignment a;
  a.per_worker.resize(static_cast<size_t>(slots));
  a.predicted.assign(static_cast<size_t>(slots), 0.0);
  std::vector<int64_t> order(jobs.size());
  std::iota(order.begin(), order.end(), 0);
  std::vector<double> size(jobs.size(), 0.0);
  for (size_t i = 0; i < jobs.size(); ++i)
    for (int k = 0; k < slots; ++k) size[i] += cost.predict(k, jobs[i]);
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return size[x] > size[y]; });
  for (const int64_t j : order) {
    const int first = owner(ids[static_cast<size_t>(j)]) * nw;
    int best = first;
    double best_finish = a.predicted[static_cast<size_t>(first)] + cost.predict(first, jobs[static_cast<size_t>(j)]);
    for (int k = first + 1; k < first + nw; ++k) {
      const double f = a.predicted[static_cast<size_t>(k)] + cost.predict(k, jobs[static_cast<size_t>(j)]);
      if (f < best_finish) {
        best_finish = f;
        best = k;
      }
    }
    a.per_worker[static_cast<size_t>(best)].push_back(j);
    a.predicted[static_cast<size_t>(best)] = best_finish;
  }
  a.makespan = a.predicted.empty() ? 0.0 : *std::max_element(a.predicted.begin(), a.predicted.end());
  if (spdlog::should_log(spdlog::level::debug)) {
    // Load balance: the round waits for the owner with the most predicted
    // work (seconds once the cost model is fitted, samples before).
    std::string busy;
    for (int r = 0; r < cluster->size(); ++r) {
      double b = 0;
      size_t n = 0;
      for (int k = r * nw; k < (r + 1) * nw; ++k) {
        b = std::max(b, a.predicted[static_cast<size_t>(k)]);
        n += a.per_worker[static_cast<size_t>(k)].size();
      }
      char part[64];
      std::snprintf(part, sizeof part, "%s%zu clients / %.3f", busy.empty() ? "" : ", ", n, b);
      busy += part;
    }
    spdlog::debug("ranks: owners' share of the round (clients / predicted work): {}", busy);
  }
  return a;
}

// ---- rank 0 ----

void Simulator::Impl::start_ranks(bool resume) {
  std::string h;
  core::ByteWriter(h)
      .put<uint64_t>(kStart)
      .put<uint64_t>(resume ? 1 : 0)
      .put<uint64_t>(static_cast<uint64_t>(round))
      .put<uint64_t>(static_cast<uint64_t>(cluster->size()));
  cluster->broadcast(h);
  collect_acks(/*refusal=*/true);
  rank_dirty.assign(static_cast<size_t>(cluster->size()), 0);
}

void Simulator::Impl::collect_acks(bool refusal) {
  std::string first;
  for (int r = 1; r < cluster->size(); ++r) {
    cluster->receive(r, msg_in);
    core::ByteReader in(msg_in, kWhat);
    std::string err = in.get_bytes();
    if (first.empty() && !err.empty()) first = std::move(err);
  }
  // Every rank has answered: a refusal is then rank 0's error (exit 2 for all).
  if (first.empty()) return;
  if (refusal) throw ConfigError(first);
  throw Error(first);
}

void Simulator::Impl::send_round(int t, int n_sel, const std::vector<std::vector<int64_t>>& wids) {
  const int ranks = cluster->size();
  const size_t nw = workers.size();
  std::string h;
  core::ByteWriter(h)
      .put<uint64_t>(kRound)
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
      for (const int64_t c : ids) task.put<uint64_t>(static_cast<uint64_t>(c));
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
    rank_dirty[static_cast<size_t>(r)] = in.get<uint64_t>();
    for (size_t w = 0; w < nw; ++w) {
      const size_t slot = static_cast<size_t>(r) * nw + w;
      for (size_t j = 0; j < wids[slot].size(); ++j) get_result(in, *wout[slot][j], wids[slot][j]);
    }
    SPARROW_CHECK_T(FormatError, in.done(), "rank message: " << in.left() << " bytes left over");
  }
}

void Simulator::Impl::fold_ranked(std::vector<ClientResult>& results) {
  for (ClientResult& r : results) {  // ids ascend; rank 0's own clients too (their states are in its store)
    if (r.kept)
      fold(0, r.client, r.update, r.control_delta);
    else
      engine->skip(federation::sim_client_id(r.client));
    r.update.clear();
    r.control_delta.clear();
  }
}

void Simulator::Impl::rollback_round() {
  store->rollback_to_mark();
  if (!distributed()) return;
  std::string h;
  core::ByteWriter(h).put<uint64_t>(kGiveUp);
  cluster->broadcast(h);
}

void Simulator::Impl::checkpoint_ranks(int completed) {
  if (!distributed()) return;
  std::string h;
  core::ByteWriter(h).put<uint64_t>(kCheckpoint).put<uint64_t>(static_cast<uint64_t>(completed));
  cluster->broadcast(h);
  // Every rank's states of the round are committed before rank 0's
  // checkpoint names the round (docs/simulator.md, "Checkpoints over ranks").
  collect_acks(/*refusal=*/false);
  std::fill(rank_dirty.begin(), rank_dirty.end(), 0);
}

size_t Simulator::Impl::unflushed_bytes() const {
  size_t most = store->dirty_bytes();
  for (const uint64_t b : rank_dirty) most = std::max(most, static_cast<size_t>(b));
  return most;
}

void Simulator::Impl::end_ranks() {
  std::string o;
  core::ByteWriter(o).put<uint64_t>(kEnd).put<uint64_t>(round >= cfg.rounds && !cfg.keep_client_state ? 1 : 0);
  cluster->broadcast(o);
}

// ---- ranks other than 0 ----

void Simulator::Impl::join_ranks() {
  std::string h;
  cluster->broadcast(h);
  core::ByteReader in(h, kWhat);
  SPARROW_CHECK_T(FormatError, in.get<uint64_t>() == kStart, "rank message: expected the run's start");
  const bool resume = in.get<uint64_t>() != 0;
  const int saved = static_cast<int>(in.get<uint64_t>());
  const int ranks = static_cast<int>(in.get<uint64_t>());
  std::string err;
  try {
    fs::create_directories(dir);
    const fs::path p = rank_store_path(cluster->rank());
    if (!resume) remove_store_files(p);
    SPARROW_CHECK_T(ConfigError, !resume || fs::exists(p),
                    "resume: " << p.string() << " is missing: it holds the client states rank " << cluster->rank()
                               << " owns (every rank keeps its own, in the run folder on its machine); restore it, "
                                  "or start the run again with --force");
    store = open_store(p.string(), cfg);
    if (resume) {
      const std::optional<int> at = store_round(*store);
      const std::optional<std::string> rk = store->get_meta("checkpoint.ranks");
      SPARROW_CHECK_T(ConfigError, at && *at == saved && rk && *rk == std::to_string(ranks),
                      "resume: " << p.string() << " holds the client states of "
                                 << (at ? "round " + std::to_string(*at) : std::string("no checkpoint"))
                                 << (rk ? " of a run on " + *rk + " ranks" : std::string())
                                 << ", but the run's checkpoint (client_state.db) is of round " << saved << " on "
                                 << ranks << " ranks: the ranks' stores do not match (a crash while a checkpoint "
                                 << "was being committed?); restore the run folder from a backup, or start the run "
                                    "again with --force");
    }
  } catch (const std::exception& e) {
    err = core::error_text(e);
    store.reset();
  }
  msg_out.clear();
  core::ByteWriter(msg_out).put_bytes(err);
  cluster->send(0, msg_out);
  if (!err.empty()) {
    // Rank 0 reports it and ends the job; this rank waits for that.
    std::string none;
    cluster->broadcast(none);
    throw ConfigError(err);
  }
}

bool Simulator::Impl::serve_round() {
  std::string h;
  cluster->broadcast(h);
  core::ByteReader in(h, kWhat);
  const auto kind = in.get<uint64_t>();
  if (kind == kEnd) {
    if (in.get<uint64_t>() != 0) {  // the run is over and keeps no client states
      const std::string p = store->path();
      store.reset();
      remove_store_files(p);
    }
    return false;
  }
  if (kind == kGiveUp) {
    store->rollback_to_mark();
    return true;
  }
  if (kind == kCheckpoint) {
    const auto completed = in.get<uint64_t>();
    std::string err;
    try {
      store->set_meta("checkpoint.round", std::to_string(completed));
      store->set_meta("checkpoint.ranks", std::to_string(cluster->size()));
      store->flush();
    } catch (const std::exception& e) {
      err = "checkpoint: rank " + std::to_string(cluster->rank()) + " could not commit " + store->path() + ": " +
            core::error_text(e);
    }
    msg_out.clear();
    core::ByteWriter(msg_out).put_bytes(err);
    cluster->send(0, msg_out);
    return true;
  }
  SPARROW_CHECK_T(FormatError, kind == kRound, "rank message: unknown kind " << kind);
  const int t = static_cast<int>(in.get<uint64_t>());
  const int n_sel = static_cast<int>(in.get<uint64_t>());
  load_weights(in.get_bytes(), gm->broadcast(), "the round's model");
  gm->control() = weights_from(in.get_bytes());
  gm->shared() = weights_from(in.get_bytes());
  round_ctxs = gm->contexts(static_cast<uint64_t>(t) + 1, n_sel);
  store->mark();  // where a given-up round goes back to
  const auto r0 = Clock::now();
  std::string& task = msg_in;
  cluster->receive(0, task);
  const double recv_s = seconds_since(r0);
  core::ByteReader tin(task, kWhat);
  const size_t nw = workers.size();
  std::vector<std::vector<int64_t>> wids(nw);
  std::vector<int64_t> all;
  for (size_t w = 0; w < nw; ++w) {
    const auto n = tin.get<uint64_t>();
    SPARROW_CHECK_T(FormatError, n <= static_cast<uint64_t>(cfg.clients), "rank message: " << n << " clients");
    for (uint64_t j = 0; j < n; ++j) {
      const auto c = static_cast<int64_t>(tin.get<uint64_t>());
      SPARROW_CHECK_T(FormatError, c >= 0 && c < cfg.clients && owner(c) == cluster->rank(),
                      "rank message: client " << c << " is not rank " << cluster->rank() << "'s");
      wids[w].push_back(c);
      all.push_back(c);
    }
  }
  store->prefetch(all);  // loaded on the store's thread while the first clients train
  std::vector<ClientResult> results(all.size());
  std::vector<std::vector<ClientResult*>> wout(nw);
  size_t k = 0;
  for (size_t w = 0; w < nw; ++w)
    for (size_t j = 0; j < wids[w].size(); ++j, ++k) {
      results[k].client = wids[w][j];  // also for a client a stop leaves untrained: rank 0 checks every id
      wout[w].push_back(&results[k]);
    }
  run_local(t, wids, wout);
  const double train_s = seconds_since(r0) - recv_s;
  msg_out.clear();
  core::ByteWriter o(msg_out);
  o.put<uint64_t>(store->dirty_bytes());
  for (size_t w = 0; w < nw; ++w)
    for (const ClientResult* r : wout[w]) put_result(o, *r);
  const double pack_s = seconds_since(r0) - recv_s - train_s;
  cluster->send(0, msg_out);
  spdlog::debug(
      "round {}: rank {}: task received in {:.3f} s, trained {} clients in {:.3f} s, packed {:.3f} s, "
      "sent {:.3f} s",
      t + 1, cluster->rank(), recv_s, all.size(), train_s, pack_s, seconds_since(r0) - recv_s - train_s - pack_s);
  return true;
}

}  // namespace sparrow::simulator
