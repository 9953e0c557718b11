// sparrow-sim's downlink bytes under downlink_catchup (federation/catchup.h,
// the rule sparrow-server sends by): the policy changes the bytes, never the
// model; auto sends no more than any other policy, and less than the dense
// model to clients that skipped rounds.
#include "tests/sparrow_test.h"

#include <ATen/ATen.h>

#include <cstring>
#include <string>

#include "compression/compressor.h"
#include "simulator/config.h"
#include "simulator/simulator.h"
#include "tests/simulator/sim_test_util.h"
#include "wire/wire.h"

using namespace sparrow::simulator;
using sparrow::simulator::testing::TempDir;

namespace {

// 12 clients, 2 a round: most return after several rounds.
SimConfig catchup_config(const std::string& out, const std::string& policy) {
  SimConfig c;
  c.seed = 3;
  c.dataset = "synthetic:alpha=1,beta=1";
  c.clients = 12;
  c.clients_per_round = 2;
  c.rounds = 14;
  c.model = "logreg";
  c.batch_size = 16;
  c.lr = 0.05;
  c.eval_every = 7;
  c.downlink = "topk:ratio=0.05";
  c.downlink_catchup = policy;
  c.out = out;
  return c;
}

bool same_bits(const Simulator::Weights& a, const Simulator::Weights& b) {
  if (a.size() != b.size()) return false;
  for (const auto& [k, v] : a) {
    const at::Tensor x = v.contiguous(), y = b.at(k).contiguous();
    if (x.numel() != y.numel() || std::memcmp(x.data_ptr<float>(), y.data_ptr<float>(), 4 * x.numel()) != 0)
      return false;
  }
  return true;
}

uint64_t total_down(const Simulator& s) {
  uint64_t n = 0;
  for (const auto& m : s.history()) n += m.bytes_down;
  return n;
}

}  // namespace

TEST_CASE("simulator: downlink_catchup changes the downlink bytes only, and auto is the smallest") {
  TempDir df("catchup_full"), dc("catchup_chain"), dp("catchup_patch"), da("catchup_auto");
  Simulator full(catchup_config(df.path, "full")), chain(catchup_config(dc.path, "chain")),
      patch(catchup_config(dp.path, "patch")), autop(catchup_config(da.path, "auto"));
  for (Simulator* s : {&full, &chain, &patch, &autop}) s->run();
  for (const Simulator* s : {&chain, &patch, &autop}) {
    CHECK(same_bits(s->global(), full.global()));
    REQUIRE(s->history().size() == full.history().size());
    for (size_t t = 0; t < full.history().size(); ++t) {
      CAPTURE(t);
      CHECK(s->history()[t].bytes_up == full.history()[t].bytes_up);
      CHECK(s->history()[t].train_loss == full.history()[t].train_loss);
      CHECK(s->history()[t].bytes_down <= full.history()[t].bytes_down);
      CHECK(autop.history()[t].bytes_down <= s->history()[t].bytes_down);
    }
  }
  // Clients that skipped rounds and took part before get a chain or a patch.
  CHECK(total_down(chain) < total_down(full));
  CHECK(total_down(patch) < total_down(full));
  CHECK(total_down(autop) < total_down(full));
}

TEST_CASE("simulator: a client's first task is counted from B_0, the model it builds from model_seed") {
  // sparrow-client's Hello says last_round = 0 before its first task, so the
  // server sends round 1 an empty Delta and round 2 the Delta C_1, never the
  // dense model to a client that has not taken part yet.
  for (const char* policy : {"full", "chain", "auto"}) {
    CAPTURE(policy);
    TempDir d(std::string("catchup_first_") + policy);
    Simulator s(catchup_config(d.path, policy));
    s.run();
    uint64_t model = 0;
    for (const auto& [n, t] : s.global())
      model += sparrow::wire::encoded_size(sparrow::compression::dense_encoded(t), n);
    REQUIRE(s.history().size() >= 2);
    CHECK(s.history()[0].bytes_down == 0);
    CHECK(s.history()[1].bytes_down > 0);
    CHECK(s.history()[1].bytes_down < model);  // two C_1 (topk 5%), not a dense model
  }
}

TEST_CASE("simulator: a resumed run forgets the catch-up history (the dense model) and ends with the same model") {
  TempDir whole("catchup_whole"), part("catchup_part");
  Simulator a(catchup_config(whole.path, "auto"));
  a.run();
  SimConfig h = catchup_config(part.path, "auto");
  h.rounds = 7;  // checkpointed at the evaluation of round 7
  {
    Simulator b(h);
    b.run();
  }
  h.rounds = 14;
  Simulator r(h, /*resume=*/true);
  r.run();
  REQUIRE(r.history().size() == a.history().size());
  CHECK(same_bits(r.global(), a.global()));
  bool more = false;
  for (size_t t = 0; t < a.history().size(); ++t) {
    CAPTURE(t);
    if (t < 7) CHECK(r.history()[t].bytes_down == a.history()[t].bytes_down);
    CHECK(r.history()[t].bytes_down >= a.history()[t].bytes_down);
    more = more || r.history()[t].bytes_down > a.history()[t].bytes_down;
  }
  CHECK(more);
}
