// sparrow-bench secagg: what secure aggregation costs per round.
//
// The protocol code of sparrow-client and sparrow-server (secagg/secagg.h)
// runs in this process for n clients: every message is serialised and parsed
// as on the wire (its bytes counted), clients' work and the server's work are
// timed apart (clients run in parallel on their own devices in a deployment,
// the server's work is one machine's). A share of the clients drops after
// sending its shares, so the server also removes their pairwise masks.
// Baseline, same run, same n: plain FedAvg, where each client serialises its
// dense update and the server parses it and folds it into the aggregate.

#include "bench/secagg_bench.h"

#include <spdlog/spdlog.h>
#include <zmq.hpp>

#include <ATen/ATen.h>

#include <cstring>
#include <chrono>
#include <cstdio>
#include <map>
#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>

#include "aggregation/robust.h"
#include "bench/running_server.h"
#include "core/model_digest.h"
#include "server/store.h"
#include "wire/net.h"
#include "compression/encoded.h"
#include "core/json.h"
#include "core/models.h"
#include "core/rng.h"
#include "secagg/secagg.h"
#include "wire/wire.h"

namespace sparrow::bench {
namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

// A timer that adds the time of a scope to one of two totals.
struct Split {
  double client_ms = 0, server_ms = 0;
};

std::string wire_bytes(wire::Body body) {
  wire::Message m;
  m.body = std::move(body);
  return wire::serialize(m);
}

wire::SecAgg parse_secagg(const std::string& b) { return std::get<wire::SecAgg>(wire::parse(b).body); }

compression::Encoded dense(const float* x, int64_t n) {
  compression::Encoded e;
  e.format = compression::Format::kDense;
  e.value_type = compression::ValueType::kF32;
  e.shape = {n};
  e.values.resize_uninitialized(static_cast<size_t>(n) * 4);
  std::memcpy(e.values.data(), x, static_cast<size_t>(n) * 4);
  return e;
}

struct Result {
  Split t;
  uint64_t up = 0, down = 0;  // bytes, all clients, every message
  uint64_t update = 0;        // of `up`: the updates themselves (masked or plain)
  size_t survivors = 0;
  double max_error = 0;  // |unmasked mean - plain mean|
  std::string missing;   // secrets short of shares: the round failed
};

// Plain FedAvg: serialise (client), parse + fold (server).
Result plain_round(const std::vector<at::Tensor>& updates, const std::vector<double>& w) {
  Result r;
  const int64_t len = updates[0].numel();
  aggregation::Aggregator agg("mean", "none", static_cast<int>(updates.size()), 0);
  aggregation::Accumulator acc = agg.make_accumulator({{"w", {len}}});
  acc.reset(0);
  for (size_t i = 0; i < updates.size(); ++i) {
    auto t0 = Clock::now();
    wire::ModelUpdate u;
    u.round = 1;
    u.client_id = "c" + std::to_string(i);
    u.num_samples = static_cast<uint64_t>(w[i]);
    u.tensors.push_back({"w", dense(updates[i].data_ptr<float>(), len)});
    const std::string b = wire_bytes(std::move(u));
    r.t.client_ms += ms_since(t0);
    r.up += b.size();
    r.update += b.size();
    t0 = Clock::now();
    wire::ModelUpdate pu = std::get<wire::ModelUpdate>(wire::parse(b).body);
    aggregation::EncodedUpdate eu;
    eu.emplace_back("w", std::move(pu.tensors[0].tensor));
    acc.add(eu, static_cast<double>(pu.num_samples));
    r.t.server_ms += ms_since(t0);
  }
  r.survivors = updates.size();
  return r;
}

Result secure_round(const std::vector<at::Tensor>& updates, const std::vector<double>& w, uint32_t degree,
                    uint32_t threshold, double dropout, double clip, const at::Tensor& plain_mean) {
  Result r;
  const uint32_t n = static_cast<uint32_t>(updates.size());
  const int64_t len = updates[0].numel();
  secagg::Params p;
  p.enabled = true;
  p.degree = degree;
  p.threshold = threshold;
  p.clip = clip;
  const uint64_t seed = 99;
  auto ts = Clock::now();
  secagg::Server server(p, 1, n, seed, static_cast<size_t>(len));
  r.t.server_ms += ms_since(ts);
  double total = 0;
  for (double x : w) total += x;
  std::vector<std::unique_ptr<secagg::Client>> c(n);
  // The clients that drop after their shares: every k-th.
  const uint32_t every = dropout > 0 ? static_cast<uint32_t>(1.0 / dropout + 0.5) : 0;
  auto drops = [&](uint32_t i) { return every > 0 && i % every == every / 2; };
  // Stage 1.
  for (uint32_t i = 1; i <= n; ++i) {
    auto t0 = Clock::now();
    c[i - 1] = std::make_unique<secagg::Client>(
        wire::SecAggSetup{i, n, server.degree(), server.threshold(), seed, clip, w[i - 1] / total}, 1, "c");
    const std::string b = wire_bytes(c[i - 1]->keys());
    r.t.client_ms += ms_since(t0);
    r.up += b.size();
    t0 = Clock::now();
    server.add_keys(i, parse_secagg(b));
    r.t.server_ms += ms_since(t0);
  }
  // Stage 2.
  ts = Clock::now();
  std::map<uint32_t, std::string> out;
  for (auto& [i, m] : server.neighbour_messages()) out[i] = wire_bytes(std::move(m));
  r.t.server_ms += ms_since(ts);
  std::map<uint32_t, std::string> shares;
  for (auto& [i, b] : out) {
    r.down += b.size();
    auto t0 = Clock::now();
    shares[i] = wire_bytes(c[i - 1]->shares(parse_secagg(b)));
    r.t.client_ms += ms_since(t0);
    r.up += shares[i].size();
  }
  ts = Clock::now();
  for (auto& [i, b] : shares) server.add_shares(i, parse_secagg(b));
  out.clear();
  for (auto& [i, m] : server.shares_in_messages()) out[i] = wire_bytes(std::move(m));
  r.t.server_ms += ms_since(ts);
  // Stage 3: the updates, quantised and masked; the droppers never send theirs.
  const double scale = secagg::ring_scale(n, clip);
  for (auto& [i, b] : out) {
    r.down += b.size();
    auto t0 = Clock::now();
    c[i - 1]->receive_shares(parse_secagg(b));
    if (drops(i)) {
      r.t.client_ms += ms_since(t0);
      continue;
    }
    std::vector<uint32_t> x(static_cast<size_t>(len));
    secagg::quantise(updates[i - 1].data_ptr<float>(), x.size(), w[i - 1] / total, clip, scale, rng::derive(seed, i),
                     x.data());
    const std::string y = wire_bytes(c[i - 1]->masked(std::move(x)));
    r.t.client_ms += ms_since(t0);
    r.up += y.size();
    r.update += y.size();
    t0 = Clock::now();
    server.add_masked(i, parse_secagg(y));
    r.t.server_ms += ms_since(t0);
  }
  // Stage 4.
  ts = Clock::now();
  out.clear();
  for (auto& [i, m] : server.unmask_messages()) out[i] = wire_bytes(std::move(m));
  r.t.server_ms += ms_since(ts);
  for (auto& [i, b] : out) {
    r.down += b.size();
    auto t0 = Clock::now();
    const std::string rv = wire_bytes(c[i - 1]->reveal(parse_secagg(b)));
    r.t.client_ms += ms_since(t0);
    r.up += rv.size();
    t0 = Clock::now();
    server.add_reveal(i, parse_secagg(rv));
    r.t.server_ms += ms_since(t0);
  }
  r.survivors = server.masked().size();
  if (!server.can_unmask()) {
    r.missing = server.missing();
    return r;
  }
  ts = Clock::now();
  const std::vector<uint32_t> sum = server.unmask();
  double wsum = 0;
  for (uint32_t i : server.masked()) wsum += w[i - 1] / total;
  at::Tensor mean = at::empty({len}, at::kFloat);
  secagg::dequantise(sum.data(), sum.size(), scale, mean.data_ptr<float>());
  mean.div_(wsum);
  aggregation::Aggregator agg("mean", "none", static_cast<int>(n), 0);
  aggregation::Accumulator acc = agg.make_accumulator({{"w", {len}}});
  acc.reset(0);
  aggregation::EncodedUpdate eu;
  eu.emplace_back("w", dense(mean.data_ptr<float>(), len));
  acc.add(eu, wsum * total);
  r.t.server_ms += ms_since(ts);
  r.survivors = server.masked().size();
  // Check against the plain weighted mean of the survivors.
  at::Tensor ref = at::zeros({len});
  double rw = 0;
  for (uint32_t i : server.masked()) {
    ref.add_(updates[i - 1].clamp(-clip, clip), w[i - 1]);
    rw += w[i - 1];
  }
  r.max_error = (mean - ref / rw).abs().max().item<double>();
  (void)plain_mean;
  return r;
}

}  // namespace

namespace {

int bench_protocol(const SecAggBenchOptions& o) {
  int64_t len = o.elements;
  if (len <= 0)
    for (const auto& p : core::make_model("mlp", 1)->parameters()) len += p.numel();
  for (int n : o.clients) {
    at::manual_seed(static_cast<uint64_t>(n));
    std::vector<at::Tensor> updates;
    std::vector<double> w;
    for (int i = 0; i < n; ++i) {
      updates.push_back(at::randn({len}) * 0.01);
      w.push_back(static_cast<double>(300 + (i * 37) % 600));  // samples per client
    }
    const Result plain = plain_round(updates, w);
    std::map<uint32_t, uint32_t> degrees;  // effective degree -> the degree asked for (each graph once)
    for (int d : o.degrees) {
      uint32_t ask = static_cast<uint32_t>(d);
      if (d <= 0) {
        if (n > o.complete_max) continue;
        ask = static_cast<uint32_t>(n % 2 == 0 ? n : n + 1);  // >= n - 1: complete
      }
      degrees.emplace(std::min<uint32_t>(ask, static_cast<uint32_t>(n - 1)), ask);
    }
    for (const auto& [k, d] : degrees) {
      const uint32_t t = k / 2 + 1;
      if (static_cast<uint32_t>(n) < t + 1 || d > 254) continue;
      const Result s = secure_round(updates, w, d, t, o.dropout, o.clip, at::Tensor());
      const double nd = static_cast<double>(n);
      std::ostringstream line;
      auto num = [&](const char* k, double v) { line << ",\"" << k << "\":" << json_number(v); };
      line << "{\"bench\":\"secagg\",\"case\":\"" << (k >= static_cast<uint32_t>(n - 1) ? "secagg-complete" : "secagg+")
           << "\"";
      num("clients", n);
      num("degree", k);
      num("threshold", t);
      num("dropout", o.dropout);
      num("survivors", static_cast<double>(s.survivors));
      num("elements", static_cast<double>(len));
      num("server_ms", s.t.server_ms);
      num("plain_server_ms", plain.t.server_ms);
      num("server_x_plain", s.t.server_ms / plain.t.server_ms);
      num("client_ms", s.t.client_ms / nd);
      num("plain_client_ms", plain.t.client_ms / nd);
      // Bytes: the update itself (masked: 4 bytes per coordinate, as a dense
      // fp32 one), and what the protocol adds per selected client (keys,
      // shares, reveal up; neighbours, shares, unmask request down). The
      // model broadcast is the same with and without and is not counted.
      num("update_bytes", static_cast<double>(s.update) / static_cast<double>(s.survivors));
      num("plain_update_bytes", static_cast<double>(plain.update) / nd);
      num("protocol_up_bytes_per_client", static_cast<double>(s.up - s.update) / nd);
      num("protocol_down_bytes_per_client", static_cast<double>(s.down) / nd);
      line << ",\"unmasked\":" << (s.missing.empty() ? "true" : "false");
      if (s.missing.empty())
        num("max_error", s.max_error);
      else
        line << ",\"missing\":" << json_string(s.missing);
      line << "}";
      std::printf("%s\n", line.str().c_str());
      std::fflush(stdout);
    }
  }
  return 0;
}

// ---- service ------------------------------------------------------------------

// One configuration: n clients, R rounds through a real server. Returns 0 when
// every round completed with every client's update.
int service_case(int n, bool secure, const SecAggBenchOptions& o) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(o.tmp) / ("service-" + std::to_string(n) + (secure ? "-secagg" : "-plain"));
  fs::remove_all(dir);
  fs::create_directories(dir);
  server::ServerConfig cfg;
  cfg.listen = "tcp://127.0.0.1:*";
  cfg.insecure = true;
  cfg.model = "mlp";
  cfg.db = (dir / "server.db").string();
  cfg.heartbeat_ms = 600000;  // the load generator does not heartbeat
  cfg.round_deadline_s = 600;
  cfg.rounds = o.rounds;
  cfg.clients_per_round = n;
  cfg.quorum = n;
  cfg.workers = 2;
  cfg.max_message_mb = 64;
  if (secure) {
    std::ostringstream spec;
    spec << "secagg+:degree=" << o.degree << ",clip=" << o.clip << ",timeout=60";
    cfg.secagg = spec.str();
  }
  auto srv_ptr = std::make_unique<RunningServer>(cfg);
  RunningServer& srv = *srv_ptr;
  // The model's names and shapes in model order, and one update for everyone.
  std::vector<std::pair<std::string, at::Tensor>> params;
  for (const auto& p : core::make_model("mlp", 1)->named_parameters(/*recurse=*/true))
    params.emplace_back(p.key(), p.value().detach().clone());
  at::manual_seed(5);
  std::vector<wire::NamedTensor> tensors;
  std::vector<float> flat;
  for (const auto& [name, v] : params) {
    at::Tensor u = (at::randn(v.sizes()) * 0.01).contiguous();
    compression::Encoded e = dense(u.data_ptr<float>(), u.numel());
    e.shape = v.sizes().vec();
    tensors.push_back({name, std::move(e)});
    flat.insert(flat.end(), u.data_ptr<float>(), u.data_ptr<float>() + u.numel());
  }
  std::map<std::string, at::Tensor> shape_map(params.begin(), params.end());
  const uint64_t digest = core::model_digest(shape_map);

  zmq::context_t ctx(1);
  ctx.set(zmq::ctxopt::max_sockets, n + 64);
  std::vector<zmq::socket_t> socks;
  socks.reserve(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    socks.emplace_back(ctx, zmq::socket_type::dealer);
    net::set_limits(socks.back(), cfg.max_message_bytes());
    socks.back().connect(srv.get().endpoint());
    wire::Hello h;
    h.client_id = "c" + std::to_string(i);
    h.num_samples = static_cast<uint64_t>(300 + (i * 37) % 600);
    h.model = "mlp";
    h.model_digest = digest;
    h.software = "sparrow-bench";
    h.last_round = 0;  // holds W_0: tasks are Deltas, as for a client that keeps the model
    wire::Message m;
    m.body = h;
    net::send(socks.back(), m);
  }
  std::vector<std::unique_ptr<secagg::Client>> party(static_cast<size_t>(n));
  std::vector<zmq::pollitem_t> items(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i)
    items[static_cast<size_t>(i)] = {static_cast<void*>(socks[static_cast<size_t>(i)]), 0, ZMQ_POLLIN, 0};
  wire::ParseLimits limits;
  limits.max_bytes = cfg.max_message_bytes();
  std::map<uint64_t, Clock::time_point> first_task;
  std::map<uint64_t, double> client_s;  // the load generator's own protocol work per round (serial here)
  std::vector<double> round_s, server_s;
  uint64_t errors = 0, acked = 0;
  int64_t seen_completed = 0;
  const auto give_up = Clock::now() + std::chrono::seconds(600);
  auto send = [&](zmq::socket_t& s, wire::Body b) {
    wire::Message m;
    m.body = std::move(b);
    net::send(s, m);
  };
  while (!srv.done() && seen_completed < o.rounds && Clock::now() < give_up) {
    zmq::poll(items.data(), items.size(), std::chrono::milliseconds(20));
    for (int i = 0; i < n; ++i) {
      if (!(items[static_cast<size_t>(i)].revents & ZMQ_POLLIN)) continue;
      zmq::socket_t& s = socks[static_cast<size_t>(i)];
      for (;;) {
        std::optional<wire::Message> m = net::receive(s, 0, limits);
        if (!m) break;
        if (const auto* t = std::get_if<wire::Task>(&m->body)) {
          first_task.emplace(t->round, Clock::now());
          const auto t0 = Clock::now();
          if (t->secagg) {
            party[static_cast<size_t>(i)] =
                std::make_unique<secagg::Client>(*t->secagg, t->round, "c" + std::to_string(i));
            send(s, party[static_cast<size_t>(i)]->keys());
          } else {
            wire::ModelUpdate u;
            u.round = t->round;
            u.client_id = "c" + std::to_string(i);
            u.num_samples = static_cast<uint64_t>(300 + (i * 37) % 600);
            u.tensors = tensors;
            send(s, std::move(u));
          }
          client_s[t->round] += std::chrono::duration<double>(Clock::now() - t0).count();
        } else if (const auto* a = std::get_if<wire::SecAgg>(&m->body)) {
          secagg::Client& p = *party[static_cast<size_t>(i)];
          const auto t0 = Clock::now();
          if (a->stage == wire::SecAggStage::kNeighbours) {
            send(s, p.shares(*a));
          } else if (a->stage == wire::SecAggStage::kSharesIn) {
            p.receive_shares(*a);
            const wire::SecAggSetup& g = p.setup();
            std::vector<uint32_t> x(flat.size());
            secagg::quantise(flat.data(), flat.size(), g.weight, g.clip, secagg::ring_scale(g.clients, g.clip),
                             rng::derive(7, static_cast<uint64_t>(i)), x.data());
            send(s, p.masked(std::move(x)));
          } else if (a->stage == wire::SecAggStage::kUnmask) {
            send(s, p.reveal(*a));
          }
          client_s[a->round] += std::chrono::duration<double>(Clock::now() - t0).count();
        } else if (std::holds_alternative<wire::Ack>(m->body)) {
          ++acked;
        } else if (const auto* e = std::get_if<wire::ErrorBody>(&m->body)) {
          if (errors++ < 5) std::cerr << "sparrow-bench: server error: " << e->message << "\n";
        }
      }
    }
    const int64_t done = srv.get().completed_rounds();
    while (seen_completed < done) {
      ++seen_completed;
      const auto now = Clock::now();
      const auto it = first_task.find(static_cast<uint64_t>(seen_completed));
      const double rs = it == first_task.end() ? 0 : std::chrono::duration<double>(now - it->second).count();
      round_s.push_back(rs);
      server_s.push_back(rs - client_s[static_cast<uint64_t>(seen_completed)]);
    }
  }
  const std::string error = srv.error();
  if (!error.empty()) std::cerr << "sparrow-bench: server failed: " << error << "\n";
  srv_ptr.reset();
  // The server's own count of the last round's bytes (its rounds table).
  double bytes_in = 0, bytes_out = 0;
  if (!round_s.empty()) {
    const std::vector<server::RoundRow> rows = server::ServerStore::open_readonly(cfg.db)->rounds();
    if (!rows.empty()) {
      bytes_in = static_cast<double>(rows.back().bytes_in);
      bytes_out = static_cast<double>(rows.back().bytes_out);
    }
  }
  std::ostringstream line;
  auto num = [&](const char* k, double v) { line << ",\"" << k << "\":" << json_number(v); };
  line << "{\"bench\":\"secagg\",\"case\":\"service\",\"secagg\":" << (secure ? "true" : "false")
       << ",\"transport\":\"tcp loopback\"";
  num("clients", n);
  if (secure) num("degree", std::min(o.degree, n - 1));
  num("rounds", static_cast<double>(round_s.size()));
  num("elements", static_cast<double>(flat.size()));
  auto last = [](const std::vector<double>& v) { return v.empty() ? 0.0 : v.back(); };
  // The last round: the first also pays for connections and full-model tasks.
  num("round_s", last(round_s));
  num("load_generator_s", round_s.empty() ? 0.0 : last(round_s) - last(server_s));
  num("round_s_minus_load_generator", last(server_s));
  num("bytes_in_per_client", bytes_in / n);
  num("bytes_out_per_client", bytes_out / n);
  num("errors", static_cast<double>(errors));
  line << "}";
  std::printf("%s\n", line.str().c_str());
  std::fflush(stdout);
  fs::remove_all(dir);
  return error.empty() && static_cast<int>(round_s.size()) == o.rounds && errors == 0 ? 0 : 1;
}

}  // namespace

int bench_secagg(const SecAggBenchOptions& o) {
  spdlog::set_level(std::getenv("SPARROW_BENCH_DEBUG") ? spdlog::level::debug : spdlog::level::warn);
  auto has = [&](const char* c) { return std::find(o.cases.begin(), o.cases.end(), c) != o.cases.end(); };
  int rc = 0;
  if (has("protocol")) rc |= bench_protocol(o);
  if (has("service"))
    for (int n : o.clients)
      for (bool secure : {false, true}) rc |= service_case(n, secure, o);
  return rc;
}

}  // namespace sparrow::bench
