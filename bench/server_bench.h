#pragma once
// sparrow-bench server (see server_bench.cc and docs/performance.md, "Server").

#include <filesystem>
#include <string>

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

}  // namespace sparrow::bench
