// sparrow-bench server, case "async": sparrow-server in mode = "async"
// (docs/async.md) under C CurveZMQ clients, as the "ingest" case drives the
// synchronous server (server_bench.cc): the real server::Server in this
// process, a load generator on the calling thread speaking the protocol as
// sparrow-client does. Every client is always busy (max_concurrency = C): it
// answers each Task at once with the same DGC update of the 1M-parameter
// model, and is handed the then-current version after its Ack. The server
// steps every `buffer` updates: C / 10 (FedBuff's regime: a client is handed
// a version several steps after its last one, so its task is the whole
// model), and C (every client trains each version: tasks are the downlink's
// small delta, so the figure is the fold and the durable writes). updates_per_s = acked updates /
// (last Ack - first update sent), over every update: what the service
// sustains, durable writes and steps included. A task is the whole model
// unless the client holds the version before (then the downlink's delta).
#include <ATen/ATen.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <optional>
#include <string>
#include <vector>
#include <zmq.hpp>

#include "bench/running_server.h"
#include "bench/server_bench.h"
#include "compression/compressor.h"
#include "compression/state.h"
#include "core/error.h"
#include "core/json.h"
#include "core/model_digest.h"
#include "server/server.h"
#include "wire/net.h"
#include "wire/wire.h"

namespace sparrow::bench {
namespace {
using Clock = std::chrono::steady_clock;
double seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }
}  // namespace

int bench_async(const ServerBenchOptions& o, const std::filesystem::path& dir, int buffer) {
  const int C = o.clients;
  const int steps = std::max(1, o.rounds * C / buffer);  // as many updates as the ingest case's rounds
  const char* uplink = "dgc:ratio=0.001";
  const char* downlink = "topk:ratio=0.001";
  const BenchModel model = bench_model(uplink, buffer);
  const std::vector<wire::NamedTensor>& tensors = model.update;
  const std::vector<net::KeyPair> keys = write_bench_keys(dir, C);

  server::ServerConfig cfg;
  cfg.listen = "tcp://127.0.0.1:*";
  cfg.model = "bench-plain";
  cfg.db = (dir / "async.db").string();
  cfg.heartbeat_ms = 60000;  // the load generator does not heartbeat
  cfg.round_deadline_s = 120;
  cfg.server_key = (dir / "server.key_secret").string();
  cfg.allow = (dir / "allow").string();
  cfg.compression = uplink;
  cfg.downlink = downlink;
  cfg.mode = "async";
  cfg.rounds = steps;
  cfg.clients_per_round = C;  // min_clients: every client connected before the first task
  cfg.buffer = buffer;
  cfg.max_concurrency = C;
  cfg.workers = o.workers;
  cfg.max_message_mb = 64;

  RunningServer srv(cfg, model.weights);
  const uint64_t digest = model.digest;
  SPARROW_CHECK(digest == srv.get().model_digest(), "model digest differs from the server's");
  zmq::context_t cctx(1);
  BenchClients clients = connect_bench_clients(cctx, srv.get(), keys, cfg.max_message_bytes(), cfg.model, digest);
  std::vector<zmq::socket_t>& socks = clients.socks;
  const std::vector<std::string>& ids = clients.ids;
  std::vector<zmq::pollitem_t>& items = clients.items;
  uint64_t sent = 0, acked = 0, errors = 0, tasks = 0, full_tasks = 0;
  uint64_t task_bytes = 0;
  size_t update_bytes = 0;
  std::optional<Clock::time_point> first_sent;
  Clock::time_point last_ack{};
  wire::ParseLimits limits;
  limits.max_bytes = cfg.max_message_bytes();
  const uint64_t want = static_cast<uint64_t>(steps) * static_cast<uint64_t>(buffer);
  const auto give_up = Clock::now() + std::chrono::seconds(300 + steps * 5);
  // Until the server finished (its last Acks drained for a moment after).
  std::optional<Clock::time_point> drain;
  while (acked < want && Clock::now() < give_up && (!drain || Clock::now() < *drain)) {
    if (srv.done() && !drain) drain = Clock::now() + std::chrono::seconds(5);  // the last Acks, behind tasks
    zmq::poll(items.data(), items.size(), std::chrono::milliseconds(100));
    for (int i = 0; i < C; ++i) {
      if (!(items[static_cast<size_t>(i)].revents & ZMQ_POLLIN)) continue;
      zmq::socket_t& s = socks[static_cast<size_t>(i)];
      for (;;) {
        zmq::message_t frame;
        if (!s.recv(frame, zmq::recv_flags::dontwait)) break;
        const std::string raw(static_cast<const char*>(frame.data()), frame.size());
        wire::Message m = wire::parse(raw, limits);
        if (const auto* t = std::get_if<wire::Task>(&m.body)) {
          ++tasks;
          task_bytes += raw.size();
          full_tasks += t->model_encoding == wire::ModelEncoding::kFull;
          wire::ModelUpdate u;
          u.round = t->round;  // the version it starts from, + 1
          u.client_id = ids[static_cast<size_t>(i)];
          u.num_samples = 100;
          u.tensors = tensors;
          const std::string bytes = wire::serialize(message(std::move(u)));
          update_bytes = bytes.size();
          if (!first_sent) first_sent = Clock::now();
          s.send(zmq::buffer(bytes), zmq::send_flags::none);
          ++sent;
        } else if (std::holds_alternative<wire::Ack>(m.body)) {
          ++acked;
          last_ack = Clock::now();
        } else if (const auto* e = std::get_if<wire::ErrorBody>(&m.body)) {
          if (errors++ < 5)
            std::cerr << "sparrow-bench: server error to " << ids[static_cast<size_t>(i)] << ": "
                      << wire::error_code_name(e->code) << ": " << e->message << "\n";
        }
      }
    }
  }
  const server::Counters counters = srv.get().counters();
  if (!srv.error().empty()) std::cerr << "sparrow-bench: server failed: " << srv.error() << "\n";
  const double span = first_sent ? seconds(*first_sent, last_ack) : 0.0;
  const double ups = span > 0 ? static_cast<double>(acked) / span : 0.0;
  std::cout << "{\"bench\":\"server\",\"case\":\"async\",\"curve\":true,\"clients\":" << C << ",\"buffer\":" << buffer
            << ",\"max_concurrency\":" << C << ",\"steps\":" << steps << ",\"params\":1000000,\"uplink\":\"" << uplink
            << "\",\"downlink\":\"" << downlink << "\",\"workers\":" << o.workers
            << ",\"update_bytes\":" << update_bytes << ",\"seconds\":" << json_number(span)
            << ",\"updates_per_s\":" << json_number(ups) << ",\"steps_per_s\":"
            << json_number(span > 0 ? static_cast<double>(counters.rounds_completed) / span : 0.0)
            << ",\"tasks\":" << tasks << ",\"full_tasks\":" << full_tasks
            << ",\"task_mb\":" << json_number(static_cast<double>(task_bytes) / 1e6) << ",\"sent\":" << sent
            << ",\"acked\":" << acked << ",\"errors\":" << errors
            << ",\"server_accepted\":" << counters.updates_accepted << ",\"server_rejected\":" << counters.rejected()
            << ",\"server_stale\":" << counters.stale << ",\"steps_completed\":" << counters.rounds_completed << "}"
            << std::endl;
  return srv.error().empty() && acked >= want ? 0 : 1;
}

}  // namespace sparrow::bench
