#include "lite/model.h"

#include <algorithm>
#include <cctype>
#include <set>
#include <sstream>

#include "core/rng.h"
#include "lite/layer_specs.h"

namespace sparrow::lite {

Model::Model(ModelSpec spec, ModelOutput output) : spec_(std::move(spec)) {
  SPARROW_LITE_CHECK(!spec_.input_shape.empty() && numel(spec_.input_shape) > 0,
                     "model: the input shape " << shape_str(spec_.input_shape) << " is empty");
  SPARROW_LITE_CHECK(!spec_.layers.empty(), "model: no layers");
  Shape s = spec_.input_shape;
  std::set<std::string> names;
  for (size_t i = 0; i < spec_.layers.size(); ++i) {
    const LayerSpec& ls = spec_.layers[i];
    if (ls.kind == LayerKind::kEmbedding) SPARROW_LITE_CHECK(i == 0, "model: embedding must be the first layer");
    layers_.push_back(make_layer(ls));
    try {
      s = layers_.back()->out_shape(s);
    } catch (const Error& e) {
      throw Error("model: layer " + std::to_string(i) + " (" + kind_name(ls.kind) + "): " + e.what());
    }
    for (Param& p : layers_.back()->params()) {
      SPARROW_LITE_CHECK(names.insert(p.name).second, "model: two parameters are named '" << p.name << "'");
      params_.push_back(&p);
      num_values_ += numel(p.shape);
    }
  }
  if (output == ModelOutput::kLogits) {
    SPARROW_LITE_CHECK(s.size() == 1 && s[0] > 0,
                       "model: the last layer's output must be [classes] logits per sample, got " << shape_str(s));
    classes_ = s[0];
  } else {
    SPARROW_LITE_CHECK(!s.empty() && numel(s) > 0, "model: the last layer's output " << shape_str(s) << " is empty");
  }
  SPARROW_LITE_CHECK(!params_.empty(), "model: no parameters");
  output_shape_ = s;
  acts_.resize(layers_.size() + 1);
}

std::vector<std::string> Model::param_names() const {
  std::vector<std::string> out;
  for (const Param* p : params_) out.push_back(p->name);
  return out;
}

std::vector<Shape> Model::param_shapes() const {
  std::vector<Shape> out;
  for (const Param* p : params_) out.push_back(p->shape);
  return out;
}

std::vector<float> Model::get_values() const {
  std::vector<float> out;
  out.reserve(static_cast<size_t>(num_values_));
  for (const Param* p : params_) out.insert(out.end(), p->value.begin(), p->value.end());
  return out;
}

void Model::set_values(const std::vector<float>& values) {
  SPARROW_LITE_CHECK(static_cast<int64_t>(values.size()) == num_values_,
                     "model: " << values.size() << " parameter values given, the model has " << num_values_);
  auto it = values.begin();
  for (Param* p : params_) {
    std::copy(it, it + static_cast<std::ptrdiff_t>(p->value.size()), p->value.begin());
    it += static_cast<std::ptrdiff_t>(p->value.size());
  }
}

Tensor& Model::input(int64_t batch) {
  Shape s{batch};
  s.insert(s.end(), spec_.input_shape.begin(), spec_.input_shape.end());
  acts_[0].resize(s);
  return acts_[0];
}

const Tensor& Model::forward(const ForwardContext& ctx) {
  ForwardContext c = ctx;
  for (size_t i = 0; i < layers_.size(); ++i) {
    c.dropout_key = rng::derive(ctx.dropout_key, i);
    layers_[i]->forward(acts_[i], acts_[i + 1], c);
  }
  return acts_.back();
}

void Model::backward(const Tensor& doutput) {
  const Tensor* dy = &doutput;
  for (size_t i = layers_.size(); i-- > 0;) {
    Tensor* dx = i == 0 ? nullptr : (dy == &grad_a_ ? &grad_b_ : &grad_a_);
    layers_[i]->backward(acts_[i], acts_[i + 1], *dy, dx);
    dy = dx;
  }
}

namespace {

using spec::linear;
using spec::plain;

LayerSpec conv5x5(const std::string& name, int64_t in, int64_t out) {
  return spec::conv2d(name, in, out, 5, 5, 1, 1, 2, 2);
}

LayerSpec max_pool2() { return spec::pool(LayerKind::kMaxPool2d, 2, 2, 0); }

}  // namespace

ModelSpec builtin_spec(const std::string& name, int64_t input_dim, int64_t classes) {
  ModelSpec m;
  if (name == "mlp") {
    m.input_shape = {784};
    m.layers = {linear("fc1", 784, 200), plain(LayerKind::kRelu), linear("fc2", 200, 200), plain(LayerKind::kRelu),
                linear("fc3", 200, 10)};
  } else if (name == "cnn") {
    m.input_shape = {1, 28, 28};
    m.layers = {conv5x5("conv1", 1, 32),    plain(LayerKind::kRelu),  max_pool2(),
                conv5x5("conv2", 32, 64),   plain(LayerKind::kRelu),  max_pool2(),
                plain(LayerKind::kFlatten), linear("fc1", 3136, 512), plain(LayerKind::kRelu),
                linear("fc2", 512, 10)};
  } else if (name == "logreg") {
    SPARROW_LITE_CHECK(input_dim > 0 && classes > 0, "model 'logreg' needs the data's feature count and classes");
    m.input_shape = {input_dim};
    m.layers = {linear("fc", input_dim, classes)};
  } else {
    SPARROW_LITE_CHECK(false, "no built-in lite model '" << name << "' (known: mlp, cnn, logreg)");
  }
  return m;
}

namespace {

std::string stage_list(const std::vector<Stage>& stages, size_t n) {
  std::ostringstream os;
  for (size_t i = 0; i < n; ++i) os << (i ? ", " : "") << stages[i].name;
  return os.str();
}

bool all_digits(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](unsigned char c) { return std::isdigit(c) != 0; });
}

}  // namespace

std::vector<Stage> builtin_stages(const std::string& name) {
  if (name == "mlp") return {{"fc1", 2}, {"fc2", 2}, {"fc3", 1}};
  if (name == "cnn") return {{"conv1", 3}, {"conv2", 3}, {"fc1", 3}, {"fc2", 1}};
  SPARROW_CHECK_T(ConfigError, false,
                  "model '" << name << "' cannot be cut on the lite runtime (built-in models with stages: mlp, cnn)");
  return {};
}

size_t builtin_cut(const std::string& name, const std::string& cut) {
  const std::vector<Stage> stages = builtin_stages(name);
  const std::string listed = stage_list(stages, stages.size());
  size_t k = 0;
  auto through = [&](const std::string& stage) {
    for (size_t i = 0; i < stages.size(); ++i)
      if (stages[i].name == stage) return i + 1;
    SPARROW_CHECK_T(ConfigError, false, "unknown cut '" << cut << "' (stages: " << listed << ")");
    return size_t{0};
  };
  // The built-in stage names are not numbers, so a bare number is a count
  // (edge::split_model refuses it as ambiguous only for numbered stages).
  auto count = [&](const std::string& digits) {
    SPARROW_CHECK_T(ConfigError, all_digits(digits), "cut '" << cut << "': 'first:' takes a number of stages");
    return digits.size() > 6 ? size_t{0} : static_cast<size_t>(std::stoul(digits));
  };
  if (cut.rfind("first:", 0) == 0)
    k = count(cut.substr(6));
  else if (cut.rfind("after:", 0) == 0)
    k = through(cut.substr(6));
  else if (all_digits(cut))
    k = count(cut);
  else
    k = through(cut);
  SPARROW_CHECK_T(ConfigError, k >= 1 && k < stages.size(),
                  "cut '" << cut << "' leaves an empty half (cut after one of: "
                          << stage_list(stages, stages.size() - 1) << ", or a count 1.." << stages.size() - 1 << ")");
  return k;
}

ModelSpec builtin_bottom_spec(const std::string& name, const std::string& cut) {
  const std::vector<Stage> stages = builtin_stages(name);
  const size_t k = builtin_cut(name, cut);
  size_t layers = 0;
  for (size_t i = 0; i < k; ++i) layers += stages[i].layers;
  ModelSpec m = builtin_spec(name);
  m.layers.resize(layers);
  return m;
}

}  // namespace sparrow::lite
