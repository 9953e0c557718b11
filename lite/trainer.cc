#include "lite/trainer.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/rng.h"
#include "core/train_checks.h"

namespace sparrow::lite {
namespace {

// Dropout masks: rng stream of (seed, this tag, step); layers derive their own.
constexpr uint64_t kDropoutTag = 0x6c6974652d64726full;  // "lite-dro"

}  // namespace

void validate(const TrainConfig& cfg) {
  SPARROW_CHECK_T(ConfigError, cfg.algorithm == "fedavg" || cfg.algorithm == "fedprox" || cfg.algorithm == "scaffold",
                  "unknown training algorithm '" << cfg.algorithm << "' (known: fedavg, fedprox, scaffold)");
  core::check_training_numbers(cfg);
  SPARROW_CHECK_T(ConfigError, cfg.mu == 0 || cfg.algorithm == "fedprox",
                  "mu = " << cfg.mu << " is only used by fedprox, not " << cfg.algorithm);
}

std::vector<int64_t> epoch_order(int64_t n, uint64_t seed, int epoch) {
  SPARROW_LITE_CHECK(n >= 0, "epoch_order: n = " << n);
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), int64_t{0});
  rng::Stream s(rng::derive(seed, static_cast<uint64_t>(epoch)));
  for (int64_t i = n - 1; i > 0; --i) {
    const auto j = static_cast<int64_t>(s.below(static_cast<uint64_t>(i + 1)));
    std::swap(order[static_cast<size_t>(i)], order[static_cast<size_t>(j)]);
  }
  return order;
}

Trainer::Trainer(std::shared_ptr<Model> model, TrainConfig cfg) : model_(std::move(model)), cfg_(std::move(cfg)) {
  SPARROW_LITE_CHECK(model_ != nullptr, "lite trainer needs a model");
  validate(cfg_);
}

int64_t Trainer::check_data(const std::vector<float>& x, const std::vector<int64_t>& y) const {
  const auto n = static_cast<int64_t>(y.size());
  SPARROW_LITE_CHECK(n > 0, "training data: no samples");
  SPARROW_LITE_CHECK(static_cast<int64_t>(x.size()) == n * model_->input_size(),
                     "training data: " << n << " labels need " << n * model_->input_size() << " input values ("
                                       << shape_str(model_->input_shape()) << " per sample), got " << x.size());
  for (int64_t v : y) {
    SPARROW_LITE_CHECK(v >= 0 && v < model_->classes(),
                       "training data: class label " << v << " but the model has " << model_->classes() << " outputs");
  }
  return n;
}

void Trainer::fill_batch(const std::vector<float>& x, const std::vector<int64_t>& y, const int64_t* idx, int64_t len) {
  const int64_t d = model_->input_size();
  Tensor& in = model_->input(len);
  y_batch_.resize(static_cast<size_t>(len));
  for (int64_t i = 0; i < len; ++i) {
    const float* src = x.data() + idx[i] * d;
    std::copy(src, src + d, in.ptr() + i * d);
    y_batch_[static_cast<size_t>(i)] = y[static_cast<size_t>(idx[i])];
  }
}

TrainResult Trainer::train(const std::vector<float>& global, const std::vector<float>& x, const std::vector<int64_t>& y,
                           uint64_t seed, std::vector<float>* client_control,
                           const std::vector<float>* server_control) {
  const int64_t total = model_->num_values();
  const bool scaffold = cfg_.algorithm == "scaffold";
  const bool prox = cfg_.algorithm == "fedprox" && cfg_.mu > 0;
  SPARROW_LITE_CHECK(static_cast<int64_t>(global.size()) == total,
                     "global weights hold " << global.size() << " values, the model has " << total);
  if (scaffold) {
    SPARROW_LITE_CHECK(client_control != nullptr && server_control != nullptr,
                       "scaffold needs the client's and the server's control variates (empty means zeros)");
    for (const auto* c : {static_cast<const std::vector<float>*>(client_control), server_control}) {
      SPARROW_LITE_CHECK(c->empty() || static_cast<int64_t>(c->size()) == total,
                         "a control variate holds " << c->size() << " values, the model has " << total);
    }
  } else {
    SPARROW_LITE_CHECK(client_control == nullptr && server_control == nullptr,
                       "control variates given to " << cfg_.algorithm << ", which does not use them");
  }
  const int64_t n = check_data(x, y);
  const int64_t bs = std::min<int64_t>(cfg_.batch_size, n);
  const int64_t per_epoch = (n + bs - 1) / bs;
  const int64_t steps = per_epoch * cfg_.local_epochs;

  model_->set_values(global);
  anchor_ = global;
  const auto sz = static_cast<size_t>(total);
  if (cfg_.momentum > 0) momentum_.resize(sz);
  if (scaffold) {
    correction_.assign(sz, 0.0f);
    if (!server_control->empty()) correction_ = *server_control;
    if (!client_control->empty())
      for (size_t i = 0; i < sz; ++i) correction_[i] -= (*client_control)[i];
  }
  step_loss_.resize(static_cast<size_t>(steps));

  const auto lr = static_cast<float>(cfg_.lr), mom = static_cast<float>(cfg_.momentum);
  const auto mu = static_cast<float>(cfg_.mu), wd = static_cast<float>(cfg_.weight_decay);
  const std::vector<Param*>& params = model_->params();
  ForwardContext ctx;
  ctx.train = true;
  int64_t step = 0;
  for (int epoch = 0; epoch < cfg_.local_epochs; ++epoch) {
    order_ = epoch_order(n, seed, epoch);
    for (int64_t start = 0; start < n; start += bs, ++step) {
      const int64_t len = std::min(bs, n - start);
      fill_batch(x, y, order_.data() + start, len);
      ctx.dropout_key = rng::derive(rng::derive(seed, kDropoutTag), static_cast<uint64_t>(step));
      const Tensor& logits = model_->forward(ctx);
      step_loss_[static_cast<size_t>(step)] = softmax_cross_entropy(logits, y_batch_.data(), &dlogits_);
      model_->backward(dlogits_);
      // LocalTrainer's order: g (+ mu p - mu anchor) (+ correction) (+ wd p),
      // then the momentum buffer, then p -= lr * buf.
      size_t off = 0;
      for (Param* p : params) {
        float* w = p->value.data();
        float* g = p->grad.data();
        const size_t len_p = p->value.size();
        const float* a = anchor_.data() + off;
        for (size_t i = 0; i < len_p; ++i) {
          float gi = g[i];
          if (prox) gi = (gi + mu * w[i]) + (-mu) * a[i];
          if (scaffold) gi += correction_[off + i];
          if (wd != 0.0f) gi += wd * w[i];
          if (mom > 0.0f) {
            float& buf = momentum_[off + i];
            buf = step == 0 ? gi : buf * mom + gi;
            gi = buf;
          }
          w[i] += -lr * gi;
        }
        off += len_p;
      }
    }
  }

  TrainResult r;
  double loss_sum = 0;
  for (int64_t s = 0; s < steps; ++s) {
    const double l = step_loss_[static_cast<size_t>(s)];
    const int64_t b = s % per_epoch;
    SPARROW_LITE_CHECK(std::isfinite(l), "client training diverged: non-finite loss "
                                             << l << " at step " << s << " (epoch " << s / per_epoch << ", batch " << b
                                             << ") with lr " << cfg_.lr << "; no update is produced");
    loss_sum += l * static_cast<double>(std::min(bs, n - b * bs));
  }
  r.mean_loss = loss_sum / (static_cast<double>(n) * cfg_.local_epochs);
  r.num_samples = n;
  r.steps = steps;
  r.delta = model_->get_values();
  double check = 0;
  for (size_t i = 0; i < sz; ++i) {
    r.delta[i] -= anchor_[i];
    check += r.delta[i];
  }
  SPARROW_LITE_CHECK(std::isfinite(check), "client training diverged: the update is not finite after "
                                               << steps << " steps with lr " << cfg_.lr);
  if (scaffold) {
    // c_i+ - c_i = -c - delta / (K lr).
    const auto coef = static_cast<float>(-1.0 / (static_cast<double>(steps) * cfg_.lr));
    r.control_delta.resize(sz);
    std::vector<float> next(sz);
    for (size_t i = 0; i < sz; ++i) {
      float cd = r.delta[i] * coef;
      if (!server_control->empty()) cd -= (*server_control)[i];
      r.control_delta[i] = cd;
      next[i] = client_control->empty() ? cd : (*client_control)[i] + cd;
    }
    *client_control = std::move(next);
  }
  return r;
}

std::pair<double, double> Trainer::evaluate(const std::vector<float>& weights, const std::vector<float>& x,
                                            const std::vector<int64_t>& y, int batch_size) {
  SPARROW_LITE_CHECK(batch_size >= 1, "evaluate: batch_size must be >= 1, got " << batch_size);
  const int64_t n = check_data(x, y);
  model_->set_values(weights);
  std::vector<int64_t> idx(static_cast<size_t>(n));
  std::iota(idx.begin(), idx.end(), int64_t{0});
  double loss_sum = 0;
  int64_t correct = 0;
  const ForwardContext ctx;
  for (int64_t start = 0; start < n; start += batch_size) {
    const int64_t len = std::min<int64_t>(batch_size, n - start);
    fill_batch(x, y, idx.data() + start, len);
    const Tensor& logits = model_->forward(ctx);
    loss_sum += static_cast<double>(softmax_cross_entropy(logits, y_batch_.data(), nullptr)) * static_cast<double>(len);
    const int64_t c = logits.shape[1];
    for (int64_t i = 0; i < len; ++i) {
      const float* z = logits.ptr() + i * c;
      correct += (std::max_element(z, z + c) - z) == y_batch_[static_cast<size_t>(i)];
    }
  }
  const auto nd = static_cast<double>(n);
  return {loss_sum / nd, static_cast<double>(correct) / nd};
}

}  // namespace sparrow::lite
