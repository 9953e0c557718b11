#include "aggregation/server_optimizer.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <cmath>
#include <cstring>

#include "compression/compressor.h"
#include "compression/encoded.h"
#include "compression/lowrank.h"
#include "compression/state.h"
#include "core/error.h"
#include "core/spec.h"

namespace sparrow::aggregation {

namespace {

constexpr char kMagic[4] = {'S', 'P', 'S', 'O'};
constexpr uint32_t kVersion = 1;

void put_u32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

uint32_t get_u32(const std::string& in, size_t pos) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<uint8_t>(in[pos + i])) << (8 * i);
  return v;
}

double in_unit(Spec& spec, const std::string& key, double def) {
  const double v = spec.get_double(key, def);
  SPARROW_CHECK_T(ConfigError, v >= 0.0 && v < 1.0, spec.method() << ": " << key << " must be in [0, 1), got " << v);
  return v;
}

double positive(Spec& spec, const std::string& key, double def) {
  const double v = spec.get_double(key, def);
  SPARROW_CHECK_T(ConfigError, v > 0.0 && std::isfinite(v), spec.method() << ": " << key << " must be > 0, got " << v);
  return v;
}

void check_tensor(const at::Tensor& t, const std::string& name, const char* what) {
  SPARROW_CHECK(t.defined() && t.scalar_type() == at::kFloat && t.device().is_cpu(),
                "server optimizer: " << what << " '" << name << "' must be a float32 CPU tensor");
}

}  // namespace

ServerOptimizer::ServerOptimizer(const std::string& spec_text) : kind_(Kind::kFedAvg), spec_(spec_text) {
  Spec spec = Spec::parse(spec_text);
  method_ = spec.method();
  if (method_ == "fedavg") {
    kind_ = Kind::kFedAvg;
    lr_ = positive(spec, "lr", 1.0);
  } else if (method_ == "fedavgm") {
    kind_ = Kind::kFedAvgM;
    lr_ = positive(spec, "lr", 1.0);
    momentum_ = in_unit(spec, "momentum", 0.9);
  } else if (method_ == "fedadam" || method_ == "fedyogi") {
    kind_ = method_ == "fedadam" ? Kind::kFedAdam : Kind::kFedYogi;
    lr_ = positive(spec, "lr", 0.01);
    beta1_ = in_unit(spec, "beta1", 0.9);
    beta2_ = in_unit(spec, "beta2", 0.99);
    tau_ = positive(spec, "tau", 1e-3);
  } else if (method_ == "fedadagrad") {
    kind_ = Kind::kFedAdagrad;
    lr_ = positive(spec, "lr", 0.01);
    beta1_ = in_unit(spec, "beta1", 0.0);
    tau_ = positive(spec, "tau", 1e-3);
  } else if (method_ == "fedtopk") {
    kind_ = Kind::kFedTopK;
    lr_ = positive(spec, "lr", 1.0);
    momentum_ = in_unit(spec, "momentum", 0.0);
    ratio_ = spec.get_double("ratio", 0.01);
    SPARROW_CHECK_T(ConfigError, ratio_ > 0.0 && ratio_ <= 1.0, "fedtopk: ratio must be in (0, 1], got " << ratio_);
  } else if (method_ == "fedlowrank") {
    kind_ = Kind::kFedLowRank;
    lr_ = positive(spec, "lr", 1.0);
    momentum_ = in_unit(spec, "momentum", 0.0);
    rank_ = spec.get_int("rank", 4);
    SPARROW_CHECK_T(ConfigError, rank_ >= 1 && rank_ <= 1024, "fedlowrank: rank must be in [1, 1024], got " << rank_);
  } else {
    throw ConfigError("unknown server optimizer '" + method_ +
                      "' (known: fedavg, fedavgm, fedadam, fedyogi, fedadagrad, fedtopk, fedlowrank)");
  }
  spec.check_all_consumed();
}

at::Tensor& ServerOptimizer::compensate(const std::string& name, const at::Tensor& w, const at::Tensor& d, float lr) {
  at::Tensor& m = m_[name];
  at::Tensor& e = v_[name];
  const auto opts = at::TensorOptions().dtype(at::kFloat);
  if (!m.defined()) m = at::zeros(w.sizes(), opts);
  if (!e.defined()) e = at::zeros(w.sizes(), opts);
  m.mul_(static_cast<float>(momentum_)).add_(d);
  e.add_(m, lr);
  return e;
}

void ServerOptimizer::step(std::map<std::string, at::Tensor>& weights, const std::map<std::string, at::Tensor>& delta) {
  // Everything is checked before anything changes.
  SPARROW_CHECK(weights.size() == delta.size(),
                "server optimizer: weights have " << weights.size() << " tensors, delta " << delta.size());
  const bool stateful = kind_ != Kind::kFedAvg;
  const bool have_state = stateful && (!m_.empty() || !v_.empty());
  for (const auto& [name, w] : weights) {
    auto it = delta.find(name);
    SPARROW_CHECK(it != delta.end(), "server optimizer: delta lacks tensor '" << name << "'");
    check_tensor(w, name, "weight");
    check_tensor(it->second, name, "delta");
    SPARROW_CHECK(w.sizes().equals(it->second.sizes()),
                  "server optimizer: '" << name << "' weight " << w.sizes() << " vs delta " << it->second.sizes());
    SPARROW_CHECK(compression::all_finite(it->second), "server optimizer: delta of '" << name << "' is not finite");
    SPARROW_CHECK((kind_ != Kind::kFedTopK && kind_ != Kind::kFedLowRank) || w.is_contiguous(),
                  "server optimizer: " << method_ << " needs contiguous weights ('" << name << "' is not)");
    if (have_state) {
      const auto& ref = kind_ == Kind::kFedAvgM ? m_ : v_;
      auto sit = ref.find(name);
      SPARROW_CHECK(
          sit != ref.end() && sit->second.sizes().equals(w.sizes()),
          "server optimizer: '" << name << "' does not match the optimizer state (tensor set or shape changed)");
    }
  }
  if (have_state) {
    const auto& ref = kind_ == Kind::kFedAvgM ? m_ : v_;
    SPARROW_CHECK(ref.size() == weights.size(), "server optimizer: tensor set differs from the optimizer state");
  }

  at::NoGradGuard no_grad;
  const float lr = static_cast<float>(lr_);
  for (auto& [name, w] : weights) {
    const at::Tensor d = delta.at(name).contiguous();
    switch (kind_) {
      case Kind::kFedAvg:
        w.add_(d, lr);
        break;
      case Kind::kFedAvgM: {
        at::Tensor& m = m_[name];
        if (!m.defined()) m = at::zeros(w.sizes(), w.options().requires_grad(false));
        m.mul_(static_cast<float>(momentum_)).add_(d);
        w.add_(m, lr);
        break;
      }
      case Kind::kFedAdam:
      case Kind::kFedYogi:
      case Kind::kFedAdagrad: {
        const float b1 = static_cast<float>(beta1_), b2 = static_cast<float>(beta2_);
        const float tau = static_cast<float>(tau_);
        at::Tensor& m = m_[name];
        at::Tensor& v = v_[name];
        const auto opts = at::TensorOptions().dtype(at::kFloat);
        if (!m.defined()) m = at::zeros(w.sizes(), opts);
        if (!v.defined()) v = at::full(w.sizes(), tau * tau, opts);
        m.mul_(b1).add_(d, 1.0f - b1);
        const at::Tensor d2 = d * d;
        if (kind_ == Kind::kFedAdam) {
          v.mul_(b2).add_(d2, 1.0f - b2);
        } else if (kind_ == Kind::kFedYogi) {
          v.sub_(d2 * at::sign(v - d2), 1.0f - b2);
        } else {
          v.add_(d2);
        }
        w.addcdiv_(m, v.sqrt().add_(tau), lr);
        break;
      }
      case Kind::kFedTopK: {
        at::Tensor& e = compensate(name, w, d, lr);
        at::Tensor& m = m_[name];
        const int64_t n = e.numel();
        if (n == 0) break;
        const int64_t k = std::min<int64_t>(n, std::max<int64_t>(1, static_cast<int64_t>(std::ceil(ratio_ * n))));
        const at::Tensor idx = std::get<1>(at::topk(e.reshape(-1).abs(), k));  // once a round: ATen's is fine
        const at::Tensor sent = e.reshape(-1).index_select(0, idx);
        at::Tensor wf = w.view(-1);
        wf.index_add_(0, idx, sent);
        e.view(-1).index_fill_(0, idx, 0.0f);
        if (momentum_ > 0.0) m.view(-1).index_fill_(0, idx, 0.0f);
        break;
      }
      case Kind::kFedLowRank: {
        at::Tensor& e = compensate(name, w, d, lr);
        const std::vector<int64_t> shape = w.sizes().vec();
        if (!compression::lowrank_compressible(shape, rank_)) {
          w.add_(e);
          e.zero_();
          break;
        }
        const compression::LowRankDims dims = compression::lowrank_dims(shape, rank_);
        at::Tensor& q = q_[name];
        if (!q.defined()) {
          compression::Context ctx;
          ctx.name = name;
          q = compression::acp_initial_shared(ctx, dims, 0);  // seeded, orthonormal {cols, r}
        }
        const at::Tensor mat = e.view({dims.rows, dims.cols});
        at::Tensor p = at::mm(mat, q);
        compression::orthonormalize_columns(p);
        q = at::mm(mat.t(), p);
        const at::Tensor approx = at::mm(p, q.t());
        w.view({dims.rows, dims.cols}).add_(approx);
        mat.sub_(approx);
        break;
      }
    }
  }
  ++steps_;
}

std::string ServerOptimizer::serialize_state() const {
  compression::State st;
  st.step = steps_;
  for (const auto& [name, t] : m_) st.tensors["m/" + name] = t;
  for (const auto& [name, t] : v_) st.tensors["v/" + name] = t;
  for (const auto& [name, t] : q_) st.tensors["q/" + name] = t;
  std::string out(kMagic, 4);
  put_u32(out, kVersion);
  put_u32(out, static_cast<uint32_t>(method_.size()));
  out += method_;
  out += st.serialize();
  return out;
}

void ServerOptimizer::deserialize_state(const std::string& bytes) {
  SPARROW_CHECK_T(FormatError, bytes.size() >= 12 && std::memcmp(bytes.data(), kMagic, 4) == 0,
                  "server optimizer state: bad magic");
  SPARROW_CHECK_T(FormatError, get_u32(bytes, 4) == kVersion,
                  "server optimizer state: unsupported version " << get_u32(bytes, 4));
  const uint32_t len = get_u32(bytes, 8);
  SPARROW_CHECK_T(FormatError, len <= bytes.size() - 12, "server optimizer state: truncated");
  const std::string method = bytes.substr(12, len);
  SPARROW_CHECK_T(FormatError, method == method_,
                  "server optimizer state was saved by '" << method << "', this optimizer is '" << method_ << "'");
  const compression::State st = compression::State::deserialize(bytes.substr(12 + len));
  std::map<std::string, at::Tensor> m, v, q;
  for (const auto& [key, t] : st.tensors) {
    if (key.rfind("m/", 0) == 0) {
      m[key.substr(2)] = t;
    } else if (key.rfind("v/", 0) == 0) {
      v[key.substr(2)] = t;
    } else if (key.rfind("q/", 0) == 0 && kind_ == Kind::kFedLowRank) {
      q[key.substr(2)] = t;
    } else {
      throw FormatError("server optimizer state: unexpected slot '" + key + "'");
    }
  }
  const bool want_m = kind_ != Kind::kFedAvg;
  const bool want_v = kind_ == Kind::kFedAdam || kind_ == Kind::kFedYogi || kind_ == Kind::kFedAdagrad ||
                      kind_ == Kind::kFedTopK || kind_ == Kind::kFedLowRank;
  SPARROW_CHECK_T(FormatError, want_m || m.empty(), "server optimizer state: " << method_ << " keeps no m");
  SPARROW_CHECK_T(FormatError, want_v || v.empty(), "server optimizer state: " << method_ << " keeps no v");
  if (want_v) {
    SPARROW_CHECK_T(FormatError, m.size() == v.size(), "server optimizer state: m and v cover different tensors");
    for (const auto& [name, t] : m) {
      auto it = v.find(name);
      SPARROW_CHECK_T(FormatError, it != v.end() && it->second.sizes().equals(t.sizes()),
                      "server optimizer state: m and v of '" << name << "' do not match");
    }
  }
  for (const auto& [name, t] : q) {
    auto it = m.find(name);
    SPARROW_CHECK_T(FormatError, it != m.end() && t.dim() == 2 && t.scalar_type() == at::kFloat,
                    "server optimizer state: factor of '" << name << "' does not match");
    const compression::LowRankDims d = compression::lowrank_dims(it->second.sizes().vec(), rank_);
    SPARROW_CHECK_T(FormatError, t.size(0) == d.cols && t.size(1) == d.rank,
                    "server optimizer state: factor of '" << name << "' is " << t.sizes() << ", rank " << rank_
                                                          << " needs {" << d.cols << ", " << d.rank << "}");
  }
  steps_ = st.step;
  m_ = std::move(m);
  v_ = std::move(v);
  q_ = std::move(q);
}

void ServerOptimizer::reset_state() {
  steps_ = 0;
  m_.clear();
  v_.clear();
  q_.clear();
}

at::Tensor ServerOptimizer::first_moment(const std::string& name) const {
  auto it = m_.find(name);
  return it == m_.end() ? at::Tensor() : it->second;
}

at::Tensor ServerOptimizer::second_moment(const std::string& name) const {
  auto it = v_.find(name);
  return it == v_.end() ? at::Tensor() : it->second;
}

}  // namespace sparrow::aggregation
