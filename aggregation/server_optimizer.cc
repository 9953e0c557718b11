#include "aggregation/server_optimizer.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <cmath>
#include <cstring>
#include <set>
#include <utility>

#include "aggregation/rules.h"
#include "compression/compressor.h"
#include "compression/encoded.h"
#include "compression/lowrank.h"
#include "compression/state.h"
#include "core/error.h"
#include "core/registry.h"
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

core::Registry<OptimizerFactory>& registry() {
  static core::Registry<OptimizerFactory> r("server optimizer");
  return r;
}

// ---- the built-in methods -----------------------------------------------------

class FedAvg final : public OptimizerMethod {
 public:
  explicit FedAvg(double lr) : lr_(lr) {}
  void step(const std::string&, at::Tensor& w, const at::Tensor& d, Slots&) const override {
    w.add_(d, static_cast<float>(lr_));
  }

 private:
  double lr_;
};

class FedAvgM final : public OptimizerMethod {
 public:
  FedAvgM(double lr, double momentum) : lr_(lr), momentum_(momentum) {}
  std::vector<std::string> moments() const override { return {"m"}; }
  void step(const std::string&, at::Tensor& w, const at::Tensor& d, Slots& s) const override {
    at::Tensor& m = s["m"];
    if (!m.defined()) m = at::zeros(w.sizes(), w.options().requires_grad(false));
    m.mul_(static_cast<float>(momentum_)).add_(d);
    w.add_(m, static_cast<float>(lr_));
  }

 private:
  double lr_, momentum_;
};

// fedadam, fedyogi, fedadagrad: Reddi et al.'s Algorithm 2 (header).
class Adaptive final : public OptimizerMethod {
 public:
  enum class Kind { kAdam, kYogi, kAdagrad };
  Adaptive(Kind kind, double lr, double beta1, double beta2, double tau)
      : kind_(kind), lr_(lr), beta1_(beta1), beta2_(beta2), tau_(tau) {}
  std::vector<std::string> moments() const override { return {"m", "v"}; }
  void step(const std::string&, at::Tensor& w, const at::Tensor& d, Slots& s) const override {
    const float b1 = static_cast<float>(beta1_), b2 = static_cast<float>(beta2_);
    const float tau = static_cast<float>(tau_);
    at::Tensor& m = s["m"];
    at::Tensor& v = s["v"];
    const auto opts = at::TensorOptions().dtype(at::kFloat);
    if (!m.defined()) m = at::zeros(w.sizes(), opts);
    if (!v.defined()) v = at::full(w.sizes(), tau * tau, opts);
    m.mul_(b1).add_(d, 1.0f - b1);
    const at::Tensor d2 = d * d;
    if (kind_ == Kind::kAdam) {
      v.mul_(b2).add_(d2, 1.0f - b2);
    } else if (kind_ == Kind::kYogi) {
      v.sub_(d2 * at::sign(v - d2), 1.0f - b2);
    } else {
      v.add_(d2);
    }
    w.addcdiv_(m, v.sqrt().add_(tau), static_cast<float>(lr_));
  }

 private:
  Kind kind_;
  double lr_, beta1_, beta2_, tau_;
};

// fedtopk / fedlowrank: server-side error feedback. Slot "m" is the momentum,
// "v" the error e; m = momentum·m + d;  e += lr·m (both created as zeros on
// the first step); returns e.
at::Tensor& compensate(Slots& s, const at::Tensor& w, const at::Tensor& d, double momentum, double lr) {
  at::Tensor& m = s["m"];
  at::Tensor& e = s["v"];
  const auto opts = at::TensorOptions().dtype(at::kFloat);
  if (!m.defined()) m = at::zeros(w.sizes(), opts);
  if (!e.defined()) e = at::zeros(w.sizes(), opts);
  m.mul_(static_cast<float>(momentum)).add_(d);
  e.add_(m, static_cast<float>(lr));
  return e;
}

// mu with its mantissa rounded to 8 bits: then w ± mu is exact for every
// |w| <= 2^16·mu, so W − B after the step is exactly ±mu and stc re-encodes the
// step bit for bit (the broadcast stays W). The rounding (< 0.4%) stays in e.
float round_magnitude(double mu) {
  int ex = 0;
  const double m = std::frexp(mu, &ex);
  return static_cast<float>(std::ldexp(std::round(m * 256.0) / 256.0, ex));
}

class FedTopK final : public OptimizerMethod {
 public:
  FedTopK(double lr, double momentum, double ratio, bool sign, bool model_scope)
      : lr_(lr), momentum_(momentum), ratio_(ratio), sign_(sign), model_scope_(model_scope) {}
  std::vector<std::string> moments() const override { return {"m", "v"}; }
  bool needs_contiguous() const override { return true; }
  void step(const std::string&, at::Tensor& w, const at::Tensor& d, Slots& s) const override {
    at::Tensor& e = compensate(s, w, d, momentum_, lr_);
    const int64_t n = e.numel();
    if (n == 0) return;
    const int64_t k = std::min<int64_t>(n, std::max<int64_t>(1, static_cast<int64_t>(std::ceil(ratio_ * n))));
    apply(std::get<1>(at::topk(e.reshape(-1).abs(), k)), w, s);  // once a round: ATen's is fine
  }
  // scope=model: one k = ceil(R·N) over all N parameters, so a tensor gets
  // positions only where its |e| is among the model's largest (small tensors
  // such as biases often get none, and then no downlink bytes).
  void step_model(std::map<std::string, at::Tensor>& weights, const std::map<std::string, at::Tensor>& delta,
                  std::map<std::string, Slots>& state) const override {
    if (!model_scope_) return OptimizerMethod::step_model(weights, delta, state);
    std::vector<at::Tensor> flat;
    for (auto& [name, w] : weights)
      flat.push_back(compensate(state[name], w, delta.at(name).contiguous(), momentum_, lr_).reshape(-1).abs());
    const at::Tensor all = at::cat(flat);
    const int64_t total = all.numel();
    if (total == 0) return;
    const int64_t k = std::min<int64_t>(total, std::max<int64_t>(1, static_cast<int64_t>(std::ceil(ratio_ * total))));
    const at::Tensor idx = std::get<1>(at::topk(all, k));
    int64_t begin = 0;
    for (auto& [name, w] : weights) {
      const int64_t n = w.numel();
      const at::Tensor mine = idx.masked_select(idx.ge(begin).logical_and(idx.lt(begin + n))) - begin;
      if (mine.numel() > 0) apply(std::get<0>(at::sort(mine)), w, state[name]);
      begin += n;
    }
  }

 private:
  // Moves w at positions idx by e there (ternary ±mu with sign_), keeps the
  // rest in e and zeroes the momentum there (FetchSGD's masking).
  void apply(at::Tensor idx, at::Tensor& w, Slots& s) const {
    at::Tensor& e = s["v"];
    at::Tensor& m = s["m"];
    at::Tensor sent = e.reshape(-1).index_select(0, idx);
    if (sign_) {
      // Ternary: ±mu with mu the mean magnitude of those sent (rounded by
      // round_magnitude), exact zeros not sent (they would be +mu). The step
      // is then what stc encodes without loss, so a downlink stc keeps the
      // broadcast at W; e keeps e − (±mu).
      const at::Tensor nz = sent.ne(0.0f);
      idx = idx.masked_select(nz);
      sent = sent.masked_select(nz);
      if (sent.numel() == 0) return;
      const double sum = sent.abs().to(at::kDouble).sum().item<double>();
      const float mu = round_magnitude(sum / static_cast<double>(sent.numel()));
      sent = at::where(sent.lt(0.0f), at::full_like(sent, -mu), at::full_like(sent, mu));
    }
    w.view(-1).index_add_(0, idx, sent);
    if (sign_)
      e.view(-1).index_add_(0, idx, sent, -1.0);
    else
      e.view(-1).index_fill_(0, idx, 0.0f);
    if (momentum_ > 0.0) m.view(-1).index_fill_(0, idx, 0.0f);
  }

  double lr_, momentum_, ratio_;
  bool sign_, model_scope_;
};

class FedLowRank final : public OptimizerMethod {
 public:
  FedLowRank(double lr, double momentum, int64_t rank) : lr_(lr), momentum_(momentum), rank_(rank) {}
  std::vector<std::string> moments() const override { return {"m", "v"}; }
  std::vector<std::string> extra_slots() const override { return {"q"}; }  // the warm-start factor Q {cols, r}
  bool needs_contiguous() const override { return true; }
  void step(const std::string& name, at::Tensor& w, const at::Tensor& d, Slots& s) const override {
    at::Tensor& e = compensate(s, w, d, momentum_, lr_);
    const std::vector<int64_t> shape = w.sizes().vec();
    if (!compression::lowrank_compressible(shape, rank_)) {
      w.add_(e);
      e.zero_();
      return;
    }
    const compression::LowRankDims dims = compression::lowrank_dims(shape, rank_);
    at::Tensor& q = s["q"];
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
  }
  void check_slots(const std::string& name, const Slots& s) const override {
    auto it = s.find("q");
    if (it == s.end()) return;
    const at::Tensor& t = it->second;
    SPARROW_CHECK_T(FormatError, t.dim() == 2 && t.scalar_type() == at::kFloat,
                    "server optimizer state: factor of '" << name << "' does not match");
    const compression::LowRankDims d = compression::lowrank_dims(s.at("m").sizes().vec(), rank_);
    SPARROW_CHECK_T(FormatError, t.size(0) == d.cols && t.size(1) == d.rank,
                    "server optimizer state: factor of '" << name << "' is " << t.sizes() << ", rank " << rank_
                                                          << " needs {" << d.cols << ", " << d.rank << "}");
  }

 private:
  double lr_, momentum_;
  int64_t rank_;
};

// fedadam and fedyogi read the same keys.
OptimizerFactory adaptive(Adaptive::Kind kind) {
  return [kind](Spec& s) {
    const double lr = positive(s, "lr", 0.01);
    const double beta1 = in_unit(s, "beta1", 0.9);
    const double beta2 = in_unit(s, "beta2", 0.99);
    return std::make_shared<Adaptive>(kind, lr, beta1, beta2, positive(s, "tau", 1e-3));
  };
}

template <class C>
std::string joined(const C& v) {
  std::string out;
  for (const auto& x : v) out += (out.empty() ? "" : ", ") + x;
  return out;
}

}  // namespace

void detail::register_optimizers() {
  auto& r = registry();
  r.add(
      "fedavg", [](Spec& s) { return std::make_shared<FedAvg>(positive(s, "lr", 1.0)); }, "[lr=1] x += lr·Δ");
  r.add(
      "fedavgm",
      [](Spec& s) {
        const double lr = positive(s, "lr", 1.0);
        return std::make_shared<FedAvgM>(lr, in_unit(s, "momentum", 0.9));
      },
      "[lr=1,momentum=0.9] server momentum: m = momentum·m + Δ; x += lr·m");
  r.add("fedadam", adaptive(Adaptive::Kind::kAdam),
        "[lr=0.01,beta1=0.9,beta2=0.99,tau=1e-3] FedAdam (Reddi et al., ICLR 2021)");
  r.add("fedyogi", adaptive(Adaptive::Kind::kYogi),
        "[lr=0.01,beta1=0.9,beta2=0.99,tau=1e-3] FedYogi (Reddi et al., ICLR 2021)");
  r.add(
      "fedadagrad",
      [](Spec& s) {
        const double lr = positive(s, "lr", 0.01);
        const double beta1 = in_unit(s, "beta1", 0.0);
        return std::make_shared<Adaptive>(Adaptive::Kind::kAdagrad, lr, beta1, 0.0, positive(s, "tau", 1e-3));
      },
      "[lr=0.01,tau=1e-3,beta1=0] FedAdagrad (Reddi et al., ICLR 2021)");
  r.add(
      "fedtopk",
      [](Spec& s) {
        const double lr = positive(s, "lr", 1.0);
        const double momentum = in_unit(s, "momentum", 0.0);
        const double ratio = s.get_double("ratio", 0.01);
        SPARROW_CHECK_T(ConfigError, ratio > 0.0 && ratio <= 1.0, "fedtopk: ratio must be in (0, 1], got " << ratio);
        const std::string values = s.get_string("values", "fp32");
        SPARROW_CHECK_T(ConfigError, values == "fp32" || values == "sign",
                        "fedtopk: values must be fp32 or sign, got '" << values << "'");
        const std::string scope = s.get_string("scope", "tensor");
        SPARROW_CHECK_T(ConfigError, scope == "tensor" || scope == "model",
                        "fedtopk: scope must be tensor or model, got '" << scope << "'");
        return std::make_shared<FedTopK>(lr, momentum, ratio, values == "sign", scope == "model");
      },
      "[ratio=0.01,lr=1,momentum=0,values=fp32|sign,scope=tensor|model] top-k server step with server-side error "
      "feedback");
  r.add(
      "fedlowrank",
      [](Spec& s) {
        const double lr = positive(s, "lr", 1.0);
        const double momentum = in_unit(s, "momentum", 0.0);
        const int64_t rank = s.get_int("rank", 4);
        SPARROW_CHECK_T(ConfigError, rank >= 1 && rank <= 1024, "fedlowrank: rank must be in [1, 1024], got " << rank);
        return std::make_shared<FedLowRank>(lr, momentum, rank);
      },
      "[rank=4,lr=1,momentum=0] rank-R server step (PowerSGD) with server-side error feedback");
}

void register_server_optimizer(const std::string& name, OptimizerFactory factory, const std::string& description) {
  register_builtins();  // first, so that a user's name clashing with a built-in fails here
  SPARROW_CHECK(factory, "register_server_optimizer: '" << name << "' has no factory");
  registry().add(name, std::move(factory), description);
}

std::vector<std::string> server_optimizer_names() {
  register_builtins();
  return registry().names();
}

bool known_server_optimizer(const std::string& name) {
  register_builtins();
  return registry().contains(name);
}

std::string server_optimizer_description(const std::string& name) {
  register_builtins();
  return registry().description(name);
}

ServerOptimizer::ServerOptimizer(const std::string& spec_text) : spec_(spec_text) {
  register_builtins();
  Spec spec = Spec::parse(spec_text);
  method_ = spec.method();
  impl_ = registry().get(method_)(spec);
  SPARROW_CHECK(impl_, "server optimizer '" << method_ << "': its factory returned no method");
  spec.check_all_consumed();
}

void ServerOptimizer::step(std::map<std::string, at::Tensor>& weights, const std::map<std::string, at::Tensor>& delta) {
  // Everything is checked before anything changes.
  SPARROW_CHECK(weights.size() == delta.size(),
                "server optimizer: weights have " << weights.size() << " tensors, delta " << delta.size());
  const std::vector<std::string> moments = impl_->moments();
  const bool have_state = !moments.empty() && !state_.empty();
  for (const auto& [name, w] : weights) {
    auto it = delta.find(name);
    SPARROW_CHECK(it != delta.end(), "server optimizer: delta lacks tensor '" << name << "'");
    check_tensor(w, name, "weight");
    check_tensor(it->second, name, "delta");
    SPARROW_CHECK(w.sizes().equals(it->second.sizes()),
                  "server optimizer: '" << name << "' weight " << w.sizes() << " vs delta " << it->second.sizes());
    SPARROW_CHECK(compression::all_finite(it->second), "server optimizer: delta of '" << name << "' is not finite");
    SPARROW_CHECK(!impl_->needs_contiguous() || w.is_contiguous(),
                  "server optimizer: " << method_ << " needs contiguous weights ('" << name << "' is not)");
    if (have_state) {
      auto sit = state_.find(name);
      bool match = sit != state_.end();
      for (const std::string& slot : moments) {
        if (!match) break;
        auto t = sit->second.find(slot);
        match = t != sit->second.end() && t->second.sizes().equals(w.sizes());
      }
      SPARROW_CHECK(
          match, "server optimizer: '" << name << "' does not match the optimizer state (tensor set or shape changed)");
    }
  }
  if (have_state)
    SPARROW_CHECK(state_.size() == weights.size(), "server optimizer: tensor set differs from the optimizer state");

  at::NoGradGuard no_grad;
  impl_->step_model(weights, delta, state_);
  ++steps_;
}

void OptimizerMethod::step_model(std::map<std::string, at::Tensor>& weights,
                                 const std::map<std::string, at::Tensor>& delta,
                                 std::map<std::string, Slots>& state) const {
  const bool stateless = moments().empty() && extra_slots().empty();
  for (auto& [name, w] : weights) {
    const at::Tensor d = delta.at(name).contiguous();
    if (stateless) {
      Slots none;
      step(name, w, d, none);
    } else {
      step(name, w, d, state[name]);
    }
  }
}

std::string ServerOptimizer::serialize_state() const {
  compression::State st;
  st.step = steps_;
  for (const auto& [name, slots] : state_)
    for (const auto& [slot, t] : slots) st.tensors[slot + "/" + name] = t;
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
  const std::vector<std::string> moments = impl_->moments();
  std::set<std::string> kept(moments.begin(), moments.end());
  for (const std::string& x : impl_->extra_slots()) kept.insert(x);
  std::map<std::string, Slots> state;
  for (const auto& [key, t] : st.tensors) {
    const size_t slash = key.find('/');
    const std::string slot = key.substr(0, slash);
    SPARROW_CHECK_T(FormatError, slash != std::string::npos && slash + 1 < key.size() && kept.count(slot),
                    "server optimizer state: unexpected slot '" << key << "' (" << method_ << " keeps "
                                                                << (kept.empty() ? "none" : joined(kept)) << ")");
    state[key.substr(slash + 1)][slot] = t;
  }
  for (const auto& [name, slots] : state) {
    const at::Tensor* first = nullptr;
    for (const std::string& m : moments) {
      auto it = slots.find(m);
      SPARROW_CHECK_T(FormatError, it != slots.end() && (!first || it->second.sizes().equals(first->sizes())),
                      "server optimizer state: " << joined(moments) << " of '" << name << "' do not match");
      first = &it->second;
    }
    impl_->check_slots(name, slots);
  }
  steps_ = st.step;
  state_ = std::move(state);
}

void ServerOptimizer::reset_state() {
  steps_ = 0;
  state_.clear();
}

at::Tensor ServerOptimizer::slot(const std::string& name, const std::string& slot) const {
  auto it = state_.find(name);
  if (it == state_.end()) return at::Tensor();
  auto t = it->second.find(slot);
  return t == it->second.end() ? at::Tensor() : t->second;
}

at::Tensor ServerOptimizer::first_moment(const std::string& name) const { return slot(name, "m"); }

at::Tensor ServerOptimizer::second_moment(const std::string& name) const { return slot(name, "v"); }

}  // namespace sparrow::aggregation
