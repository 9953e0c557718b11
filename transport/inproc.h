#pragma once
// The in-process transport (mem://NAME): a hub of named listeners in this
// process, queues under a mutex, no sockets and no threads of its own. For
// tests that run a server and many clients in one process, and for embedding;
// never across processes.
//
// It keeps what the service relies on from ZeroMQ:
// - keys: with ListenOptions keys, a connection is admitted only when it
//   presents the listener's public key as server_key and its own public key is
//   allowed (on_auth is told either way); its frames then carry that key as
//   Inbound::key. A refused or mismatched connection sees the handshake
//   events a ZeroMQ client would see (kRefused, kMismatch, kFailed) and tries
//   again every 100 ms.
// - bounded queues: queue_limit frames per peer and direction, then
//   kWouldBlock; a frame over the receiver's max_message_bytes is dropped and
//   the connection closed (the client reconnects), as libzmq does.
// - a connection made before its listener exists, or after it went, attaches
//   when one is bound under the name (ZeroMQ's reconnect).
// Frames move by value: a sent std::string is copied once into the queue.
// heartbeat_ms is not used: a connection here never dies unnoticed.

#include "transport/transport.h"

namespace sparrow::transport {

std::unique_ptr<Listener> inproc_listen(const std::string& endpoint, const ListenOptions& options);
std::unique_ptr<Connection> inproc_connect(const std::string& endpoint, const ConnectOptions& options);

}  // namespace sparrow::transport
