#pragma once
// The service in this process for the parity tests (parity_inproc_test.cc,
// async_parity_test.cc): the Server library on the calling thread and
// kClients ClientSessions on threads of their own, over mem:// with keys, so
// that the simulator's run can be compared with the service's without
// sockets or child processes.
#include "tests/integration/fixtures.h"
#include "tests/integration/parity_cases.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "client/data_folder.h"
#include "client/session.h"
#include "server/config.h"
#include "server/server.h"
#include "wire/net.h"

namespace sparrow::testing::parity {

// What the tests check of a finished service run.
struct InprocRun {
  integ::Weights global;  // the server's final global model
  int finished = 0;       // clients whose run() returned true
  int64_t completed_rounds = 0;
  uint64_t updates_accepted = 0;
  int clients_per_round = 0;  // as the server resolved the config
};

// Runs the service on endpoint ep (mem://…, unique to the test) with the
// keys and files under dir; server_keys follow listen, key, allow, db and
// model = "mlp" in the server's config. Client i sends its update
// delay_ms(i) after training. Rethrows the server's or a client's failure;
// clients still running 20 s after the server finished are stopped.
inline InprocRun run_inproc_service(const std::string& dir, const std::string& ep, const std::string& server_keys,
                                    const std::function<int(int)>& delay_ms) {
  using namespace std::chrono_literals;
  net::write_keypair(dir + "/keys", "server", net::generate_keypair());
  net::write_client_keys(dir + "/keys", kClients);
  server::Server server(server::parse_server_config(
      "listen = \"" + ep + "\"\nkey = \"" + dir + "/keys/server.key_secret\"\nallow = \"" + dir +
      "/keys/allow.txt\"\ndb = \"" + dir + "/server.db\"\nmodel = \"mlp\"\n" + server_keys));
  REQUIRE(server.endpoint() == ep);

  std::vector<std::unique_ptr<client::ClientSession>> sessions;
  for (int i = 0; i < kClients; ++i) {
    client::SessionConfig c =
        client::parse_session_config("server = \"" + ep + "\"\nserver_key = \"" + dir + "/keys/server.key\"\nkey = \"" +
                                     dir + "/keys/client" + std::to_string(i + 1) + ".key_secret\"\n" + client_keys(i) +
                                     "state_db = \"" + dir + "/client" + std::to_string(i) + ".db\"\n");
    c.update_delay_ms = delay_ms(i);
    core::Dataset data = client::load_client_data(c.data, c.model);
    sessions.push_back(std::make_unique<client::ClientSession>(c, std::move(data)));
  }
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> failed(kClients);
  std::atomic<int> finished{0}, done{0};
  for (int i = 0; i < kClients; ++i)
    threads.emplace_back([&, i] {
      try {
        if (sessions[static_cast<size_t>(i)]->run()) ++finished;
      } catch (...) {
        failed[static_cast<size_t>(i)] = std::current_exception();
      }
      ++done;
    });
  std::exception_ptr server_failed;
  try {
    server.run();
  } catch (...) {
    server_failed = std::current_exception();
  }
  // The clients leave on the server's Bye "run finished"; any still running
  // after a while is stopped (and the test fails on its counts).
  const auto until = std::chrono::steady_clock::now() + 20s;
  while (done.load() < kClients && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(10ms);
  for (auto& s : sessions) s->stop();
  for (auto& t : threads) t.join();
  if (server_failed) std::rethrow_exception(server_failed);
  for (auto& f : failed)
    if (f) std::rethrow_exception(f);
  InprocRun out;
  out.global = server.global_weights();
  out.finished = finished.load();
  out.completed_rounds = server.completed_rounds();
  out.updates_accepted = server.counters().updates_accepted;
  out.clients_per_round = server.config().clients_per_round;
  return out;
}

}  // namespace sparrow::testing::parity
