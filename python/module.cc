// The module _sparrow: exceptions, logging and the registries a Python
// function can join (aggregation rules, server optimisers, client selection). The simulation is
// bound in simulation.cc, codecs and the server's database in extras.cc.
//
// A Python hook is called by the C++ round on whatever thread folds the round
// (the simulator's round thread while the caller's thread waits with the GIL
// released); it takes the GIL for the call. The rule holds only its name:
// the function lives in the module's `_hooks` dict, so registering the same
// name again (a notebook cell run twice) replaces it, and no Python object is
// ever released by a C++ thread that does not hold the GIL.

#include <pybind11/stl.h>
#include <spdlog/spdlog.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "aggregation/rules.h"
#include "aggregation/server_optimizer.h"
#include "compression/compressor.h"
#include "core/error.h"
#include "core/error_text.h"
#include "core/spec.h"
#include "federation/sampler.h"
#include "python/bindings.h"

namespace sparrow::python {
namespace {

// The dict name -> function of the Python hooks ("aggregator:NAME",
// "server_optimizer:NAME", "sampler:NAME"); owned by the module object, never freed before exit.
py::dict& hooks() {
  static py::dict* d = nullptr;
  if (!d) d = new py::dict();
  return *d;
}

// The slots each Python server optimiser declared (the last registration's).
std::map<std::string, std::vector<std::string>>& optimizer_slots() {
  static auto* m = new std::map<std::string, std::vector<std::string>>();
  return *m;
}

py::object hook(const std::string& key) {
  py::dict& d = hooks();
  if (!d.contains(key)) throw Error("the Python function of " + key + " is gone");
  return d[py::str(key)];
}

// A coordinate rule written in Python: every update of the round buffered as a
// dense float32 row, handed to fn(round, updates) as tensors with their
// weights; fn returns the aggregate [d] (torch.Tensor or numpy array).
class PythonRule final : public aggregation::AggregationRule {
 public:
  explicit PythonRule(std::string name) : name_(std::move(name)) {}
  at::Tensor combine(const aggregation::RoundRows& r, aggregation::AggregateStats&) const override {
    py::gil_scoped_acquire gil;
    py::list rows;
    for (const at::Tensor& row : r.rows) rows.append(to_torch(row));
    py::object updates =
        py::module_::import("sparrow._simulation")
            .attr("Updates")(rows, py::cast(r.weights), py::cast(r.norms), r.total_weight, py::cast(r.ids));
    py::object out = hook("aggregator:" + name_)(current_round(), updates);
    const int64_t d = r.rows.front().numel();
    at::Tensor t = from_python(out, ("aggregator '" + name_ + "'").c_str());
    // A ValueError, not a sparrow::Error: the round would take that for a
    // refused aggregate and abandon the round, hiding the function's bug.
    if (t.numel() != d)
      throw py::value_error("aggregator '" + name_ + "' returned " + std::to_string(t.numel()) +
                            " values for a model of " + std::to_string(d));
    // Cast and copy while holding the GIL: a numpy array's memory is Python's.
    return t.reshape({d}).to(at::kFloat).contiguous().clone();
  }

 private:
  std::string name_;
};

// A server optimiser written in Python: fn(round, weights, aggregate[, state])
// returns the new weights. Called once per step with the whole model (the
// built-ins step tensor by tensor); the function gets copies, so whatever it
// does to them, the model and the state change only when it returns a valid
// result. `slots` are the per-tensor tensors it keeps in state[name][slot]:
// they are the ServerOptimizer's slots, so checkpoints and resumes carry them.
class PythonOptimizer final : public aggregation::OptimizerMethod {
 public:
  PythonOptimizer(std::string name, std::vector<std::string> slots)
      : name_(std::move(name)), slots_(std::move(slots)) {}
  std::vector<std::string> moments() const override { return slots_; }
  void step(const std::string&, at::Tensor&, const at::Tensor&, aggregation::Slots&) const override {
    throw Error("server optimizer '" + name_ + "' steps the whole model at once");  // step_model() overrides
  }
  void step_model(std::map<std::string, at::Tensor>& weights, const std::map<std::string, at::Tensor>& delta,
                  std::map<std::string, aggregation::Slots>& state) const override {
    py::gil_scoped_acquire gil;
    py::dict w, d, st;
    for (const auto& [n, t] : weights) {
      w[py::str(n)] = to_torch(t.detach().clone());
      d[py::str(n)] = to_torch(delta.at(n).clone());
      if (slots_.empty()) continue;
      py::dict s;
      if (auto it = state.find(n); it != state.end())
        for (const auto& [slot, v] : it->second)
          if (v.defined()) s[py::str(slot)] = to_torch(v.clone());
      st[py::str(n)] = s;
    }
    py::object fn = hook("server_optimizer:" + name_);
    py::object out = slots_.empty() ? fn(current_round(), w, d) : fn(current_round(), w, d, st);
    const std::string who = "server optimizer '" + name_ + "'";
    if (!py::isinstance<py::dict>(out))
      throw py::type_error(who + " returned " + std::string(py::str(out.get_type().attr("__name__"))) +
                           ", not the new weights {name: tensor}");
    py::dict res = out;
    if (res.size() != weights.size())
      throw py::value_error(who + " returned " + std::to_string(res.size()) + " tensors for a model of " +
                            std::to_string(weights.size()));
    // Everything converted and checked before anything changes.
    std::map<std::string, at::Tensor> next;
    std::map<std::string, aggregation::Slots> next_state;
    for (const auto& [n, t] : weights) {
      if (!res.contains(n)) throw py::value_error(who + " returned no tensor '" + n + "'");
      next[n] = fitted(res[py::str(n)], t, who + ": '" + n + "'");
      if (slots_.empty()) continue;
      py::dict s = st[py::str(n)];
      for (const std::string& slot : slots_) {
        if (!s.contains(slot))
          throw py::value_error(who + " left no state['" + n + "']['" + slot + "'] (every slot of every tensor)");
        next_state[n][slot] = fitted(s[py::str(slot)], t, who + ": state['" + n + "']['" + slot + "']");
      }
      if (s.size() != slots_.size())
        throw py::value_error(who + ": state['" + n + "'] holds slots it did not declare (slots=...)");
    }
    for (auto& [n, t] : weights) t.copy_(next.at(n));
    if (!slots_.empty()) state = std::move(next_state);
  }

 private:
  // A float32 copy of a returned tensor or array with `like`'s shape; a
  // ValueError for another size or a non-finite value.
  static at::Tensor fitted(py::handle obj, const at::Tensor& like, const std::string& what) {
    at::Tensor t = from_python(obj, what.c_str());
    if (t.numel() != like.numel())
      throw py::value_error(what + " has " + std::to_string(t.numel()) + " values, the model's " +
                            std::to_string(like.numel()));
    t = t.detach().reshape(like.sizes()).to(at::kCPU, at::kFloat).contiguous().clone();
    if (!compression::all_finite(t)) throw py::value_error(what + " is not finite");
    return t;
  }
  std::string name_;
  std::vector<std::string> slots_;
};

void register_python_aggregator(const std::string& name, py::function fn, const std::string& description) {
  const std::string key = "aggregator:" + name;
  const bool again = hooks().contains(key);
  hooks()[py::str(key)] = fn;
  if (again) return;
  aggregation::register_aggregator(
      name,
      [name](Spec&) -> std::shared_ptr<const aggregation::AggregationRule> {
        return std::make_shared<PythonRule>(name);
      },
      description.empty() ? "a Python function (sparrow.register_aggregator)" : description);
}

void register_python_server_optimizer(const std::string& name, py::function fn, std::vector<std::string> slots,
                                      const std::string& description) {
  const std::string key = "server_optimizer:" + name;
  for (const std::string& slot : slots)
    if (slot.empty() || slot.find('/') != std::string::npos)
      throw ConfigError("server optimizer '" + name + "': slot name '" + slot + "' (non-empty, no '/')");
  const bool again = hooks().contains(key);
  if (!again) {
    aggregation::register_server_optimizer(
        name,
        [name](Spec&) -> std::shared_ptr<const aggregation::OptimizerMethod> {
          return std::make_shared<PythonOptimizer>(name, optimizer_slots().at(name));
        },
        description.empty() ? "a Python function (sparrow.register_server_optimizer)" : description);
  }
  hooks()[py::str(key)] = fn;
  optimizer_slots()[name] = std::move(slots);
}

void register_python_sampler(const std::string& name, py::function fn, const std::string& description) {
  const std::string key = "sampler:" + name;
  const bool again = hooks().contains(key);
  hooks()[py::str(key)] = fn;
  if (again) return;
  federation::register_sampler(
      name,
      [name, key](uint64_t, uint64_t round, std::vector<federation::Candidate> cands, size_t k) {
        py::gil_scoped_acquire gil;
        py::list ids;
        for (const auto& c : cands) ids.append(c.id);
        py::object out = hook(key)(round, ids, k);
        std::vector<std::string> chosen;
        for (py::handle h : out) chosen.push_back(py::str(h));
        SPARROW_CHECK(chosen.size() <= k, "sampler '" << name << "' chose " << chosen.size() << " clients, more than "
                                                      << k << " (clients_per_round)");
        return chosen;
      },
      description.empty() ? "a Python function (sparrow.register_sampler)" : description);
}

}  // namespace
}  // namespace sparrow::python

PYBIND11_MODULE(_sparrow, m) {
  namespace py = pybind11;
  using namespace sparrow::python;
  m.doc() = "Sparrow's C++ core; use the `sparrow` package.";
  // Messages name the key or the file, not a source line (as the programs do
  // unless logging at debug).
  sparrow::set_check_locations(false);
  spdlog::set_level(spdlog::level::warn);

  static py::exception<sparrow::Error> error(m, "Error", PyExc_RuntimeError);
  static py::exception<sparrow::ConfigError> config_error(m, "ConfigError", error.ptr());
  static py::exception<sparrow::FormatError> format_error(m, "FormatError", error.ptr());
  // The text users read: LibTorch's backtrace dropped (core/error_text.h).
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const sparrow::ConfigError& e) {
      config_error(sparrow::core::error_text(e).c_str());
    } catch (const sparrow::FormatError& e) {
      format_error(sparrow::core::error_text(e).c_str());
    } catch (const sparrow::Error& e) {
      error(sparrow::core::error_text(e).c_str());
    }
  });

  m.def(
      "set_log_level",
      [](const std::string& level) {
        const auto lvl = spdlog::level::from_str(level);
        if (lvl == spdlog::level::off && level != "off")
          throw sparrow::ConfigError("log level '" + level + "' (known: trace, debug, info, warn, error, off)");
        spdlog::set_level(lvl);
      },
      py::arg("level"), "the level of the C++ log lines written to stderr (default warn)");
  m.def("register_aggregator", &register_python_aggregator, py::arg("name"), py::arg("fn"),
        py::arg("description") = "");
  m.def("register_sampler", &register_python_sampler, py::arg("name"), py::arg("fn"), py::arg("description") = "");
  m.def("register_server_optimizer", &register_python_server_optimizer, py::arg("name"), py::arg("fn"),
        py::arg("slots") = std::vector<std::string>(), py::arg("description") = "");
  m.def("aggregator_names", [] { return sparrow::aggregation::aggregator_names(); });
  m.def("server_optimizer_names", [] { return sparrow::aggregation::server_optimizer_names(); });
  m.def("sampler_names", [] { return sparrow::federation::sampler_names(); });
  m.attr("_hooks") = hooks();
  init_simulation(m);
  init_extras(m);
  init_codec_server(m);
}
