// The module _sparrow: exceptions, logging and the registries a Python
// function can join (aggregation rules, client selection). The simulation is
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

#include <string>
#include <vector>

#include "aggregation/rules.h"
#include "core/error.h"
#include "core/error_text.h"
#include "core/spec.h"
#include "federation/sampler.h"
#include "python/bindings.h"

namespace sparrow::python {
namespace {

// The dict name -> function of the Python hooks ("aggregator:NAME",
// "sampler:NAME"); owned by the module object, never freed before exit.
py::dict& hooks() {
  static py::dict* d = nullptr;
  if (!d) d = new py::dict();
  return *d;
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
    py::object updates = py::module_::import("sparrow._simulation")
                             .attr("Updates")(rows, py::cast(r.weights), py::cast(r.norms), r.total_weight);
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
  m.def("aggregator_names", [] { return sparrow::aggregation::aggregator_names(); });
  m.def("sampler_names", [] { return sparrow::federation::sampler_names(); });
  m.attr("_hooks") = hooks();
  init_simulation(m);
  init_extras(m);
}
