#pragma once
// The ZeroMQ transport (tcp://, ipc://, inproc://): a ROUTER for the
// listener, a DEALER for a connection, CurveZMQ with a ZAP allow-list when
// keys are given (wire/net.h: keys, ZapHandler, socket options), and libzmq's
// socket monitor for handshake events. Each listener and each connection owns
// its ZeroMQ context. Raw zmq calls of the service live here and in wire/net.

#include "transport/transport.h"

namespace sparrow::transport {

std::unique_ptr<Listener> zmq_listen(const std::string& endpoint, const ListenOptions& options);
std::unique_ptr<Connection> zmq_connect(const std::string& endpoint, const ConnectOptions& options);

}  // namespace sparrow::transport
