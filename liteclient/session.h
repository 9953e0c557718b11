#pragma once
// sparrow-client-lite's session: the deployed client's side of the session
// protocol (docs/protocol.md; the same behaviour as sparrow-client's
// client/session.h) over a SessionTrainer (trainer.h) and flat float vectors,
// linking no LibTorch. One Session owns one transport::Connection to the
// server (ZeroMQ with CurveZMQ unless insecure), the trainer and the state
// file (state_file.h). run() is a single-threaded loop:
//   connect -> Hello -> Welcome -> { Heartbeat while idle | Task -> train ->
//   encode (compression/flat_codec.h) -> ModelUpdate -> Ack/Error } ->
//   Bye "run finished"
// SecAgg+ Tasks are answered with the protocol's stages (secagg/secagg.h).
//
// What survives a restart (the state file): the broadcast model B_h the
// client holds with its round and run (the next Hello reports last_round = h,
// a Delta against B_h applies), per-tensor codec state (error feedback),
// SCAFFOLD's c_i, and both from before the last update, which an unanswered
// round asked again is trained from (state_file.h). A client that holds no
// model says so (Hello without
// last_round) and gets the whole model: it cannot build the server's initial
// model from a seed without LibTorch.
//
// Reconnect: silence for 3 * heartbeat_ms, or a Bye other than "run
// finished", closes the connection and reopens it after a jittered
// exponential backoff; an Error "unknown client..." is answered with a Hello.
// A Task it cannot run (a codec that needs LibTorch, an algorithm the lite
// runtime lacks) is answered with an Error naming the round and why, and
// logged on one line; the session goes on.
//
// Threads: run() on one thread; stop() and counters() from any (stop() also
// from a signal handler: it only stores an atomic).

#include <atomic>
#include <cstdint>
#include <memory>

#include "liteclient/config.h"
#include "liteclient/trainer.h"

namespace sparrow::liteclient {

class Session {
 public:
  struct Counters {
    uint64_t hellos = 0, welcomes = 0, tasks_done = 0, tasks_refused = 0, updates_acked = 0, updates_rejected = 0,
             reconnects = 0, heartbeats = 0, errors_received = 0;
  };

  // Loads the key files (ConfigError) and the state file (its client_id and
  // model digest must match: ConfigError; a damaged file: FormatError).
  // Connects nothing yet.
  Session(Config cfg, std::unique_ptr<SessionTrainer> trainer);
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  // Until the server says Bye "run finished" (true) or stop() (false; a Bye
  // is sent first). Throws sparrow::Error when the server refuses the Hello
  // or handshakes fail for give_up_s.
  bool run();
  void stop() { stop_.store(true); }

  Counters counters() const;
  uint64_t digest() const;

 private:
  struct Impl;
  std::atomic<bool> stop_{false};
  std::unique_ptr<Impl> impl_;
};

}  // namespace sparrow::liteclient
