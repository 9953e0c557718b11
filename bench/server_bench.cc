// sparrow-bench server: sparrow-server's ingest rate under many CurveZMQ
// connections, and its dense-update throughput (docs/performance.md, "Server").
//
// The real server::Server runs in this process on a thread, bound to
// tcp://127.0.0.1:*; a load generator on the calling thread drives it over
// ZeroMQ exactly as sparrow-client would (Hello, Task, ModelUpdate, Ack), so
// every figure includes the transport, CURVE, parsing, verification,
// aggregation and the server's threads. Keys, allow-list and SQLite databases
// live in a temporary folder removed at the end.
//
// "ingest": C DEALER connections (CURVE), each selected every round. A client
// answers its Task at once with the same pre-encoded DGC update (ratio 0.001 of
// a 1M-parameter model), so a round measures how fast the server takes C
// updates in: updates_per_s = acked updates / (last Ack - first update sent)
// of the round, the median over rounds. The per-update server cost is measured
// in the same run on the same update: parse (wire::parse, what the I/O thread
// does) + StreamingAggregator::add (what a worker does), next to a bare
// compression::decode.
//
// "dashboard": the ingest case twice in one run, without and with the live
// dashboard (--http) and 4 simulated browser tabs polling its endpoints
// without pause; the round times side by side and each endpoint's latency.
//
// "async": the service in mode = "async" under the same clients
// (server_async_bench.cc).
//
// "dense": one client sends one dense fp32 update of 25M parameters (100 MB);
// mb_per_s = update bytes / (send -> Ack), median of `repeat` rounds, over
// plain TCP and over CURVE.

#include "bench/server_bench.h"

#include "bench/running_server.h"

#include "tests/http_client.h"

#include <ATen/ATen.h>
#include <spdlog/spdlog.h>
#include <sys/resource.h>

#include <algorithm>
#include <array>
#include <mutex>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>
#include <zmq.hpp>

#include "aggregation/aggregator.h"
#include "compression/compressor.h"
#include "compression/state.h"
#include "core/error.h"
#include "core/json.h"
#include "core/model_digest.h"
#include "core/threads.h"
#include "server/server.h"
#include "wire/net.h"
#include "wire/wire.h"

namespace sparrow::bench {

wire::Message message(wire::Body body) {
  wire::Message m;
  m.body = std::move(body);
  return m;
}

BenchModel bench_model(const std::string& uplink, int num_workers) {
  BenchModel out;
  at::manual_seed(3);
  out.weights = {{"w", at::randn({1000, 1000}) * 0.01}};
  out.digest = core::model_digest(std::map<std::string, std::vector<int64_t>>{{"w", {1000, 1000}}});
  compression::register_builtins();
  auto dgc = compression::make_compressor(uplink);
  compression::State st;
  out.context.name = "w";
  out.context.seed = 1;
  out.context.num_workers = num_workers;
  out.update = {{"w", dgc->encode(at::randn({1000, 1000}), st, out.context)}};
  return out;
}

std::vector<net::KeyPair> write_bench_keys(const std::filesystem::path& dir, int clients) {
  net::write_keypair(dir.string(), "server", net::generate_keypair());
  std::vector<net::KeyPair> keys(static_cast<size_t>(clients));
  for (size_t i = 0; i < keys.size(); ++i) {
    keys[i] = net::generate_keypair();
    net::write_keypair((dir / "allow").string(), "client-" + std::to_string(i), keys[i]);
  }
  return keys;
}

BenchClients connect_bench_clients(zmq::context_t& ctx, server::Server& srv, const std::vector<net::KeyPair>& keys,
                                   uint64_t max_message_bytes, const std::string& model, uint64_t digest) {
  const size_t n = keys.size();
  ctx.set(zmq::ctxopt::max_sockets, static_cast<int>(n) + 64);
  BenchClients out;
  out.socks.reserve(n);
  out.ids.resize(n);
  for (size_t i = 0; i < n; ++i) {
    out.socks.emplace_back(ctx, zmq::socket_type::dealer);
    zmq::socket_t& s = out.socks.back();
    net::make_curve_client(s, keys[i], srv.public_key());
    net::set_limits(s, max_message_bytes);
    s.connect(srv.endpoint());
    char id[32];
    std::snprintf(id, sizeof(id), "bench-%05d", static_cast<int>(i));
    out.ids[i] = id;
    wire::Hello h;
    h.client_id = id;
    h.num_samples = 100;
    h.model = model;
    h.model_digest = digest;
    h.last_round = 0;
    h.software = "sparrow-bench";
    net::send(s, message(h));
  }
  out.items.resize(n);
  for (size_t i = 0; i < n; ++i) out.items[i] = {static_cast<void*>(out.socks[i]), 0, ZMQ_POLLIN, 0};
  return out;
}

namespace {

using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

constexpr const char* kUplink = "dgc:ratio=0.001";
// Rounds >= 2 send the model change; compressed so tasks stay small (a Full
// 4 MB task to each of 1,000 clients would be 4 GB per round).
constexpr const char* kDownlink = "topk:ratio=0.001";
constexpr const char* kModel = "bench-plain";

double seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// 1,000 CURVE connections need several thousand descriptors (TCP sockets on
// both ends, ZeroMQ mailboxes).
void raise_nofile() {
  rlimit r{};
  if (getrlimit(RLIMIT_NOFILE, &r) == 0 && r.rlim_cur < r.rlim_max) {
    r.rlim_cur = r.rlim_max;
    setrlimit(RLIMIT_NOFILE, &r);
  }
}

struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& parent) {
    fs::path base = parent.empty() ? fs::temp_directory_path() : fs::path(parent);
    fs::create_directories(base);
    std::string tmpl = (base / "sparrow-bench-server-XXXXXX").string();
    SPARROW_CHECK(mkdtemp(tmpl.data()) != nullptr, "cannot create a temporary folder under " << base);
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

server::ServerConfig base_config(const fs::path& dir, const std::string& name, bool curve) {
  server::ServerConfig c;
  c.listen = "tcp://127.0.0.1:*";
  c.insecure = !curve;
  c.model = kModel;
  c.db = (dir / (name + ".db")).string();
  c.heartbeat_ms = 60000;  // the load generator does not heartbeat
  c.round_deadline_s = 120;
  return c;
}

void send_bytes(zmq::socket_t& s, const std::string& bytes) {
  // Zero-copy: the buffer outlives the send (the caller keeps it until the
  // reply), so the figure is the transport's and the server's, not a memcpy.
  zmq::message_t m(const_cast<char*>(bytes.data()), bytes.size(), nullptr, nullptr);
  s.send(m, zmq::send_flags::none);
}

// ---- ingest ------------------------------------------------------------------

struct RoundStats {
  std::optional<Clock::time_point> first_sent;
  Clock::time_point last_ack;
  uint64_t sent = 0, acked = 0;
};

// Median of per-batch means (batches of `per` calls), in milliseconds per call.
template <class F>
double time_per_call_ms(F&& f, int batches, int per) {
  std::vector<double> t;
  f();  // warm-up
  for (int b = 0; b < batches; ++b) {
    auto t0 = Clock::now();
    for (int i = 0; i < per; ++i) f();
    t.push_back(seconds(t0, Clock::now()) * 1e3 / per);
  }
  return median(t);
}

// Browser tabs on the dashboard while the ingest runs (the "dashboard" case).
// Paced (flood = false): each tab polls as the page does, progress and the
// rounds after the last it holds every second, the client table every third
// second. Flood: each tab polls those and /metrics, always the whole round
// history, as fast as the server answers. Latencies and
// response sizes per endpoint.
class DashboardLoad {
 public:
  DashboardLoad(int port, int tabs, bool flood) {
    for (int t = 0; t < tabs; ++t)
      threads_.emplace_back([this, port, flood, t] {
        int64_t since = 0;
        // Paced tabs start spread over the first second, as tabs opened at different times.
        if (!flood) pause(std::chrono::milliseconds(97 * t % 1000));
        for (int cycle = 0; !stop_.load(); ++cycle) {
          for (size_t e = 0; e < kPaths.size() && !stop_.load(); ++e) {
            // Paced tabs ask what the page asks: no /metrics, the client table every third second.
            if (!flood && (e == 3 || (e == 2 && cycle % 3 != 0))) continue;
            std::string path = kPaths[e];
            if (e == 1) path += std::to_string(since);
            const auto t0 = Clock::now();
            const std::string r = testing_get(port, path);
            const double ms = seconds(t0, Clock::now()) * 1e3;
            if (e == 1 && !flood) {  // the page asks only for rounds after the last it holds
              const size_t at = r.rfind("{\"round\":");
              if (at != std::string::npos) since = std::max<int64_t>(since, std::stoll(r.substr(at + 9)));
            }
            std::lock_guard<std::mutex> g(mu_);
            ms_[e].push_back(ms);
            bytes_[e] += r.size();
            if (r.rfind("HTTP/1.1 200", 0) != 0) ++failed_;
          }
          if (!flood) pause(std::chrono::milliseconds(1000));
        }
      });
  }
  void pause(std::chrono::milliseconds d) {
    const auto until = Clock::now() + d;
    while (!stop_.load() && Clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ~DashboardLoad() { stop(); }
  void stop() {
    stop_ = true;
    for (auto& t : threads_)
      if (t.joinable()) t.join();
  }
  // {"progress":{"requests":..,"median_ms":..,"p99_ms":..,"bytes":..},...}
  std::string json() {
    std::lock_guard<std::mutex> g(mu_);
    std::ostringstream o;
    o << "{";
    for (size_t e = 0; e < kPaths.size(); ++e) {
      std::vector<double> v = ms_[e];
      std::sort(v.begin(), v.end());
      const double p99 = v.empty() ? 0 : v[std::min(v.size() - 1, v.size() * 99 / 100)];
      o << (e ? "," : "") << "\"" << kNames[e] << "\":{\"requests\":" << v.size()
        << ",\"median_ms\":" << json_number(v.empty() ? 0 : v[v.size() / 2]) << ",\"p99_ms\":" << json_number(p99)
        << ",\"bytes_per_response\":" << (v.empty() ? 0 : bytes_[e] / v.size()) << "}";
    }
    o << ",\"failed\":" << failed_ << "}";
    return o.str();
  }

 private:
  static std::string testing_get(int port, const std::string& path) { return sparrow::testing::http_get(port, path); }
  const std::array<std::string, 4> kPaths{"/api/progress", "/api/rounds?since=", "/api/clients?limit=200", "/metrics"};
  const std::array<const char*, 4> kNames{"progress", "rounds", "clients", "metrics"};
  std::vector<std::thread> threads_;
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::array<std::vector<double>, 4> ms_;
  std::array<uint64_t, 4> bytes_{};
  uint64_t failed_ = 0;
};

// The median round ingest seconds of the last bench_ingest.
double g_median_round_s = 0;

int bench_ingest(const ServerBenchOptions& o, const fs::path& dir, int tabs = -1, bool flood = false) {
  // tabs < 0: no dashboard; >= 0: the dashboard on, with that many polling tabs.
  const int C = o.clients;
  const BenchModel model = bench_model(kUplink, C);
  const server::Weights& weights = model.weights;
  const std::vector<wire::NamedTensor>& tensors = model.update;
  const std::vector<net::KeyPair> keys = write_bench_keys(dir, C);
  server::ServerConfig cfg = base_config(dir, "ingest", /*curve=*/true);
  cfg.server_key = (dir / "server.key_secret").string();
  cfg.allow = (dir / "allow").string();
  cfg.compression = kUplink;
  cfg.downlink = kDownlink;
  cfg.rounds = o.rounds;
  cfg.clients_per_round = C;
  cfg.quorum = C;
  cfg.workers = o.workers;
  cfg.max_message_mb = 64;
  if (tabs >= 0) {
    cfg.http = "127.0.0.1:0";
    cfg.db = (dir / "ingest-dashboard.db").string();
  }

  RunningServer srv(cfg, weights);
  std::unique_ptr<DashboardLoad> load;
  if (tabs > 0) {
    const std::string url = srv.get().dashboard_url();  // http://127.0.0.1:PORT/
    load = std::make_unique<DashboardLoad>(std::stoi(url.substr(url.rfind(':') + 1)), tabs, flood);
  }
  const uint64_t digest = model.digest;
  SPARROW_CHECK(digest == srv.get().model_digest(), "model digest differs from the server's");

  zmq::context_t cctx(1);
  const auto t_connect = Clock::now();
  BenchClients clients = connect_bench_clients(cctx, srv.get(), keys, cfg.max_message_bytes(), kModel, digest);
  std::vector<zmq::socket_t>& socks = clients.socks;
  const std::vector<std::string>& ids = clients.ids;
  std::vector<zmq::pollitem_t>& items = clients.items;
  std::map<uint64_t, RoundStats> rounds;
  uint64_t welcomed = 0, errors = 0, sent = 0, acked = 0;
  size_t update_bytes = 0;
  double connect_s = 0;
  wire::ParseLimits limits;
  limits.max_bytes = cfg.max_message_bytes();
  const uint64_t want = static_cast<uint64_t>(C) * static_cast<uint64_t>(o.rounds);
  const auto give_up = Clock::now() + std::chrono::seconds(120 + C * o.rounds / 20);
  while (acked + errors < want && !srv.done() && Clock::now() < give_up) {
    zmq::poll(items.data(), items.size(), std::chrono::milliseconds(100));
    for (int i = 0; i < C; ++i) {
      if (!(items[static_cast<size_t>(i)].revents & ZMQ_POLLIN)) continue;
      zmq::socket_t& s = socks[static_cast<size_t>(i)];
      for (;;) {
        std::optional<wire::Message> m = net::receive(s, 0, limits);
        if (!m) break;
        const auto now = Clock::now();
        if (std::holds_alternative<wire::Welcome>(m->body)) {
          if (++welcomed == static_cast<uint64_t>(C)) connect_s = seconds(t_connect, now);
        } else if (const auto* t = std::get_if<wire::Task>(&m->body)) {
          wire::ModelUpdate u;
          u.round = t->round;
          u.client_id = ids[static_cast<size_t>(i)];
          u.num_samples = 100;
          u.tensors = tensors;
          const std::string bytes = wire::serialize(message(std::move(u)));
          update_bytes = bytes.size();
          RoundStats& rs = rounds[t->round];
          if (!rs.first_sent) rs.first_sent = Clock::now();
          s.send(zmq::buffer(bytes), zmq::send_flags::none);
          rs.sent++;
          sent++;
        } else if (const auto* a = std::get_if<wire::Ack>(&m->body)) {
          RoundStats& rs = rounds[a->round];
          rs.acked++;
          rs.last_ack = now;
          acked++;
        } else if (const auto* e = std::get_if<wire::ErrorBody>(&m->body)) {
          if (errors++ < 5)
            std::cerr << "sparrow-bench: server error to " << ids[static_cast<size_t>(i)] << ": "
                      << wire::error_code_name(e->code) << ": " << e->message << "\n";
        }
      }
    }
  }
  if (load) load->stop();
  const server::Counters counters = srv.get().counters();
  if (!srv.error().empty()) std::cerr << "sparrow-bench: server failed: " << srv.error() << "\n";

  std::vector<double> rate, round_s;
  uint64_t acked_timed = 0;
  double total_s = 0;
  for (const auto& [r, rs] : rounds) {
    if (!rs.first_sent || rs.acked == 0) continue;
    const double d = seconds(*rs.first_sent, rs.last_ack);
    round_s.push_back(d);
    rate.push_back(static_cast<double>(rs.acked) / d);
    acked_timed += rs.acked;
    total_s += d;
  }
  const double ups = median(rate);
  g_median_round_s = median(round_s);

  // Same update, same run: the server's per-update work against a bare decode.
  const std::string bytes = [&] {
    wire::ModelUpdate u;
    u.round = 1;
    u.client_id = ids[0];
    u.num_samples = 100;
    u.tensors = tensors;
    return wire::serialize(message(std::move(u)));
  }();
  aggregation::StreamingAggregator agg({{"w", {1000, 1000}}});
  aggregation::ContextMap contexts;
  contexts["w"] = model.context;
  contexts["w"].round = 1;
  aggregation::EncodedUpdate eu{{"w", tensors[0].tensor}};
  wire::ParseLimits plimits;
  plimits.max_elements = 3u << 20;
  const int per = 200, batches = 15;
  const double parse_ms = time_per_call_ms(
      [&] {
        volatile size_t n = wire::parse(bytes, plimits).minor;
        (void)n;
      },
      batches, per);
  const double add_ms = time_per_call_ms([&] { agg.add(eu, 100.0, contexts); }, batches, per);
  const double decode_ms = time_per_call_ms(
      [&] {
        at::Tensor d = compression::decode(tensors[0].tensor, contexts["w"]);
        (void)d;
      },
      batches, per);

  std::ostringstream rs;
  for (size_t i = 0; i < round_s.size(); ++i) rs << (i ? "," : "") << json_number(round_s[i]);
  std::cout << "{\"bench\":\"server\",\"case\":\"ingest\",\"dashboard\":" << (tabs >= 0 ? "true" : "false")
            << ",\"dashboard_tabs\":" << std::max(tabs, 0) << ",\"dashboard_flood\":" << (flood ? "true" : "false")
            << (load ? ",\"dashboard_load\":" + load->json() : std::string()) << ",\"curve\":true,\"clients\":" << C
            << ",\"rounds\":" << o.rounds << ",\"params\":1000000,\"uplink\":\"" << kUplink << "\",\"downlink\":\""
            << kDownlink << "\",\"workers\":" << o.workers << ",\"update_bytes\":" << update_bytes
            << ",\"connect_s\":" << json_number(connect_s) << ",\"round_ingest_s\":[" << rs.str() << "]"
            << ",\"updates_per_s\":" << json_number(ups)
            << ",\"updates_per_s_all\":" << json_number(total_s > 0 ? static_cast<double>(acked_timed) / total_s : 0.0)
            << ",\"mb_per_s\":" << json_number(ups * static_cast<double>(update_bytes) / 1e6) << ",\"sent\":" << sent
            << ",\"acked\":" << acked << ",\"lost_updates\":" << (sent - acked) << ",\"errors\":" << errors
            << ",\"server_accepted\":" << counters.updates_accepted << ",\"server_rejected\":" << counters.rejected()
            << ",\"server_stale\":" << counters.stale << ",\"send_failures\":" << counters.send_failures
            << ",\"parse_ms\":" << json_number(parse_ms) << ",\"aggregate_ms\":" << json_number(add_ms)
            << ",\"decode_aggregate_ms\":" << json_number(parse_ms + add_ms)
            << ",\"bare_decode_ms\":" << json_number(decode_ms) << "}" << std::endl;
  const bool ok = srv.error().empty() && sent == want && acked == want;
  return ok ? 0 : 1;
}

// ---- dense -------------------------------------------------------------------

// Baseline for an acknowledged ingest: the same bytes DEALER -> ROUTER over
// bare ZeroMQ, a receiving thread (polling, as the server's I/O thread does)
// answers each message with a 16-byte Ack; transfer() gives the seconds from
// send to Ack. dense_once() runs one such transfer right before each update it
// sends the server (the server idle, waiting for it), so both see the same
// moment of the machine: on a shared VM the transfer rate drifts by a third
// within a minute, more than the difference being measured.
class BareAcked {
 public:
  BareAcked(size_t max_bytes, bool curve)
      : sctx_(1), cctx_(1), r_(sctx_, zmq::socket_type::router), d_(cctx_, zmq::socket_type::dealer) {
    if (curve) {  // no ZAP handler on sctx_: libzmq admits every client key
      const net::KeyPair sk = net::generate_keypair(), ck = net::generate_keypair();
      net::make_curve_server(r_, sk);
      net::make_curve_client(d_, ck, sk.public_key);
    }
    net::set_limits(r_, max_bytes + 1024);
    net::set_limits(d_, max_bytes + 1024);
    r_.bind("tcp://127.0.0.1:*");
    d_.connect(r_.get(zmq::sockopt::last_endpoint));
    receiver_ = std::thread([this] {
      while (!stop_.load()) {
        zmq::pollitem_t item{static_cast<void*>(r_), 0, ZMQ_POLLIN, 0};
        zmq::poll(&item, 1, std::chrono::milliseconds(2));
        if (!(item.revents & ZMQ_POLLIN)) continue;
        zmq::message_t id, m;
        if (!r_.recv(id) || !r_.recv(m)) return;
        const std::string ack(16, 'a');
        r_.send(id, zmq::send_flags::sndmore);
        r_.send(zmq::buffer(ack), zmq::send_flags::none);
      }
    });
  }
  ~BareAcked() {
    stop_.store(true);
    receiver_.join();
  }
  double transfer(const std::string& bytes) {
    const auto t0 = Clock::now();
    send_bytes(d_, bytes);
    zmq::message_t ack;
    SPARROW_CHECK(d_.recv(ack) && ack.size() == 16, "bare acknowledged transfer failed");
    return seconds(t0, Clock::now());
  }

 private:
  zmq::context_t sctx_, cctx_;
  zmq::socket_t r_, d_;
  std::atomic<bool> stop_{false};
  std::thread receiver_;
};

// Median seconds from send to Ack of `repeat` dense updates over one transport.
// With `bare`, one bare acknowledged transfer of the same bytes runs right
// before each update (medians of both returned: {server, bytes, bare}).
struct DenseTimes {
  double seconds = 0;
  size_t bytes = 0;
  double bare_acked_s = 0;
  // Median over the updates of (its bare transfer's seconds / its own): each
  // server update against the bare transfer taken just before it, so drift
  // of the machine's speed between updates cancels.
  double paired_ratio = 0;
};
DenseTimes dense_once(const ServerBenchOptions& o, const fs::path& dir, bool curve, const server::Weights& weights,
                      const wire::NamedTensor& update, BareAcked* bare, double max_update_norm = -1) {
  const std::string name = std::string(curve ? "dense-curve" : "dense-plain") + (max_update_norm >= 0 ? "-nb" : "");
  server::ServerConfig cfg = base_config(dir, name, curve);
  if (max_update_norm >= 0) cfg.max_update_norm = max_update_norm;
  net::KeyPair ck;
  if (curve) {
    net::KeyPair sk = net::generate_keypair();
    ck = net::generate_keypair();
    net::write_keypair(dir.string(), name + "-server", sk);
    net::write_keypair((dir / (name + "-allow")).string(), "client", ck);
    cfg.server_key = (dir / (name + "-server.key_secret")).string();
    cfg.allow = (dir / (name + "-allow")).string();
  }
  cfg.rounds = o.repeat;
  cfg.clients_per_round = 1;
  cfg.quorum = 1;
  cfg.workers = o.workers;
  cfg.max_message_mb = 512;
  RunningServer srv(cfg, weights);

  zmq::context_t cctx(1);
  zmq::socket_t s(cctx, zmq::socket_type::dealer);
  if (curve) net::make_curve_client(s, ck, srv.get().public_key());
  net::set_limits(s, cfg.max_message_bytes());
  s.connect(srv.get().endpoint());
  wire::Hello h;
  h.client_id = "bench-dense";
  h.num_samples = 100;
  h.model = kModel;
  h.model_digest = srv.get().model_digest();
  h.last_round = 0;
  h.software = "sparrow-bench";
  net::send(s, message(h));

  wire::ParseLimits limits;
  limits.max_bytes = cfg.max_message_bytes();
  limits.max_elements = uint64_t{1} << 28;
  std::vector<double> t, tb;
  size_t bytes_sent = 0;
  std::string bytes;
  Clock::time_point t0;
  const auto give_up = Clock::now() + std::chrono::seconds(60 + 30 * o.repeat);
  while (static_cast<int>(t.size()) < o.repeat && !srv.done() && Clock::now() < give_up) {
    std::optional<wire::Message> m = net::receive(s, 200, limits);
    if (!m) continue;
    if (const auto* task = std::get_if<wire::Task>(&m->body)) {
      wire::ModelUpdate u;
      u.round = task->round;
      u.client_id = h.client_id;
      u.num_samples = 100;
      u.tensors = {update};
      bytes = wire::serialize(message(std::move(u)));
      bytes_sent = bytes.size();
      if (bare) tb.push_back(bare->transfer(bytes));
      t0 = Clock::now();
      send_bytes(s, bytes);
    } else if (const auto* a = std::get_if<wire::Ack>(&m->body)) {
      t.push_back(seconds(t0, Clock::now()));
      // Hold W_r from now on, so the next Task is an empty Delta (as a
      // client that follows the model would) instead of a Full 100 MB model.
      h.last_round = a->round;
      net::send(s, message(h));
    } else if (const auto* e = std::get_if<wire::ErrorBody>(&m->body)) {
      std::cerr << "sparrow-bench: dense: server error: " << wire::error_code_name(e->code) << ": " << e->message
                << "\n";
    }
  }
  if (!srv.error().empty()) std::cerr << "sparrow-bench: server failed: " << srv.error() << "\n";
  SPARROW_CHECK(static_cast<int>(t.size()) == o.repeat,
                "dense (" << name << "): " << t.size() << " of " << o.repeat << " updates acknowledged");
  std::vector<double> ratio;
  for (size_t i = 0; i < tb.size() && i < t.size(); ++i) ratio.push_back(tb[i] / t[i]);
  return {median(t), bytes_sent, tb.empty() ? 0.0 : median(tb), ratio.empty() ? 0.0 : median(ratio)};
}

// Baseline: the same bytes DEALER -> ROUTER over bare ZeroMQ (same socket
// options, no server), median seconds per message.
double bare_transfer_s(const std::string& bytes, bool curve, int repeat) {
  zmq::context_t sctx(1), cctx(1);
  zmq::socket_t r(sctx, zmq::socket_type::router), d(cctx, zmq::socket_type::dealer);
  if (curve) {
    // No ZAP handler on sctx: libzmq admits every client key.
    const net::KeyPair sk = net::generate_keypair(), ck = net::generate_keypair();
    net::make_curve_server(r, sk);
    net::make_curve_client(d, ck, sk.public_key);
  }
  net::set_limits(r, bytes.size() + 1024);
  net::set_limits(d, bytes.size() + 1024);
  r.bind("tcp://127.0.0.1:*");
  d.connect(r.get(zmq::sockopt::last_endpoint));
  std::vector<double> t;
  for (int i = 0; i < repeat; ++i) {
    const auto t0 = Clock::now();
    send_bytes(d, bytes);
    zmq::message_t id, m;
    SPARROW_CHECK(r.recv(id) && r.recv(m) && m.size() == bytes.size(), "bare transfer failed");
    t.push_back(seconds(t0, Clock::now()));
  }
  return median(t);
}

int bench_dense(const ServerBenchOptions& o, const fs::path& dir) {
  const int64_t n = 25000000;  // 100 MB of fp32
  at::manual_seed(4);
  server::Weights weights{{"w", at::zeros({5000, 5000})}};
  compression::register_builtins();
  auto none = compression::make_compressor("none");
  compression::State st;
  compression::Context ctx;
  ctx.name = "w";
  wire::NamedTensor update{"w", none->encode(at::randn({5000, 5000}) * 0.01, st, ctx)};
  DenseTimes plain, curve, unbounded;
  {
    BareAcked pair(static_cast<size_t>(n) * 4 + 4096, false);  // its receiver stops before the CURVE rounds
    plain = dense_once(o, dir, false, weights, update, &pair);
    // The same without the admission norm bound (max_update_norm = 0): what
    // the bound's extra read of the values costs end to end.
    unbounded = dense_once(o, dir, false, weights, update, nullptr, 0.0);
  }
  {
    BareAcked pair(static_cast<size_t>(n) * 4 + 4096, true);
    curve = dense_once(o, dir, true, weights, update, &pair);
  }
  const double plain_s = plain.seconds, bare_acked = plain.bare_acked_s;
  const size_t bytes = plain.bytes;
  const double curve_s = curve.seconds;
  // The server's own work on the same update in this process (no transport):
  // wire::parse (verification + copy out of the frame) and the aggregation.
  double parse_s = 0, parse_copy_s = 0, add_s = 0, fill_s = 0, bare_s = 0, bare_curve_s = 0;
  double bounded_add_s = 0, bounded_fill_s = 0;
  bool in_place = false;
  {
    wire::ModelUpdate u;
    u.round = 1;
    u.client_id = "bench-dense";
    u.num_samples = 100;
    u.tensors = {update};
    const std::string b = wire::serialize(message(std::move(u)));
    wire::ParseLimits limits;
    limits.max_bytes = b.size() + 1;
    aggregation::StreamingAggregator agg({{"w", {5000, 5000}}});
    aggregation::StreamingAggregator bounded({{"w", {5000, 5000}}});  // as the server's default
    bounded.set_max_update_norm(server::ServerConfig().max_update_norm);
    std::vector<double> tp, tc, ta, tf, tbf, tba;
    // The frame as the server's worker holds it (a ZeroMQ message, whose data
    // sits where libzmq puts it): values stay in it (views), and their
    // finiteness is checked by the aggregator (as in the server's workers).
    const auto frame = std::make_shared<zmq::message_t>(b.data(), b.size());
    wire::ParseLimits deferred = limits;
    deferred.update_values = compression::ValueCheck::kDeferDenseF32;
    auto parse_in_place = [&] {
      wire::Message m = wire::parse(frame->data(), frame->size(), deferred, frame);
      auto& mu = std::get<wire::ModelUpdate>(m.body);
      in_place = mu.tensors[0].tensor.values.is_view();
      return aggregation::EncodedUpdate{{"w", std::move(mu.tensors[0].tensor)}};
    };
    for (int r = 0; r < o.repeat; ++r) {
      auto t0 = Clock::now();
      (void)wire::parse(b, limits);  // values copied out (no owner) and scanned
      tc.push_back(seconds(t0, Clock::now()));
      t0 = Clock::now();
      aggregation::EncodedUpdate eu = parse_in_place();
      tp.push_back(seconds(t0, Clock::now()));
      // The first update of a worker's partial in a round: scanned, then held
      // (a view of the frame; nothing written).
      agg.reset();
      t0 = Clock::now();
      agg.add(eu, 100.0);
      tf.push_back(seconds(t0, Clock::now()));
      // The second: written with the held one in one pass, scanned as it is read.
      eu = parse_in_place();
      t0 = Clock::now();
      agg.add(eu, 100.0);
      ta.push_back(seconds(t0, Clock::now()));
      // The same two adds under the admission norm bound.
      bounded.reset();
      eu = parse_in_place();
      t0 = Clock::now();
      bounded.add(eu, 100.0);
      tbf.push_back(seconds(t0, Clock::now()));
      eu = parse_in_place();
      t0 = Clock::now();
      bounded.add(eu, 100.0);
      tba.push_back(seconds(t0, Clock::now()));
    }
    parse_s = median(tp);
    parse_copy_s = median(tc);
    add_s = median(ta);
    fill_s = median(tf);
    bounded_add_s = median(tba);
    bounded_fill_s = median(tbf);
    bare_s = bare_transfer_s(b, false, o.repeat);
    bare_curve_s = bare_transfer_s(b, true, o.repeat);
  }
  const double mb = static_cast<double>(bytes) / 1e6;
  std::cout << "{\"bench\":\"server\",\"case\":\"dense\",\"params\":" << n << ",\"update_bytes\":" << bytes
            << ",\"repeat\":" << o.repeat << ",\"workers\":" << o.workers << ",\"seconds\":" << json_number(plain_s)
            << ",\"mb_per_s\":" << json_number(mb / plain_s) << ",\"curve_seconds\":" << json_number(curve_s)
            << ",\"curve_mb_per_s\":" << json_number(mb / curve_s) << ",\"parse_s\":" << json_number(parse_s)
            << ",\"parse_in_place\":" << (in_place ? "true" : "false")
            << ",\"parse_copy_s\":" << json_number(parse_copy_s) << ",\"aggregate_s\":" << json_number(add_s)
            << ",\"first_aggregate_s\":" << json_number(fill_s)
            << ",\"aggregate_norm_bound_s\":" << json_number(bounded_add_s)
            << ",\"first_aggregate_norm_bound_s\":" << json_number(bounded_fill_s)
            << ",\"seconds_no_norm_bound\":" << json_number(unbounded.seconds)
            << ",\"bare_zmq_mb_per_s\":" << json_number(mb / bare_s)
            << ",\"bare_curve_mb_per_s\":" << json_number(mb / bare_curve_s)
            << ",\"bare_acked_mb_per_s\":" << json_number(mb / bare_acked)
            << ",\"vs_bare_acked\":" << json_number(bare_acked / plain_s)
            << ",\"vs_bare_acked_paired\":" << json_number(plain.paired_ratio)
            << ",\"vs_bare\":" << json_number(bare_s / plain_s)
            << ",\"curve_vs_bare\":" << json_number(bare_curve_s / curve_s)
            << ",\"bare_curve_acked_mb_per_s\":" << json_number(mb / curve.bare_acked_s)
            << ",\"curve_vs_bare_acked\":" << json_number(curve.bare_acked_s / curve_s)
            << ",\"curve_vs_bare_acked_paired\":" << json_number(curve.paired_ratio) << ",\"malloc\":\""
            << (core::allocator_tuned_for_messages() ? "reuse" : "system") << "\"}" << std::endl;
  return 0;
}

}  // namespace

int bench_server(const ServerBenchOptions& o) {
  {
    std::stringstream ss(o.cases);
    for (std::string c; std::getline(ss, c, ',');)
      SPARROW_CHECK_T(ConfigError, c == "ingest" || c == "dense" || c == "dashboard" || c == "async",
                      "--cases: unknown case '" << c << "' (ingest, dense, dashboard, async)");
  }
  raise_nofile();
  // 1,000 Hellos would log 1,000 lines; SPARROW_BENCH_DEBUG=1 shows them.
  spdlog::set_level(std::getenv("SPARROW_BENCH_DEBUG") ? spdlog::level::debug : spdlog::level::warn);
  TempDir dir(o.tmp);
  int rc = 0;
  const std::string cases = "," + o.cases + ",";
  if (cases.find(",ingest,") != std::string::npos) rc |= bench_ingest(o, dir.path);
  if (cases.find(",dense,") != std::string::npos) rc |= bench_dense(o, dir.path);
  if (cases.find(",async,") != std::string::npos) {
    TempDir a(o.tmp), b(o.tmp);
    rc |= bench_async(o, a.path, std::max(1, o.clients / 10));
    rc |= bench_async(o, b.path, o.clients);
  }
  if (cases.find(",dashboard,") != std::string::npos) {
    // The same ingest without the dashboard, with it and 20 tabs polling at
    // the page's cadence, and with 4 tabs polling without pause: what
    // watching a 1,000-client server costs its rounds.
    TempDir a(o.tmp), b(o.tmp), c(o.tmp);
    rc |= bench_ingest(o, a.path);
    const double without = g_median_round_s;
    rc |= bench_ingest(o, b.path, 20, false);
    const double paced = g_median_round_s;
    rc |= bench_ingest(o, c.path, 4, true);
    const double flood = g_median_round_s;
    std::cout << "{\"bench\":\"server\",\"case\":\"dashboard\",\"clients\":" << o.clients << ",\"rounds\":" << o.rounds
              << ",\"round_ingest_s_without\":" << json_number(without)
              << ",\"round_ingest_s_paced_20_tabs\":" << json_number(paced)
              << ",\"round_ingest_s_flood_4_tabs\":" << json_number(flood)
              << ",\"paced_vs_without\":" << json_number(without > 0 ? paced / without : 0.0)
              << ",\"flood_vs_without\":" << json_number(without > 0 ? flood / without : 0.0) << "}" << std::endl;
  }
  return rc;
}

}  // namespace sparrow::bench
