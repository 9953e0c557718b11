// sparrow-sim's state_encoding: a bf16 run stores narrowed client states,
// resumes exactly, its estimate and file shrink; the key is checked.
#include "tests/sparrow_test.h"

#include <unistd.h>

#include <filesystem>
#include <string>

#include "core/error.h"
#include "core/npy.h"
#include "simulator/config.h"
#include "simulator/simulator.h"
#include "state/store.h"
#include "tests/simulator/sim_test_util.h"

using namespace sparrow::simulator;  // NOLINT(google-build-using-namespace)
namespace fs = std::filesystem;

namespace {

using testing::TempDir;

std::string mlp_data() { return testing::mlp_data("state_encoding_test_data", 0.013, true); }

// DGC keeps u and v per tensor: a state made of residual-like tensors.
SimConfig dgc_run(const std::string& out, const std::string& encoding) {
  SimConfig c;
  c.seed = 9;
  c.dataset = "folder:" + mlp_data();
  c.clients = 8;
  c.clients_per_round = 4;
  c.rounds = 4;
  c.model = "mlp";
  c.local_epochs = 1;
  c.batch_size = 16;
  c.lr = 0.05;
  c.eval_every = 4;
  c.checkpoint_every = 1;
  c.compression = "dgc:ratio=0.01,momentum=0.9,warmup=0";
  c.state_encoding = encoding;
  c.out = out;
  return c;
}

Simulator::Weights final_model(const SimConfig& cfg) {
  Simulator sim(cfg);
  sim.run();
  Simulator::Weights w;
  for (const auto& [name, t] : sim.global()) w[name] = t.clone();
  return w;
}

bool same(const Simulator::Weights& a, const Simulator::Weights& b) {
  if (a.size() != b.size()) return false;
  for (const auto& entry : a)
    if (!b.count(entry.first) || !entry.second.equal(b.at(entry.first))) return false;
  return true;
}

}  // namespace

TEST_CASE("state_encoding = bf16: stored states are bf16 values, and a stopped run resumes to the same model") {
  TempDir straight("straight"), stopped("stopped"), exact("exact");
  const Simulator::Weights whole = final_model(dgc_run(straight.path, "bf16"));
  {
    Simulator sim(dgc_run(stopped.path, "bf16"));
    sim.run_round();
    sim.run_round();
    sim.checkpoint_now();
  }
  Simulator::Weights resumed;
  {
    Simulator sim(dgc_run(stopped.path, "bf16"), /*resume=*/true);
    sim.run();
    for (const auto& [name, t] : sim.global()) resumed[name] = t.clone();
  }
  CHECK(same(whole, resumed));
  // It is not the fp32 run: the states the clients continue from differ.
  CHECK_FALSE(same(whole, final_model(dgc_run(exact.path, "fp32"))));

  // What the file holds: every narrowed tensor already a bf16 value.
  auto store = sparrow::state::ClientStateStore::open(straight.path + "/client_state.db");
  int with_state = 0;
  for (int64_t c = 0; c < 8; ++c) {
    const auto s = store->get(c);
    if (!s) continue;
    ++with_state;
    for (const auto& [name, cs] : s->compressor)
      for (const auto& [slot, t] : cs.tensors) {
        const std::string where = "client " + std::to_string(c) + " " + name + " " + slot;  // not the bindings
        INFO(where);
        CHECK(t.equal(t.to(at::kBFloat16).to(at::kFloat)));
      }
  }
  CHECK(with_state > 0);
}

TEST_CASE("state_encoding = bf16: the estimate and client_state.db shrink to about half") {
  TempDir a("fp32"), b("bf16");
  DiskEstimate e32, e16;
  {
    Simulator sim(dgc_run(a.path, "fp32"));
    e32 = estimate_disk(sim);
    sim.run();
  }
  {
    Simulator sim(dgc_run(b.path, "bf16"));
    e16 = estimate_disk(sim);
    CHECK(disk_estimate_text(e16, sim.config()).find("of state each in bf16") != std::string::npos);
    sim.run();
  }
  INFO("estimated per client: fp32 " << e32.state_per_client << ", bf16 " << e16.state_per_client);
  CHECK(e16.state_per_client * 100 <= e32.state_per_client * 52);
  CHECK(e16.state_per_client * 100 >= e32.state_per_client * 48);
  CHECK(e16.client_state_db < e32.client_state_db);
  const auto f32 = fs::file_size(a.path + "/client_state.db"), f16 = fs::file_size(b.path + "/client_state.db");
  INFO("client_state.db: fp32 " << f32 << " bytes, bf16 " << f16);
  CHECK(f16 * 100 <= f32 * 55);
  CHECK(f16 <= 2 * e16.client_state_db);  // the estimate still holds
  CHECK(e16.client_state_db <= 2 * f16);
}

TEST_CASE("state_encoding: unknown values refused naming the key, and a resume may not change it") {
  CHECK(parse_config_string("state_encoding = \"bf16\"\n").state_encoding == "bf16");
  CHECK(parse_config_string("").state_encoding == "fp32");
  for (const char* bad : {"fp16", "BF16", ""}) {
    INFO(bad);
    CHECK_THROWS_WITH_AS(parse_config_string(std::string("state_encoding = \"") + bad + "\"\n"),
                         doctest::Contains("state_encoding"), sparrow::ConfigError);
  }
  CHECK_THROWS_WITH_AS(parse_config_string("", {"state_encoding=int8"}), doctest::Contains("state_encoding"),
                       sparrow::ConfigError);
  CHECK(parse_config_string(to_toml(parse_config_string("state_encoding = \"bf16\"\n"))).state_encoding == "bf16");

  // The recorded run is fp32; continuing it in bf16 would make its figures
  // neither: refused, the key named.
  TempDir d("resume");
  {
    Simulator sim(dgc_run(d.path, "fp32"));
    sim.run_round();
    sim.checkpoint_now();
  }
  try {
    Simulator sim(dgc_run(d.path, "bf16"), /*resume=*/true);
    FAIL("a resume with another state_encoding was accepted");
  } catch (const sparrow::ConfigError& e) {
    CHECK(std::string(e.what()).find("state_encoding") != std::string::npos);
  }
}
