// Tensors across the language boundary: LibTorch's own Python wrappers
// (libtorch_python, the one python3-torch uses), so a torch.Tensor and an
// at::Tensor share one storage. `import torch` must have run first (it
// registers torch.Tensor's type): both functions import it on their first
// call, so `import sparrow` does not pay for torch's Python modules (most of
// a second) until a tensor crosses.

#include <torch/csrc/autograd/python_variable.h>

#include <atomic>

#include "python/bindings.h"

namespace sparrow::python {

namespace {
// Guarded by the GIL, which both callers hold.
void ensure_torch() {
  static bool imported = false;
  if (imported) return;
  py::module_::import("torch");
  imported = true;
}
}  // namespace

py::object to_torch(const at::Tensor& t) {
  ensure_torch();
  return py::reinterpret_steal<py::object>(THPVariable_Wrap(t));
}

at::Tensor from_python(py::handle obj, const char* what) {
  ensure_torch();
  if (THPVariable_Check(obj.ptr())) return THPVariable_Unpack(obj.ptr());
  py::object torch = py::module_::import("torch");
  py::object np = py::module_::import("numpy");
  if (py::isinstance(obj, np.attr("ndarray")) || py::isinstance<py::list>(obj) || py::isinstance<py::tuple>(obj)) {
    py::object t = torch.attr("as_tensor")(obj);
    return THPVariable_Unpack(t.ptr());
  }
  throw py::type_error(std::string(what) + ": expected a torch.Tensor or a numpy array, got " +
                       std::string(py::str(obj.get_type().attr("__name__"))));
}

namespace {
std::atomic<int> g_round{0};
}
void set_current_round(int round) { g_round.store(round); }
int current_round() { return g_round.load(); }

}  // namespace sparrow::python
