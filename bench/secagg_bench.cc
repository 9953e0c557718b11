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

#include <ATen/ATen.h>

#include <cstring>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <sstream>

#include "aggregation/robust.h"
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

int bench_secagg(const SecAggBenchOptions& o) {
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
      line << "{\"bench\":\"secagg\",\"case\":\""
           << (k >= static_cast<uint32_t>(n - 1) ? "secagg-complete" : "secagg+") << "\"";
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

}  // namespace sparrow::bench
