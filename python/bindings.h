#pragma once
// Internal to the Python module: the pieces module.cc, simulation.cc and
// extras.cc share. Only tensor.cc includes LibTorch's Python headers (they
// are slow to compile); the other files convert tensors through these two
// functions.

#include <ATen/core/Tensor.h>
#include <pybind11/pybind11.h>

#include "compression/compressor.h"

#include <string>

namespace sparrow::python {

namespace py = pybind11;

// A torch.Tensor sharing `t`'s storage (no copy). Needs the GIL.
py::object to_torch(const at::Tensor& t);
// The at::Tensor behind a torch.Tensor (shared, no copy), or a numpy array
// converted by torch.as_tensor (shared when its dtype allows). TypeError for
// anything else. Needs the GIL.
at::Tensor from_python(py::handle obj, const char* what);

// The round the simulator is running (1-based), 0 outside a run: what a
// Python aggregator is told (an AggregationRule sees the rows, not the round).
void set_current_round(int round);
int current_round();

// sparrow.CodecContext: what a codec encodes and decodes one tensor with
// (its name, the seed, the round, the number of clients, ACP's shared factor,
// TCS's mask).
struct PyContext {
  compression::Context ctx;
};

void init_simulation(py::module_& m);
void init_extras(py::module_& m);        // codecs, contexts, a server's database
void init_codec_server(py::module_& m);  // codec_server.cc; after init_extras

}  // namespace sparrow::python
