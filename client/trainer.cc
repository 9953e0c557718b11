#include "client/trainer.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <sstream>

#include "core/error.h"
#include "core/rng.h"
#include "core/train_checks.h"
#include "core/spec.h"
#include "client/train_common.h"

namespace sparrow::client {
namespace {

constexpr const char* kAlgorithms = "fedavg, fedprox, scaffold, fednova, feddyn";

}  // namespace

namespace detail {

void fill_order(std::vector<int64_t>& order, int64_t n, uint64_t seed, int epoch) {
  order.resize(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), int64_t{0});
  rng::Stream s(rng::derive(seed, static_cast<uint64_t>(epoch)));
  for (int64_t i = n - 1; i > 0; --i) {
    const auto j = static_cast<int64_t>(s.below(static_cast<uint64_t>(i + 1)));
    std::swap(order[static_cast<size_t>(i)], order[static_cast<size_t>(j)]);
  }
}

std::string shape_str(at::IntArrayRef s) {
  std::ostringstream os;
  os << s;
  return os.str();
}

void check_weights(const Weights& w, const std::vector<std::string>& names, const std::vector<at::Tensor>& params,
                   const char* what, bool allow_empty) {
  if (allow_empty && w.empty()) return;
  for (size_t i = 0; i < names.size(); ++i) {
    auto it = w.find(names[i]);
    SPARROW_CHECK(it != w.end(), what << " lacks parameter '" << names[i] << "'");
    SPARROW_CHECK(it->second.defined(), what << "['" << names[i] << "'] is undefined");
    SPARROW_CHECK(it->second.sizes() == params[i].sizes(), what << "['" << names[i] << "'] has shape "
                                                                << shape_str(it->second.sizes()) << ", the model has "
                                                                << shape_str(params[i].sizes()));
  }
  if (w.size() != names.size()) {
    for (const auto& kv : w) {
      SPARROW_CHECK(std::find(names.begin(), names.end(), kv.first) != names.end(),
                    what << " holds '" << kv.first << "', which is no parameter of the model");
    }
  }
}

std::pair<at::Tensor, at::Tensor> prepare_data(const at::Tensor& x, const at::Tensor& y, const at::Tensor& like) {
  SPARROW_CHECK(x.defined() && y.defined(), "training data: x or y is undefined");
  SPARROW_CHECK(x.dim() >= 1 && y.dim() == 1, "training data: x must be {n, ...} and y {n}, got "
                                                  << shape_str(x.sizes()) << " and " << shape_str(y.sizes()));
  SPARROW_CHECK(x.size(0) == y.size(0),
                "training data: x has " << x.size(0) << " samples but y has " << y.size(0) << " labels");
  SPARROW_CHECK(x.size(0) > 0, "training data: no samples");
  SPARROW_CHECK(at::isFloatingType(x.scalar_type()), "training data: x must be floating, got " << x.scalar_type());
  SPARROW_CHECK(at::isIntegralType(y.scalar_type(), /*includeBool=*/false),
                "training data: y must hold integer class labels, got " << y.scalar_type());
  at::Tensor xd = x.to(like.device(), like.scalar_type());
  at::Tensor yd = y.to(like.device(), at::kLong);
  const int64_t lo = yd.min().item<int64_t>();
  SPARROW_CHECK(lo >= 0, "training data: negative class label " << lo);
  return {xd, yd};
}

void finish_scaffold(TrainResult& r, const std::vector<std::string>& names, double lr, Weights* client_control,
                     const Weights* server_control) {
  // c_i+ - c_i = -c - delta / (K lr).
  const double coef = -1.0 / (static_cast<double>(r.steps) * lr);
  Weights next;
  for (const auto& name : names) {
    const at::Tensor& d = r.delta.at(name);
    at::Tensor cd = d * coef;
    if (!server_control->empty()) cd.sub_(server_control->at(name).to(d.device(), d.scalar_type()));
    at::Tensor ci =
        client_control->empty() ? cd.clone() : client_control->at(name).to(d.device(), d.scalar_type()) + cd;
    r.control_delta.emplace(name, std::move(cd));
    next.emplace(name, std::move(ci));
  }
  *client_control = std::move(next);
}

void finish_feddyn(const TrainResult& r, const std::vector<std::string>& names, double alpha, Weights* client_control) {
  Weights next;
  for (const auto& name : names) {
    const at::Tensor& d = r.delta.at(name);
    at::Tensor h =
        client_control->empty() ? at::zeros_like(d) : client_control->at(name).to(d.device(), d.scalar_type());
    next.emplace(name, h - d * alpha);
  }
  *client_control = std::move(next);
}

double mean_step_loss(const double* l, int64_t steps, int64_t n, int64_t bs, int epochs, double lr) {
  const int64_t per_epoch = (n + bs - 1) / bs;
  double loss_sum = 0;
  for (int64_t s = 0; s < steps; ++s) {
    const int64_t b = s % per_epoch;
    SPARROW_CHECK(std::isfinite(l[s]), "client training diverged: non-finite loss "
                                           << l[s] << " at step " << s << " (epoch " << s / per_epoch << ", batch " << b
                                           << ") with lr " << lr << "; no update is produced");
    loss_sum += l[s] * static_cast<double>(std::min(bs, n - b * bs));
  }
  return loss_sum / (static_cast<double>(n) * epochs);
}

void add_gradient_terms(at::Tensor& g, const at::Tensor& p, const TrainConfig& cfg, const at::Tensor* anchor,
                        const at::Tensor* correction) {
  if (anchor) g.add_(p, cfg.mu).add_(*anchor, -cfg.mu);
  if (correction) g.add_(*correction);
  if (cfg.weight_decay != 0) g.add_(p, cfg.weight_decay);
}

void sgd_update(at::Tensor& p, at::Tensor& g, const TrainConfig& cfg, const at::Tensor* anchor,
                const at::Tensor* correction, at::Tensor* momentum_buf, bool first_step) {
  add_gradient_terms(g, p, cfg, anchor, correction);
  if (momentum_buf) {
    at::Tensor& buf = *momentum_buf;
    if (first_step) {
      buf.copy_(g);
    } else {
      buf.mul_(cfg.momentum).add_(g);
    }
    p.add_(buf, -cfg.lr);
  } else {
    p.add_(g, -cfg.lr);
  }
}

}  // namespace detail

using detail::check_weights;
using detail::fill_order;
using detail::shape_str;

void validate(const TrainConfig& cfg) {
  SPARROW_CHECK_T(ConfigError,
                  cfg.algorithm == "fedavg" || cfg.algorithm == "fedprox" || cfg.algorithm == "scaffold" ||
                      cfg.algorithm == "fednova" || cfg.algorithm == "feddyn",
                  "unknown training algorithm '" << cfg.algorithm << "' (known: " << kAlgorithms << ")");
  core::check_training_numbers(cfg);
  SPARROW_CHECK_T(ConfigError, cfg.mu == 0 || cfg.algorithm == "fedprox" || cfg.algorithm == "feddyn",
                  "mu = " << cfg.mu << " is only used by fedprox and feddyn (its alpha), not " << cfg.algorithm);
  SPARROW_CHECK_T(ConfigError, cfg.mu > 0 || cfg.algorithm != "feddyn",
                  "feddyn needs its regulariser weight alpha > 0 (the task's proximal weight mu)");
}

TrainConfig parse_train_config(const std::string& text) {
  Spec spec = Spec::parse(text);
  TrainConfig cfg;
  cfg.algorithm = spec.method();
  cfg.lr = spec.get_double("lr", cfg.lr);
  cfg.momentum = spec.get_double("momentum", cfg.momentum);
  cfg.weight_decay = spec.get_double("wd", cfg.weight_decay);
  cfg.mu = spec.get_double("mu", cfg.mu);
  const int64_t epochs = spec.get_int("epochs", cfg.local_epochs);
  const int64_t batch = spec.get_int("batch", cfg.batch_size);
  SPARROW_CHECK_T(ConfigError, epochs >= 1 && epochs <= 1000000, "epochs must be in [1, 1e6], got " << epochs);
  SPARROW_CHECK_T(ConfigError, batch >= 1 && batch <= (int64_t{1} << 30), "batch must be in [1, 2^30], got " << batch);
  cfg.local_epochs = static_cast<int>(epochs);
  cfg.batch_size = static_cast<int>(batch);
  spec.check_all_consumed();
  validate(cfg);
  return cfg;
}

Weights get_weights(const torch::nn::Module& model) {
  Weights w;
  for (const auto& p : model.named_parameters()) w[p.key()] = p.value().detach().clone();
  return w;
}

std::vector<int64_t> epoch_order(int64_t n, uint64_t seed, int epoch) {
  SPARROW_CHECK(n >= 0, "epoch_order: n = " << n);
  std::vector<int64_t> order;
  fill_order(order, n, seed, epoch);
  return order;
}

LocalTrainer::LocalTrainer(std::shared_ptr<core::Model> replica, TrainConfig cfg)
    : replica_(std::move(replica)), cfg_(std::move(cfg)) {
  SPARROW_CHECK(replica_ != nullptr, "LocalTrainer needs a model replica");
  validate(cfg_);
  feddyn_ = cfg_.algorithm == "feddyn";
  prox_ = (cfg_.algorithm == "fedprox" || feddyn_) && cfg_.mu > 0;
  scaffold_ = cfg_.algorithm == "scaffold";
  for (const auto& p : replica_->named_parameters()) {
    names_.push_back(p.key());
    params_.push_back(p.value());
    anchor_.push_back(at::empty_like(p.value()));
    if (cfg_.momentum > 0) momentum_.push_back(at::empty_like(p.value()));
    if (scaffold_ || feddyn_) correction_.push_back(at::empty_like(p.value()));
  }
  SPARROW_CHECK(!params_.empty(), "LocalTrainer: the model has no parameters");
}

void LocalTrainer::load(const Weights& weights) {
  check_weights(weights, names_, params_, "weights", false);
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    params_[i].copy_(weights.at(names_[i]));
    at::Tensor& g = params_[i].mutable_grad();
    if (g.defined()) g.zero_();
  }
}

std::pair<at::Tensor, at::Tensor> LocalTrainer::prepare_data(const at::Tensor& x, const at::Tensor& y) const {
  return detail::prepare_data(x, y, params_.front());
}

void LocalTrainer::ensure_batch_buffers(const at::Tensor& x, const at::Tensor& y) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape[0] = std::min<int64_t>(cfg_.batch_size, x.size(0));
  if (!x_batch_.defined() || x_batch_.sizes() != at::IntArrayRef(shape) || x_batch_.scalar_type() != x.scalar_type() ||
      x_batch_.device() != x.device()) {
    x_batch_ = at::empty(shape, x.options());
  }
  if (!y_batch_.defined() || y_batch_.size(0) != shape[0] || y_batch_.device() != y.device()) {
    y_batch_ = at::empty({shape[0]}, y.options());
  }
}

TrainResult LocalTrainer::train(const Weights& global, const at::Tensor& x_in, const at::Tensor& y_in, uint64_t seed,
                                Weights* client_control, const Weights* server_control) {
  // Every check comes before anything the caller owns is touched.
  check_weights(global, names_, params_, "global weights", false);
  if (scaffold_) {
    SPARROW_CHECK(client_control != nullptr && server_control != nullptr,
                  "scaffold needs the client's and the server's control variates (an empty map means zeros)");
    check_weights(*client_control, names_, params_, "client control", true);
    check_weights(*server_control, names_, params_, "server control", true);
  } else if (feddyn_) {
    SPARROW_CHECK(client_control != nullptr && server_control == nullptr,
                  "feddyn needs the client's state h_i (an empty map means zeros) and no server control");
    check_weights(*client_control, names_, params_, "client state", true);
  } else {
    SPARROW_CHECK(client_control == nullptr && server_control == nullptr,
                  "control variates given to " << cfg_.algorithm << ", which does not use them");
  }
  auto [x, y] = prepare_data(x_in, y_in);
  const int64_t n = x.size(0);
  const int64_t bs = std::min<int64_t>(cfg_.batch_size, n);
  const int64_t per_epoch = (n + bs - 1) / bs;
  const int64_t steps = per_epoch * cfg_.local_epochs;

  load(global);
  {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < params_.size(); ++i) {
      anchor_[i].copy_(params_[i]);
      if (scaffold_ || feddyn_) {
        // correction = c - c_i (FedDyn: -h_i), fixed for the whole local run.
        at::Tensor& c = correction_[i];
        if (feddyn_ || server_control->empty()) {
          c.zero_();
        } else {
          c.copy_(server_control->at(names_[i]));
        }
        if (!client_control->empty()) c.sub_(client_control->at(names_[i]).to(c.device(), c.scalar_type()));
      }
    }
  }
  ensure_batch_buffers(x, y);
  if (!step_loss_.defined() || step_loss_.numel() < steps || step_loss_.device() != x.device()) {
    step_loss_ = at::empty({steps}, x.options().dtype(at::kFloat));
  }
  const bool on_cpu = x.device().is_cpu();
  if (!on_cpu && (!order_dev_.defined() || order_dev_.numel() != n || order_dev_.device() != x.device())) {
    order_dev_ = at::empty({n}, y.options());
  }

  const auto lr = cfg_.lr, momentum = cfg_.momentum;
  replica_->train();
  int64_t step = 0;
  for (int epoch = 0; epoch < cfg_.local_epochs; ++epoch) {
    fill_order(order_, n, seed, epoch);
    at::Tensor order = at::from_blob(order_.data(), {n}, at::kLong);
    if (!on_cpu) order = order_dev_.copy_(order);
    for (int64_t start = 0; start < n; start += bs, ++step) {
      const int64_t len = std::min(bs, n - start);
      const bool full = len == bs;
      at::Tensor idx = full && start == 0 && len == n ? order : order.narrow(0, start, len);
      at::Tensor xb = full ? x_batch_ : x_batch_.narrow(0, 0, len);
      at::Tensor yb = full ? y_batch_ : y_batch_.narrow(0, 0, len);
      at::index_select_out(xb, x, 0, idx);
      at::index_select_out(yb, y, 0, idx);

      at::Tensor logits = replica_->forward(xb);
      if (step == 0) {
        SPARROW_CHECK(logits.dim() == 2,
                      "the model's output must be {batch, classes} logits, got " << shape_str(logits.sizes()));
        const int64_t hi = y.max().item<int64_t>();
        SPARROW_CHECK(hi < logits.size(1),
                      "training data: class label " << hi << " but the model has " << logits.size(1) << " outputs");
      }
      at::Tensor loss = at::cross_entropy_loss(logits, yb);
      loss.backward();

      at::NoGradGuard no_grad;
      step_loss_[step].copy_(loss);
      for (size_t i = 0; i < params_.size(); ++i) {
        at::Tensor& p = params_[i];
        at::Tensor& g = p.mutable_grad();
        if (!g.defined()) continue;  // unused parameter: torch::optim::SGD skips it too
        detail::sgd_update(p, g, cfg_, prox_ ? &anchor_[i] : nullptr, scaffold_ || feddyn_ ? &correction_[i] : nullptr,
                           momentum > 0 ? &momentum_[i] : nullptr, step == 0);
        g.zero_();
      }
    }
  }

  // One host sync for all step losses: find divergence, compute the mean.
  const at::Tensor losses = step_loss_.narrow(0, 0, steps).to(at::kCPU, at::kDouble);
  TrainResult r;
  r.mean_loss = detail::mean_step_loss(losses.data_ptr<double>(), steps, n, bs, cfg_.local_epochs, lr);
  r.num_samples = n;
  r.steps = steps;
  at::NoGradGuard no_grad;
  at::Tensor check = at::zeros({}, x.options().dtype(at::kDouble));
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor d = params_[i].detach() - anchor_[i];
    check.add_(d.sum(at::kDouble));
    r.delta.emplace(names_[i], std::move(d));
  }
  SPARROW_CHECK(std::isfinite(check.item<double>()),
                "client training diverged: the update is not finite after " << steps << " steps with lr " << lr);

  if (scaffold_) detail::finish_scaffold(r, names_, lr, client_control, server_control);
  if (feddyn_) detail::finish_feddyn(r, names_, cfg_.mu, client_control);
  return r;
}

std::pair<double, double> LocalTrainer::evaluate(const Weights& weights, const at::Tensor& x_in, const at::Tensor& y_in,
                                                 int batch_size) {
  SPARROW_CHECK(batch_size >= 0, "evaluate: batch_size must be >= 0 (0: the model's), got " << batch_size);
  auto [x, y] = prepare_data(x_in, y_in);
  if (batch_size == 0) batch_size = static_cast<int>(replica_->eval_batch(x.device()));
  load(weights);
  const int64_t n = x.size(0);
  at::NoGradGuard no_grad;
  replica_->eval();
  at::Tensor loss_sum = at::zeros({}, x.options().dtype(at::kDouble));
  at::Tensor correct = at::zeros({}, y.options());
  for (int64_t start = 0; start < n; start += batch_size) {
    const int64_t len = std::min<int64_t>(batch_size, n - start);
    at::Tensor yb = y.narrow(0, start, len);
    at::Tensor logits = replica_->forward(x.narrow(0, start, len));
    if (start == 0) {
      SPARROW_CHECK(logits.dim() == 2,
                    "the model's output must be {batch, classes} logits, got " << shape_str(logits.sizes()));
      const int64_t hi = y.max().item<int64_t>();
      SPARROW_CHECK(hi < logits.size(1),
                    "evaluation data: class label " << hi << " but the model has " << logits.size(1) << " outputs");
    }
    loss_sum.add_(at::cross_entropy_loss(logits, yb, {}, at::Reduction::Sum));
    correct.add_(logits.argmax(1).eq(yb).sum());
  }
  replica_->train();
  const double nd = static_cast<double>(n);
  return {loss_sum.item<double>() / nd, static_cast<double>(correct.item<int64_t>()) / nd};
}

}  // namespace sparrow::client
