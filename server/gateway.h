#pragma once
// The gateway role of sparrow-server (docs/deploy.md, "Two levels"): a server
// with `upstream` set serves its own clients as any server does (same
// protocol, CURVE, allow-list, deadline, quorum) and is itself one client of a
// root server. Each Task from the root becomes one round with the gateway's
// clients (Server::relay_round); their weighted mean delta goes back as one
// ModelUpdate with num_samples = their samples, encoded with the root's uplink
// compressor (its error feedback kept in upstream_state_db). The root sees a
// weighted participant, so FedAvg over gateways equals FedAvg over all their
// clients.
//
// Lives outside sparrow_server: the upstream link is the client's own session
// code (client/session.h), which links the trainer; the server library does not.

#include "server/config.h"

namespace sparrow::server {

class Server;

// Runs `server` (constructed from `cfg`, neither run() nor start() called) as
// a gateway until the root ends the run (true) or stop_gateway() (false).
// Throws ConfigError for a gateway config the session refuses, and Error when
// the root refuses the gateway (key, model digest).
bool run_gateway(Server& server, const ServerConfig& cfg);

// Stops run_gateway and its server soon; async-signal-safe (atomic stores).
void stop_gateway() noexcept;

}  // namespace sparrow::server
