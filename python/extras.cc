// The compression library and a server's database from Python:
// sparrow._Codec (encode/decode through the wire format, the caller owning
// the codec's state, as a client does) and sparrow._ServerRun (what
// `sparrow-server status` and `export` read, read-only).

#include <pybind11/stl.h>

#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "compression/compressor.h"
#include "compression/mask.h"
#include "compression/state.h"
#include "core/error.h"
#include "core/export.h"
#include "core/paths.h"
#include "federation/client_pipeline.h"
#include "python/bindings.h"
#include "server/config.h"
#include "server/store.h"
#include "wire/wire.h"

namespace sparrow::python {
namespace {

// A codec's per-tensor state (residuals, momentum, warm starts, the step).
struct PyCodecState {
  compression::State state;
};

compression::State deep_copy(const compression::State& s) {
  compression::State c;
  c.step = s.step;
  c.last_round = s.last_round;
  for (const auto& [k, t] : s.tensors) c.tensors[k] = t.clone();
  return c;
}

class PyCodec {
 public:
  PyCodec(const std::string& spec, uint64_t seed)
      : spec_(spec), seed_(seed), codec_(compression::make_compressor(spec)) {}

  // (wire bytes of a one-tensor ModelUpdate, the state after this step). The
  // state passed in is left as it was. `context`: the tensor's name, seed,
  // round, clients, and ACP's shared factor or TCS's mask when it has them.
  py::tuple encode(py::handle tensor, const PyCodecState* state, const PyContext& context) {
    at::Tensor x = from_python(tensor, "encode");
    SPARROW_CHECK_T(ConfigError, x.is_floating_point(), "encode: a floating-point tensor is needed, got " << x.dtype());
    x = x.detach().to(at::kCPU, at::kFloat).contiguous();
    auto next = std::make_unique<PyCodecState>();
    if (state) next->state = deep_copy(state->state);
    const compression::Context& ctx = context.ctx;
    std::string bytes;
    {
      py::gil_scoped_release nogil;
      wire::ModelUpdate u;
      u.round = ctx.round > 0 ? static_cast<uint64_t>(ctx.round) : 0;
      u.client_id = "python";
      u.num_samples = 1;
      u.tensors.push_back({ctx.name, codec_->encode(x, next->state, ctx)});
      bytes = wire::serialize(wire::Message{wire::kProtocolMajor, wire::kProtocolMinor, std::move(u)});
    }
    return py::make_tuple(py::bytes(bytes), py::cast(next.release(), py::return_value_policy::take_ownership));
  }

  std::string spec() const { return spec_; }
  std::string method() const { return codec_->method(); }
  uint64_t seed() const { return seed_; }
  double mask_ratio() const { return codec_->mask_ratio(); }

 private:
  std::string spec_;
  uint64_t seed_;
  std::unique_ptr<compression::Compressor> codec_;
};

// Any codec's bytes (the format is self-describing): the tensor, verified as
// a server verifies an update (FormatError for bad bytes). With a context,
// decoded with it (ACP's factor, TCS's mask); else with the message's tensor
// name and `seed`.
at::Tensor decode_bytes(const py::bytes& data, const PyContext* context, uint64_t seed) {
  std::string bytes = data;
  compression::Context ctx;
  if (context) ctx = context->ctx;
  py::gil_scoped_release nogil;
  wire::Message msg = wire::parse(bytes);
  auto* u = std::get_if<wire::ModelUpdate>(&msg.body);
  SPARROW_CHECK_T(FormatError, u && u->tensors.size() == 1,
                  "decode: the bytes are not one encoded tensor (sparrow.codec(...).encode makes them)");
  if (!context) {
    ctx.name = u->tensors[0].name;
    ctx.seed = seed;
  }
  compression::check_mask(u->tensors[0].tensor, ctx);
  return compression::decode(u->tensors[0].tensor, ctx);
}

// An optional tensor argument: undefined for None.
at::Tensor optional_tensor(py::handle obj, const char* what, at::ScalarType type) {
  if (obj.is_none()) return {};
  return from_python(obj, what).detach().to(at::kCPU, type).contiguous().clone();
}

py::object tensor_or_none(const at::Tensor& t) { return t.defined() ? to_torch(t.clone()) : py::object(py::none()); }

py::dict round_row(const server::RoundRow& r) {
  py::dict d;
  d["round"] = r.round;
  d["started"] = r.started;
  d["finished"] = r.finished;
  d["seconds"] = r.finished - r.started;
  d["selected"] = r.selected;
  d["updates"] = r.updates;
  d["rejected"] = r.rejected;
  d["stale"] = r.stale;
  d["bytes_in"] = r.bytes_in;
  d["bytes_out"] = r.bytes_out;
  d["train_loss"] = r.train_loss;
  d["eval_loss"] = r.eval_loss;
  d["eval_accuracy"] = r.eval_accuracy;
  return d;
}

py::dict client_row(const server::ClientRow& c) {
  py::dict d;
  d["client_id"] = c.client_id;
  d["public_key"] = c.public_key;
  d["first_seen"] = c.first_seen;
  d["last_seen"] = c.last_seen;
  d["last_selected"] = c.last_selected;
  d["selected"] = c.selected;
  d["updates"] = c.updates;
  d["rejects"] = c.rejects;
  d["num_samples"] = c.num_samples;
  d["software"] = c.software;
  d["bytes_up"] = c.bytes_up;
  d["bytes_down"] = c.bytes_down;
  return d;
}

// A server's database opened read-only (a running server may hold it).
class PyServerRun {
 public:
  explicit PyServerRun(const std::string& path) {
    core::check_file_path("db", path);
    store_ = server::ServerStore::open_readonly(path);
  }
  py::object run() {
    auto r = store().run();
    if (!r) return py::none();
    py::dict d;
    d["run_id"] = r->run_id;
    d["config_hash"] = r->config_hash;
    d["config"] = r->config;
    d["created"] = r->created;
    return d;
  }
  py::list rounds() {
    py::list l;
    for (const auto& r : store().rounds()) l.append(round_row(r));
    return l;
  }
  py::list clients() {
    py::list l;
    for (const auto& c : store().clients()) l.append(client_row(c));
    return l;
  }
  std::map<std::string, double> metrics(int64_t round) { return store().metrics(round); }
  int64_t completed_rounds() { return store().completed_rounds(); }
  std::string model_name() {
    auto r = store().run();
    SPARROW_CHECK_T(ConfigError, r.has_value(), "'" << store().path() << "' holds no run");
    return server::parse_server_config(r->config).model;
  }
  // The newest intact checkpoint's global model, as `sparrow-server export`.
  py::tuple model() {
    auto ck = store().latest_checkpoint();
    SPARROW_CHECK_T(ConfigError, ck.has_value(), "'" << store().path() << "' has no intact checkpoint yet");
    py::dict d;
    for (const auto& [name, t] : compression::deserialize_weights(ck->weights)) d[py::str(name)] = to_torch(t);
    return py::make_tuple(d, ck->round);
  }
  void close() { store_.reset(); }

 private:
  server::ServerStore& store() {
    SPARROW_CHECK(store_ != nullptr, "the server database is closed");
    return *store_;
  }
  std::unique_ptr<server::ServerStore> store_;
};

}  // namespace

void init_extras(py::module_& m) {
  py::class_<PyCodecState>(m, "CodecState", "a codec's per-tensor state; owned by the caller")
      .def(py::init<>())
      .def_property_readonly("step", [](const PyCodecState& s) { return s.state.step; })
      .def_property_readonly("tensors",
                             [](const PyCodecState& s) {
                               py::dict d;
                               for (const auto& [k, t] : s.state.tensors) d[py::str(k)] = to_torch(t.clone());
                               return d;
                             })
      .def("to_bytes", [](const PyCodecState& s) { return py::bytes(s.state.serialize()); })
      .def_static("from_bytes", [](const py::bytes& b) {
        auto s = std::make_unique<PyCodecState>();
        s->state = compression::State::deserialize(std::string(b));
        return s;
      });
  py::class_<PyContext>(m, "CodecContext",
                        "what a codec encodes and decodes one tensor with; CodecServer.open() gives a round's")
      .def(py::init([](const std::string& name, uint64_t seed, int64_t round, int workers, py::object shared,
                       py::object mask, bool share_mean) {
             SPARROW_CHECK_T(ConfigError, workers >= 1, "CodecContext: workers must be >= 1, got " << workers);
             PyContext c;
             c.ctx.name = name;
             c.ctx.seed = seed;
             c.ctx.round = round;
             c.ctx.num_workers = workers;
             c.ctx.shared_factor = optional_tensor(shared, "shared", at::kFloat);
             c.ctx.mask = optional_tensor(mask, "mask", at::kLong);
             c.ctx.share_mean = share_mean;
             return c;
           }),
           py::arg("name") = "x", py::arg("seed") = 0, py::arg("round") = -1, py::arg("workers") = 1,
           py::arg("shared") = py::none(), py::arg("mask") = py::none(), py::arg("share_mean") = false)
      .def_property_readonly("name", [](const PyContext& c) { return c.ctx.name; })
      .def_property_readonly("seed", [](const PyContext& c) { return c.ctx.seed; })
      .def_property_readonly("round", [](const PyContext& c) { return c.ctx.round; })
      .def_property_readonly("workers", [](const PyContext& c) { return c.ctx.num_workers; })
      .def_property_readonly("shared", [](const PyContext& c) { return tensor_or_none(c.ctx.shared_factor); })
      .def_property_readonly("mask", [](const PyContext& c) { return tensor_or_none(c.ctx.mask); })
      .def_property_readonly("share_mean", [](const PyContext& c) { return c.ctx.share_mean; })
      // What client `id` encodes with: the round's context with its task's
      // seed, as the simulator's and the service's clients do.
      .def("for_client",
           [](const PyContext& c, const std::string& id) {
             const uint64_t round = c.ctx.round > 0 ? static_cast<uint64_t>(c.ctx.round) : 0;
             return PyContext{federation::client_context(c.ctx, federation::task_seed(c.ctx.seed, round, id),
                                                         static_cast<uint32_t>(c.ctx.num_workers))};
           })
      .def("__repr__", [](const PyContext& c) {
        return "CodecContext(name='" + c.ctx.name + "', round=" + std::to_string(c.ctx.round) +
               ", workers=" + std::to_string(c.ctx.num_workers) + (c.ctx.shared_factor.defined() ? ", shared" : "") +
               (c.ctx.mask.defined() ? ", mask" : "") + ")";
      });
  py::class_<PyCodec>(m, "_Codec")
      .def(py::init<const std::string&, uint64_t>(), py::arg("spec"), py::arg("seed") = 0)
      .def("encode", &PyCodec::encode, py::arg("tensor"), py::arg("state"), py::arg("context"))
      .def_property_readonly("spec", &PyCodec::spec)
      .def_property_readonly("method", &PyCodec::method)
      .def_property_readonly("seed", &PyCodec::seed)
      .def_property_readonly("mask_ratio", &PyCodec::mask_ratio);
  m.def(
      "_decode",
      [](const py::bytes& b, const PyContext* context, uint64_t seed) {
        return to_torch(decode_bytes(b, context, seed));
      },
      py::arg("data"), py::arg("context") = nullptr, py::arg("seed") = 0);
  m.def("codec_names", [] { return compression::registered_methods(); });
  // The TorchScript module of `model` with `weights` at `path` (what export writes as model.pt).
  m.def("_save_torchscript", [](const std::string& model, const py::dict& weights, const std::string& path) {
    std::map<std::string, at::Tensor> w;
    for (auto [k, v] : weights) w[py::str(k)] = from_python(v, "weights");
    py::gil_scoped_release nogil;
    core::save_torchscript(model, w, path);
  });
  py::class_<PyServerRun>(m, "_ServerRun")
      .def(py::init<const std::string&>(), py::arg("path"))
      .def("run", &PyServerRun::run)
      .def("rounds", &PyServerRun::rounds)
      .def("clients", &PyServerRun::clients)
      .def("metrics", &PyServerRun::metrics)
      .def("completed_rounds", &PyServerRun::completed_rounds)
      .def("model_name", &PyServerRun::model_name)
      .def("model", &PyServerRun::model)
      .def("close", &PyServerRun::close);
}

}  // namespace sparrow::python
