#include "liteedge/bottom.h"

#include <fstream>
#include <iterator>
#include <set>

#include "core/error.h"
#include "lite/model_file.h"
#include "liteclient/layout.h"

namespace sparrow::liteedge {
namespace {

namespace cflat = compression::flat;

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  SPARROW_CHECK_T(ConfigError, in, "weights: cannot read '" << path << "'");
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

}  // namespace

Bottom::Bottom(const DeviceConfig& cfg)
    : codec_(cfg.codec),
      frozen_(cfg.freeze),
      lr_(static_cast<float>(cfg.lr)),
      momentum_factor_(static_cast<float>(cfg.momentum)) {
  model_ = std::make_unique<lite::Model>(lite::builtin_bottom_spec(cfg.model, cfg.cut), lite::ModelOutput::kAny);
  names_ = model_->param_names();
  digest_ = liteclient::model_digest(liteclient::Layout::make(names_, model_->param_shapes()));
  for (const lite::Param* p : model_->params()) momentum_.emplace_back(p->value.size(), 0.0f);
  SPARROW_CHECK_T(ConfigError, !cfg.weights.empty(), "weights: sparrow-edge-lite needs the bottom's initial weights");
  load_weights(cfg.weights, cfg.model);
}

void Bottom::load_weights(const std::string& path, const std::string& model) {
  const std::string bytes = read_file(path);
  // The whole model's parameters as the LibTorch model names them.
  const lite::Model whole(lite::builtin_spec(model));
  const std::vector<std::string> all_names = whole.param_names();
  const std::vector<lite::Shape> all_shapes = whole.param_shapes();
  const std::vector<lite::Param*>& params = model_->params();
  if (bytes.compare(0, 8, "SPRWLITE") == 0) {
    const lite::ModelFile f =
        lite::decode_model_file(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "weights '" + path + "'");
    const lite::Model file_model(f.spec);
    SPARROW_CHECK_T(FormatError, file_model.param_names() == all_names && file_model.param_shapes() == all_shapes,
                    "weights '" << path << "' is a lite model file of another model than '" << model << "'");
    // The bottom's parameters come first in the flat vector (model order).
    auto it = f.values.begin();
    for (lite::Param* p : params) {
      std::copy(it, it + static_cast<std::ptrdiff_t>(p->value.size()), p->value.begin());
      it += static_cast<std::ptrdiff_t>(p->value.size());
    }
    return;
  }
  cflat::State st;
  try {
    st = cflat::State::deserialize(bytes);
  } catch (const FormatError& e) {
    throw FormatError("weights '" + path + "' is neither a weights file nor a lite model file (" + e.what() + ")");
  }
  const std::set<std::string> known(all_names.begin(), all_names.end());
  for (const auto& [name, t] : st.tensors)
    SPARROW_CHECK_T(FormatError, known.count(name),
                    "weights '" << path << "': '" << name << "' is not a parameter of the model");
  for (lite::Param* p : params) {
    auto it = st.tensors.find(p->name);
    SPARROW_CHECK_T(FormatError, it != st.tensors.end(),
                    "weights '" << path << "' has no '" << p->name
                                << "' (sparrow-edge-lite takes every bottom parameter from the file)");
    SPARROW_CHECK_T(FormatError, it->second.shape == p->shape,
                    "weights '" << path << "': '" << p->name << "' has the wrong shape");
  }
  for (lite::Param* p : params) p->value = st.tensors.at(p->name).data;
}

edge::ActPacket Bottom::forward(const float* x, int64_t rows) {
  pending_ = false;
  lite::Tensor& in = model_->input(rows);
  std::copy(x, x + in.numel(), in.ptr());
  lite::ForwardContext ctx;
  ctx.train = true;
  const lite::Tensor& a = model_->forward(ctx);
  edge::ActPacket p = codec_.encode(a.ptr(), a.shape, state_);
  p.want_gradient = !frozen_;
  pending_ = p.want_gradient;
  rows_ = rows;
  return p;
}

void Bottom::backward(const edge::ActPacket& gradient) {
  SPARROW_CHECK(pending_, "Bottom::backward: no pending forward that wants a gradient");
  std::vector<int64_t> expected{rows_};  // the activation's shape: [rows, output_shape...]
  expected.insert(expected.end(), model_->output_shape().begin(), model_->output_shape().end());
  grad_.data = edge::flat::decode_gradient(gradient, state_, expected);  // throws before any change
  grad_.shape = expected;
  model_->backward(grad_);
  pending_ = false;
}

void Bottom::step() {
  if (frozen_) return;
  const std::vector<lite::Param*>& params = model_->params();
  for (size_t i = 0; i < params.size(); ++i) {
    std::vector<float>& w = params[i]->value;
    const std::vector<float>& g = params[i]->grad;
    std::vector<float>& buf = momentum_[i];
    for (size_t j = 0; j < w.size(); ++j) {
      buf[j] = buf[j] * momentum_factor_ + g[j];
      w[j] -= lr_ * buf[j];
    }
  }
}

edge::ActPacket Bottom::infer(const float* x, int64_t rows) {
  pending_ = false;
  lite::Tensor& in = model_->input(rows);
  std::copy(x, x + in.numel(), in.ptr());
  const lite::Tensor& a = model_->forward(lite::ForwardContext{});
  edge::flat::CodecState scratch = state_;  // the training basis, left as is
  edge::ActPacket p = codec_.encode(a.ptr(), a.shape, scratch, /*infer=*/true);
  p.want_gradient = false;
  return p;
}

std::map<std::string, cflat::Tensor> Bottom::weights() const {
  std::map<std::string, cflat::Tensor> out;
  for (const lite::Param* p : model_->params()) out[p->name] = cflat::Tensor{p->shape, p->value};
  return out;
}

}  // namespace sparrow::liteedge
