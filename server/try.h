#pragma once
// `sparrow-server try`: a whole deployment on this machine in one command, for
// trying the service: keys, a server and N sparrow-client processes on
// loopback with CurveZMQ, each client training on its own shard of
// Fashion-MNIST; stops cleanly (Ctrl-C included) and says where everything is.

#include <atomic>
#include <string>

namespace sparrow::server {

struct TryOptions {
  std::string dir = "sparrow-try";  // keys, configs, database and logs (must not hold an earlier try unless force)
  int clients = 3;
  int rounds = 5;
  int shards = 20;  // the training set is cut into this many shards; client i takes shard i
  std::string model = "mlp";
  std::string compression = "dgc:ratio=0.01";
  bool force = false;
  std::string http;  // HOST:PORT of the live dashboard; empty = none
};

// Runs it; returns the exit status (core/cli.h). `stop` (set by a signal
// handler) ends it early: the server stops, the clients are told to stop.
int run_try(const TryOptions& o, std::atomic<bool>& stop);

}  // namespace sparrow::server
