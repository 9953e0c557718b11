// What a simulation writes to disk: the estimate sparrow-sim logs before a run
// (estimate_disk) against the files the run leaves, and keep_client_state.
#include "tests/sparrow_test.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "core/error.h"
#include "core/npy.h"
#include "simulator/config.h"
#include "simulator/simulator.h"
#include "state/store.h"
#include "tests/simulator/sim_test_util.h"

using namespace sparrow::simulator;
namespace fs = std::filesystem;

namespace {

using testing::TempDir;

std::string mlp_data() { return testing::mlp_data("disk_use_test_data", 0.01, false); }

// A small stateful run: DGC keeps a residual and a momentum per tensor (two
// model-sized tensors per client), over an MLP large enough that the states,
// not SQLite's pages, make up the file.
SimConfig stateful(const std::string& out) {
  SimConfig c;
  c.seed = 5;
  c.dataset = "folder:" + mlp_data();
  c.clients = 12;
  c.clients_per_round = 3;
  c.rounds = 4;
  c.model = "mlp";
  c.local_epochs = 1;
  c.batch_size = 16;
  c.lr = 0.05;
  c.eval_every = 4;
  c.checkpoint_every = 2;
  c.compression = "dgc:ratio=0.01,momentum=0.9,warmup=0";
  c.out = out;
  return c;
}

uint64_t file_size(const std::string& p) { return fs::exists(p) ? fs::file_size(p) : 0; }

int run_cmd(const std::string& cmd, std::string* out) {
  FILE* p = popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out->append(buf, n);
  const int st = pclose(p);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

}  // namespace

TEST_CASE("disk estimate: one client's state is measured, and the run's client_state.db is within 2x of it") {
  TempDir d("dgc");
  const SimConfig cfg = stateful(d.path);
  DiskEstimate e;
  uint64_t model_bytes = 0;
  {
    Simulator sim(cfg);
    for (const auto& entry : sim.global()) model_bytes += static_cast<uint64_t>(entry.second.numel()) * 4;
    e = estimate_disk(sim);
    sim.run();
  }
  // DGC: residual and momentum, two model-sized float32 tensors, and no control.
  CHECK(e.codec_state >= 19 * model_bytes / 10);
  CHECK(e.codec_state < 2 * model_bytes + model_bytes / 10);
  CHECK(e.control_state == 0);
  // 4 rounds of 3 of 12 clients: 12 * (1 - 0.75^4) = 8.2 expected to take part.
  CHECK(e.clients_with_state == doctest::Approx(12 * (1 - 0.75 * 0.75 * 0.75 * 0.75)));
  const uint64_t real = file_size(d.path + "/client_state.db");
  INFO("estimated " << e.client_state_db << " bytes, client_state.db holds " << real);
  REQUIRE(real > 0);
  CHECK(e.client_state_db <= 2 * real);
  CHECK(real <= 2 * e.client_state_db);
  CHECK(e.total >= e.client_state_db);
  CHECK(e.after_run == e.total);  // keep_client_state = true
  const std::string text = disk_estimate_text(e, cfg);
  CHECK(text.rfind("disk: about ", 0) == 0);
  CHECK(text.find("client_state.db") != std::string::npos);
  CHECK(text.find(" of 12 clients take part") != std::string::npos);
}

TEST_CASE("disk estimate: SCAFFOLD's control adds one model per client, a stateless codec next to nothing") {
  TempDir d("scaffold");
  SimConfig cfg = stateful(d.path);
  cfg.compression = "none";
  cfg.algorithm = "scaffold";
  Simulator sim(cfg);
  uint64_t model_bytes = 0;
  for (const auto& entry : sim.global()) model_bytes += static_cast<uint64_t>(entry.second.numel()) * 4;
  const DiskEstimate e = estimate_disk(sim);
  CHECK(e.control_state >= model_bytes);
  CHECK(e.control_state < model_bytes + model_bytes / 10);
  CHECK(e.codec_state < model_bytes / 100);
  CHECK(disk_estimate_text(e, cfg).find("SCAFFOLD control") != std::string::npos);
}

TEST_CASE("keep_client_state = false: a finished run keeps its checkpoint, drops every client state, refuses resume") {
  TempDir keep("keep"), drop("drop");
  {
    Simulator a(stateful(keep.path));
    a.run();
  }
  SimConfig cfg = stateful(drop.path);
  cfg.keep_client_state = false;
  Simulator::Weights final_model;
  {
    Simulator b(cfg);
    b.run();
    for (const auto& entry : b.global()) final_model[entry.first] = entry.second.clone();
    // The config is recorded with the key.
    CHECK(parse_config_string(to_toml(b.config())).keep_client_state == false);
  }
  const std::string cs = drop.path + "/client_state.db";
  CHECK_FALSE(fs::exists(cs + ".new"));
  CHECK_FALSE(fs::exists(cs + "-wal"));
  const uint64_t kept = file_size(keep.path + "/client_state.db"), dropped = file_size(cs);
  INFO("client_state.db with the states " << kept << " bytes, without " << dropped);
  CHECK(dropped * 4 < kept);
  {
    // No client has a state left; the checkpoint is whole.
    auto store = sparrow::state::ClientStateStore::open(cs);
    for (int64_t c = 0; c < 12; ++c) CHECK_FALSE(store->get(c).has_value());
    CHECK(store->get_meta("checkpoint.round") == std::optional<std::string>("4"));
  }
  // The model can still be exported, and it is the run's.
  const auto [w, round] = load_run_model(drop.path);
  CHECK(round == 4);
  REQUIRE(w.size() == final_model.size());
  for (const auto& entry : final_model) CHECK(w.at(entry.first).equal(entry.second));
  // Continuing it would start every client from an empty state: refused.
  SimConfig more = cfg;
  more.rounds = 6;
  try {
    Simulator c(more, /*resume=*/true);
    FAIL("resume of a run whose client states were dropped was accepted");
  } catch (const sparrow::ConfigError& e) {
    CHECK(std::string(e.what()).find("keep_client_state = false") != std::string::npos);
  }
}

TEST_CASE("keep_client_state may change on resume, and the run then drops its states at its end") {
  TempDir d("resume");
  SimConfig cfg = stateful(d.path);
  {
    Simulator sim(cfg);
    sim.run_round();
    sim.run_round();
    sim.checkpoint_now();
  }
  SimConfig later = cfg;
  later.keep_client_state = false;
  {
    Simulator sim(later, /*resume=*/true);
    sim.run();
  }
  auto store = sparrow::state::ClientStateStore::open(d.path + "/client_state.db");
  for (int64_t c = 0; c < 12; ++c) CHECK_FALSE(store->get(c).has_value());
}

TEST_CASE("sparrow-sim logs the disk estimate before the first round") {
  TempDir d("cli");
  const std::string cfg = d.path + ".toml";
  struct Remove {
    std::string path;
    ~Remove() { std::remove(path.c_str()); }
  } remove_cfg{cfg};
  std::ofstream(cfg) << "dataset = \"synthetic:alpha=1,beta=1\"\nmodel = \"logreg\"\nclients = 4\n"
                        "clients_per_round = 2\nrounds = 2\nkeep_client_state = false\nout = \""
                     << d.path << "\"\n";
  const std::string bin = std::string(SPARROW_BIN_DIR) + "/sparrow-sim";
  std::string out;
  CHECK(run_cmd(bin + " --config " + cfg + " 2>&1", &out) == 0);
  INFO(out);
  const size_t line = out.find("disk: about ");
  REQUIRE(line != std::string::npos);
  // Before the first round's line, whatever the log format.
  const size_t first_round = std::min(out.find("round 1/2"), out.find("round=1 "));
  CHECK(line < first_round);
  CHECK(out.find("keep_client_state = false: after the last round only the checkpoint stays", line) !=
        std::string::npos);
}
