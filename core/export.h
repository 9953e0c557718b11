#pragma once
// Getting a trained model out (`sparrow-sim export`, `sparrow-server export`):
// the global weights as one .npy file per parameter, and as a TorchScript
// module that anyone with PyTorch can load (`torch.jit.load("model.pt")`)
// and call: forward(x) returns the logits, exactly as Sparrow computes them.

#include <ATen/ATen.h>

#include <map>
#include <string>
#include <vector>

namespace sparrow::core {

struct ExportResult {
  std::string torchscript;       // path of model.pt
  std::string state_dict;        // path of state_dict.pt
  std::vector<std::string> npy;  // one path per parameter
  std::string note;              // a caveat about the exported model, when there is one
};

// Writes `weights` of `model` into `dir` (created): dir/model.pt for mlp, cnn,
// resnet, logreg (linear on the flattened input) and torchscript:FILE (that
// module with these weights); dir/state_dict.pt, the module's state_dict
// (torch.load() gives a dict that load_state_dict() takes); and
// dir/weights/NAME.npy per parameter. Every name is the module's own
// (PyTorch's dotted `fc1.weight`, never Sparrow's flat `fc1_weight` of a
// TorchScript model), so model.pt, state_dict.pt and the .npy files agree key
// for key. resnet's BatchNorm layers normalise with each batch's statistics
// (the global model has no running statistics), said in `note`. ConfigError
// (nothing written) when the weights do not match the model or the model has
// no TorchScript form.
ExportResult export_model(const std::string& model, const std::map<std::string, at::Tensor>& weights,
                          const std::string& dir);

// The TorchScript module export_model() writes (not saved): for tests and
// for programs that want it in memory.
void save_torchscript(const std::string& model, const std::map<std::string, at::Tensor>& weights,
                      const std::string& path);

}  // namespace sparrow::core
