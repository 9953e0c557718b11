// sparrow._CodecServer: the aggregating side of
// the codecs whose clients need shared state (ACP's factor, TCS's mask), for
// a researcher who uses the compression library from Python without the
// simulator. It is the simulator's own round (federation::RoundEngine over a
// GlobalModel and an Aggregator): the round's contexts, the fold in canonical
// client order, the global step, and the next round's shared state made from
// it exactly as sparrow-sim and sparrow-server make it, so what Python gets
// is the same bytes.

#include <pybind11/stl.h>

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "aggregation/robust.h"
#include "compression/mask.h"
#include "compression/state.h"
#include "core/error.h"
#include "federation/global_model.h"
#include "federation/round_engine.h"
#include "python/bindings.h"
#include "wire/wire.h"

namespace sparrow::python {
namespace {

class PyCodecServer {
 public:
  PyCodecServer(const std::string& spec, const py::dict& weights, uint64_t seed, const std::string& server_optimizer,
                const std::string& aggregator) {
    SPARROW_CHECK_T(ConfigError, weights.size() > 0, "CodecServer: the model has no tensors");
    federation::Weights w;
    std::vector<std::string> names;
    for (auto [k, v] : weights) {
      const std::string name = py::str(k);
      w[name] = from_python(v, "CodecServer weights").detach().to(at::kCPU, at::kFloat).contiguous().clone();
      names.push_back(name);
    }
    std::sort(names.begin(), names.end());  // the model's order: the simulator's and the server's
    for (const auto& n : names) shapes_.emplace_back(n, w.at(n).sizes().vec());
    federation::GlobalConfig g;
    g.seed = seed;
    g.compression = spec;
    g.server_optimizer = server_optimizer;
    gm_ = std::make_unique<federation::GlobalModel>(g, std::move(w), names);
    aggregator_ = std::make_unique<aggregation::Aggregator>(aggregator, "none", 1, seed);
    aggregation::check_combination(aggregator_->robust(), aggregator_->dp(), spec, "fedavg");
    engine_ = std::make_unique<federation::RoundEngine>(*gm_, *aggregator_, shapes_, 1, int64_t{1} << 40);
  }

  // Round r's contexts for `clients` (their number is the codecs' workers).
  py::dict open(uint64_t round, const std::vector<std::string>& clients) {
    SPARROW_CHECK_T(ConfigError, round >= 1, "CodecServer.open: rounds start at 1, got " << round);
    SPARROW_CHECK_T(ConfigError, !clients.empty(), "CodecServer.open: no clients");
    if (engine_->phase() != federation::RoundEngine::Phase::kIdle) engine_->abandon();
    const aggregation::ContextMap& ctx = engine_->open(round, clients);
    py::dict out;
    for (const auto& [n, c] : ctx) out[py::str(n)] = PyContext{c};
    return out;
  }

  // One client's update: one encoded message per tensor (Codec.encode's
  // bytes, any order), weighted by `weight` (its samples).
  void add(const std::string& client, const py::iterable& messages, double weight) {
    expect_open("add");
    std::vector<std::string> bytes;
    for (py::handle h : messages) bytes.push_back(h.cast<std::string>());
    py::gil_scoped_release nogil;
    federation::Arrival a;
    a.weight = weight;
    for (const std::string& b : bytes) {
      wire::Message msg = wire::parse(b);
      auto* u = std::get_if<wire::ModelUpdate>(&msg.body);
      SPARROW_CHECK_T(FormatError, u != nullptr, "CodecServer.add: the bytes are not an encoded tensor");
      for (auto& t : u->tensors) a.update.emplace_back(t.name, std::move(t.tensor));
    }
    engine_->add(0, client, std::move(a));
  }

  // The global step: the aggregate (the mean update the optimiser stepped
  // with), then W, ACP's factors and TCS's masks for the next round.
  py::dict step() {
    expect_open("step");
    federation::StepResult r;
    {
      py::gil_scoped_release nogil;
      engine_->close();
      r = engine_->step(1.0);
    }
    SPARROW_CHECK(r.applied, "CodecServer.step: " << r.error);
    py::dict d;
    for (const auto& [n, t] : r.delta) d[py::str(n)] = to_torch(t.clone());
    return d;
  }

  py::dict weights() const {
    py::dict d;
    for (const auto& [n, t] : gm_->weights()) d[py::str(n)] = to_torch(t.clone());
    return d;
  }
  // ACP's shared factors by tensor name, TCS's masks (ascending positions).
  py::dict factors() const {
    py::dict d;
    for (const auto& [n, t] : gm_->shared())
      if (n.rfind("mask/", 0) != 0) d[py::str(n)] = to_torch(t.clone());
    return d;
  }
  py::dict masks() const {
    py::dict d;
    for (const auto& [n, s] : shapes_) {
      at::Tensor m = gm_->mask(n);
      if (m.defined()) d[py::str(n)] = to_torch(m.clone());
    }
    return d;
  }
  // The shared state as a checkpoint stores it (sparrow-sim's checkpoint.acp).
  py::bytes shared_bytes() const {
    return py::bytes(gm_->shared().empty() ? std::string() : compression::serialize_weights(gm_->shared()));
  }

 private:
  void expect_open(const char* what) const {
    SPARROW_CHECK(engine_->phase() == federation::RoundEngine::Phase::kOpen,
                  "CodecServer." << what << ": no round is open (call open(round, clients) first)");
  }
  aggregation::TensorShapes shapes_;
  std::unique_ptr<federation::GlobalModel> gm_;
  std::unique_ptr<aggregation::Aggregator> aggregator_;
  std::unique_ptr<federation::RoundEngine> engine_;
};

}  // namespace

void init_codec_server(py::module_& m) {
  py::class_<PyCodecServer>(m, "_CodecServer")
      .def(py::init<const std::string&, const py::dict&, uint64_t, const std::string&, const std::string&>(),
           py::arg("spec"), py::arg("weights"), py::arg("seed"), py::arg("server_optimizer"), py::arg("aggregator"))
      .def("open", &PyCodecServer::open, py::arg("round"), py::arg("clients"))
      .def("add", &PyCodecServer::add, py::arg("client"), py::arg("messages"), py::arg("weight"))
      .def("step", &PyCodecServer::step)
      .def("weights", &PyCodecServer::weights)
      .def("factors", &PyCodecServer::factors)
      .def("masks", &PyCodecServer::masks)
      .def("shared_bytes", &PyCodecServer::shared_bytes);
}

}  // namespace sparrow::python
