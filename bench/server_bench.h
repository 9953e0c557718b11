#pragma once
// sparrow-bench server (see server_bench.cc and docs/performance.md, "Server").

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>
#include <zmq.hpp>

#include "compression/compressor.h"
#include "server/server.h"
#include "wire/net.h"
#include "wire/wire.h"

namespace sparrow::bench {

struct ServerBenchOptions {
  int clients = 1000;  // concurrent client connections of the ingest case
  int rounds = 3;      // ingest rounds (every connection is selected each round)
  int repeat = 5;      // dense updates per transport (median reported)
  int workers = 2;     // the server's decode/aggregate pool
  std::string cases = "ingest,dense";
  std::string tmp;  // parent of the temporary key/database folder ("" = the system temp dir)
};

// Runs a real sparrow::server::Server in-process on 127.0.0.1 and a load
// generator against it; prints one JSON line per case ("ingest", "dense",
// "dashboard", "async").
int bench_server(const ServerBenchOptions& opts);
// The "async" case (server_async_bench.cc): mode = "async" with `buffer`
// under `clients` CURVE clients, keys and database in `dir`; one JSON line.
int bench_async(const ServerBenchOptions& opts, const std::filesystem::path& dir, int buffer);

// ---- shared by the ingest and async cases (defined in server_bench.cc) ----

wire::Message message(wire::Body body);

// The model of the ingest and async cases, one 1000 x 1000 matrix (2-D, so
// DGC sparsifies it), and the update every client sends: `uplink` of a
// random gradient, encoded for num_workers. Seeded: the same each run.
struct BenchModel {
  server::Weights weights;
  uint64_t digest = 0;  // core::model_digest of the weights' shapes
  std::vector<wire::NamedTensor> update;
  compression::Context context;  // the update's, as the server decodes it
};
BenchModel bench_model(const std::string& uplink, int num_workers);

// Writes the server's key pair to dir and one per client to dir/allow (a
// directory of certificates: a Z85 key may contain '#', which a list file
// reads as a comment); returns the clients' pairs.
std::vector<net::KeyPair> write_bench_keys(const std::filesystem::path& dir, int clients);

// One CURVE DEALER per key, connected to srv, each having sent its Hello as
// sparrow-client does (last_round 0: it holds W_0, so its first Task is an
// empty Delta). ctx must outlive the sockets.
struct BenchClients {
  std::vector<zmq::socket_t> socks;
  std::vector<std::string> ids;        // "bench-NNNNN", by socket
  std::vector<zmq::pollitem_t> items;  // ZMQ_POLLIN on each socket
};
BenchClients connect_bench_clients(zmq::context_t& ctx, server::Server& srv, const std::vector<net::KeyPair>& keys,
                                   uint64_t max_message_bytes, const std::string& model, uint64_t digest);

}  // namespace sparrow::bench
