#include "client/batched_trainer.h"

#include <torch/torch.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <numeric>

#include "batched/program.h"
#include "client/train_common.h"
#include "core/error.h"

namespace sparrow::client {

BatchedTrainer::BatchedTrainer(std::shared_ptr<core::Model> replica, TrainConfig cfg)
    : replica_(std::move(replica)), cfg_(std::move(cfg)) {
  SPARROW_CHECK(replica_ != nullptr, "BatchedTrainer needs a model replica");
  SPARROW_CHECK_T(ConfigError, supports(*replica_), "this model cannot train several clients in one pass");
  if (replica_->can_forward_clients()) {
    engine_ = replica_;
  } else {
    scripted_ = std::make_shared<batched::ScriptedClients>(replica_);
    engine_ = scripted_;
  }
  validate(cfg_);
  feddyn_ = cfg_.algorithm == "feddyn";
  prox_ = (cfg_.algorithm == "fedprox" || feddyn_) && cfg_.mu > 0;
  scaffold_ = cfg_.algorithm == "scaffold";
  for (const auto& p : replica_->named_parameters()) {
    names_.push_back(p.key());
    params_.push_back(p.value());
  }
  SPARROW_CHECK(!params_.empty(), "BatchedTrainer: the model has no parameters");
}

bool BatchedTrainer::supports(const core::Model& model) {
  return model.can_forward_clients() || (batched::enabled() && batched::translates(model));
}

int64_t BatchedTrainer::bytes_per_client() const {
  int64_t numel = 0;
  for (const auto& p : params_) numel += p.numel();
  // Parameters, gradients and the delta, plus the optimizer's buffers.
  const int64_t copies = 3 + (cfg_.momentum > 0 ? 1 : 0) + (scaffold_ || feddyn_ ? 1 : 0);
  return numel * copies * static_cast<int64_t>(params_.front().element_size());
}

std::vector<TrainResult> BatchedTrainer::train(const Weights& global, std::vector<ClientJob>& jobs,
                                               const Weights* server_control) {
  using detail::check_weights;
  // Every check comes before anything the caller owns is touched.
  SPARROW_CHECK(!jobs.empty(), "BatchedTrainer::train: no clients");
  check_weights(global, names_, params_, "global weights", false);
  if (scaffold_) {
    SPARROW_CHECK(server_control != nullptr, "scaffold needs the server's control variate (an empty map means zeros)");
    check_weights(*server_control, names_, params_, "server control", true);
  } else if (feddyn_) {
    SPARROW_CHECK(server_control == nullptr, "feddyn takes no server control");
  } else {
    SPARROW_CHECK(server_control == nullptr,
                  "control variates given to " << cfg_.algorithm << ", which does not use them");
  }
  const int64_t k_all = static_cast<int64_t>(jobs.size());
  std::vector<at::Tensor> xs, ys;
  std::vector<int64_t> n(k_all), bs(k_all), per_epoch(k_all), steps(k_all), off(k_all);
  int64_t total = 0;
  for (int64_t j = 0; j < k_all; ++j) {
    ClientJob& job = jobs[j];
    if (scaffold_ || feddyn_) {
      SPARROW_CHECK(job.client_control != nullptr, cfg_.algorithm << " needs client " << j << "'s state");
      check_weights(*job.client_control, names_, params_, "client control", true);
    } else {
      SPARROW_CHECK(job.client_control == nullptr,
                    "control variates given to " << cfg_.algorithm << ", which does not use them");
    }
    auto [x, y] = detail::prepare_data(job.x, job.y, params_.front());
    SPARROW_CHECK(j == 0 || x.sizes().slice(1) == xs.front().sizes().slice(1),
                  "batched clients need samples of one shape: client 0 has "
                      << detail::shape_str(xs.front().sizes().slice(1)) << ", client " << j << " "
                      << detail::shape_str(x.sizes().slice(1)));
    n[j] = x.size(0);
    bs[j] = std::min<int64_t>(cfg_.batch_size, n[j]);
    per_epoch[j] = (n[j] + bs[j] - 1) / bs[j];
    steps[j] = per_epoch[j] * cfg_.local_epochs;
    off[j] = total;
    total += n[j];
    xs.push_back(std::move(x));
    ys.push_back(std::move(y));
  }
  const at::TensorOptions popt = params_.front().options();
  // On the CPU each step's rows are copied straight from the clients' own
  // float tensors (no concatenated copy of every client's data); elsewhere the
  // data is concatenated once and each step gathers on the device.
  bool host_gather = popt.device().is_cpu();
  for (const auto& x : xs) host_gather = host_gather && x.scalar_type() == at::kFloat && x.is_contiguous();
  const at::Tensor x_all = host_gather ? at::Tensor() : (k_all == 1 ? xs.front() : at::cat(xs));
  const at::Tensor y_all = k_all == 1 ? ys.front() : at::cat(ys);
  ys.clear();
  const std::vector<int64_t> sample_shape(xs.front().sizes().begin() + 1, xs.front().sizes().end());
  const int64_t sample_numel =
      std::accumulate(sample_shape.begin(), sample_shape.end(), int64_t{1}, std::multiplies<int64_t>());
  std::vector<const float*> x_base;  // host_gather: each client's first sample
  if (host_gather)
    for (const auto& x : xs) x_base.push_back(x.data_ptr<float>());
  else
    xs.clear();  // x_all holds them

  // Stack position -> job: most steps first, so the active clients of every
  // step are a prefix of the stack.
  std::vector<int64_t> pos(k_all);
  std::iota(pos.begin(), pos.end(), int64_t{0});
  std::stable_sort(pos.begin(), pos.end(), [&](int64_t a, int64_t b) { return steps[a] > steps[b]; });
  const int64_t total_steps = steps[pos.front()];

  // The whole schedule on the host: per step the active count, the padded
  // batch, and (active x batch) sample rows of x_all with their loss weights.
  std::vector<int64_t> active(total_steps), batch(total_steps), start(total_steps + 1, 0);
  std::vector<int64_t> rows;
  std::vector<const float*> row_src;  // host_gather: where each row's sample is
  std::vector<float> weights;
  {
    std::vector<std::vector<int64_t>> order(k_all);
    std::vector<int> order_epoch(k_all, -1);
    for (int64_t s = 0; s < total_steps; ++s) {
      int64_t ka = 0, b_max = 0;
      while (ka < k_all && steps[pos[ka]] > s) {
        const int64_t j = pos[ka];
        b_max = std::max(b_max, std::min(bs[j], n[j] - (s % per_epoch[j]) * bs[j]));
        ++ka;
      }
      active[s] = ka;
      // Every step is padded to the configured batch (zero-weight rows), not
      // to the longest batch among the clients stacked with this one: a
      // client's GEMM shapes, and so its bits, must not depend on which
      // clients share its pass (workers split a round's clients; BLAS
      // kernels may block a product differently for another width).
      b_max = std::max<int64_t>(b_max, cfg_.batch_size);
      batch[s] = b_max;
      for (int64_t a = 0; a < ka; ++a) {
        const int64_t j = pos[a];
        const int epoch = static_cast<int>(s / per_epoch[j]);
        if (order_epoch[j] != epoch) {
          detail::fill_order(order[j], n[j], jobs[j].seed, epoch);
          order_epoch[j] = epoch;
        }
        const int64_t first = (s % per_epoch[j]) * bs[j];
        const int64_t len = std::min(bs[j], n[j] - first);
        for (int64_t i = 0; i < b_max; ++i) {
          const int64_t local = order[j][static_cast<size_t>(first + std::min(i, len - 1))];
          rows.push_back(off[j] + local);
          if (host_gather) row_src.push_back(x_base[static_cast<size_t>(j)] + local * sample_numel);
          weights.push_back(i < len ? 1.0f / static_cast<float>(len) : 0.0f);
        }
      }
      start[s + 1] = static_cast<int64_t>(rows.size());
    }
  }
  const auto count = static_cast<int64_t>(rows.size());
  const at::Tensor rows_dev = at::from_blob(rows.data(), {count}, at::kLong).to(y_all.device());
  const at::Tensor weights_dev = at::from_blob(weights.data(), {count}, at::kFloat).to(popt);
  const at::Tensor y_sched = y_all.index_select(0, rows_dev);  // every step's labels, in order
  int64_t max_rows = 0;
  for (int64_t s = 0; s < total_steps; ++s) max_rows = std::max(max_rows, active[s] * batch[s]);
  at::Tensor x_step = host_gather ? at::empty({max_rows * sample_numel}, popt) : at::Tensor();

  // Stacked state in stack order. The anchor (w_global) is shared by all.
  at::NoGradGuard outer_no_grad;
  const size_t np = params_.size();
  std::vector<at::Tensor> stack(np), anchor(np), correction, momentum;
  for (size_t i = 0; i < np; ++i) {
    anchor[i] = global.at(names_[i]).to(popt).contiguous();
    std::vector<int64_t> shape{k_all};
    shape.insert(shape.end(), anchor[i].sizes().begin(), anchor[i].sizes().end());
    stack[i] = at::empty(shape, popt);
    stack[i].copy_(anchor[i].unsqueeze(0).expand(shape));
    if (cfg_.momentum > 0) momentum.push_back(at::empty(shape, popt));
    if (scaffold_ || feddyn_) {
      // correction = c - c_i (FedDyn: -h_i), fixed for the whole local run.
      at::Tensor c = at::empty(shape, popt);
      if (feddyn_ || server_control->empty())
        c.zero_();
      else
        c.copy_(server_control->at(names_[i]).to(popt).unsqueeze(0).expand(shape));
      for (int64_t a = 0; a < k_all; ++a) {
        const Weights& ci = *jobs[pos[a]].client_control;
        if (!ci.empty()) c[a].sub_(ci.at(names_[i]).to(popt));
      }
      correction.push_back(std::move(c));
    }
  }
  // Where each step's gradient goes. Plain SGD (no momentum, weight decay,
  // proximal or control term) is fused into the backward: the weight-gradient
  // GEMMs write the weights (alpha = -lr, beta = 1), so no gradient is ever
  // stored and every weight is read and written once per step. With momentum
  // the gradient accumulates into the momentum buffer (beta = momentum; the
  // extra terms are added to it before the step), which is the same
  // arithmetic as torch::optim::SGD's buf = momentum * buf + g. Otherwise
  // gradient buffers reused by every step.
  const bool fused_sgd = cfg_.momentum == 0 && cfg_.weight_decay == 0 && !prox_ && !scaffold_;
  const bool into_momentum = cfg_.momentum > 0;
  std::vector<at::Tensor> grad_stack;
  if (!fused_sgd && !into_momentum)
    for (size_t i = 0; i < np; ++i) grad_stack.push_back(at::empty_like(stack[i]));
  at::Tensor step_loss = at::zeros({total_steps, k_all}, popt);

  replica_->train();
  if (scripted_) scripted_->clear_stats();
  std::vector<at::Tensor> ps(np), gs(np);
  for (int64_t s = 0; s < total_steps; ++s) {
    const int64_t ka = active[s], b = batch[s];
    const at::Tensor idx = rows_dev.narrow(0, start[s], ka * b);
    std::vector<int64_t> xshape{ka, b};
    xshape.insert(xshape.end(), sample_shape.begin(), sample_shape.end());
    at::Tensor xb;
    if (host_gather) {
      float* dst = x_step.data_ptr<float>();
      // The rows are scattered over the training set, mostly outside the
      // caches: each copy is preceded by a prefetch of the row kAhead rows on.
      constexpr int64_t kAhead = 4;
      const int64_t nrows = ka * b, line_floats = 64 / static_cast<int64_t>(sizeof(float));
      const auto prefetch_row = [&](int64_t r) {
        const float* src = row_src[static_cast<size_t>(start[s] + r)];
        for (int64_t f = 0; f < sample_numel; f += line_floats) __builtin_prefetch(src + f);
      };
      for (int64_t r = 0; r < std::min(kAhead, nrows); ++r) prefetch_row(r);
      for (int64_t r = 0; r < nrows; ++r) {
        if (r + kAhead < nrows) prefetch_row(r + kAhead);
        std::memcpy(dst + r * sample_numel, row_src[static_cast<size_t>(start[s] + r)],
                    static_cast<size_t>(sample_numel) * sizeof(float));
      }
      xb = x_step.narrow(0, 0, ka * b * sample_numel).view(xshape);
    } else {
      xb = x_all.index_select(0, idx).view(xshape);
    }
    const at::Tensor yb = y_sched.narrow(0, start[s], ka * b);
    for (size_t i = 0; i < np; ++i) {
      ps[i] = stack[i].narrow(0, 0, ka);
      gs[i] = fused_sgd ? ps[i] : (into_momentum ? momentum[i] : grad_stack[i]).narrow(0, 0, ka);
    }
    if (s == 0) {  // once per call: labels within the model's outputs (one client, one sample suffice)
      std::vector<at::Tensor> p1(np);
      for (size_t i = 0; i < np; ++i) p1[i] = ps[i].narrow(0, 0, 1);
      const at::Tensor logits = engine_->forward_clients(p1, xb.narrow(0, 0, 1).narrow(1, 0, 1));
      SPARROW_CHECK(logits.dim() == 3 && logits.size(0) == 1 && logits.size(1) == 1,
                    "forward_clients must return {clients, batch, classes}, got " << detail::shape_str(logits.sizes()));
      const int64_t hi = y_all.max().item<int64_t>();
      SPARROW_CHECK(hi < logits.size(2),
                    "training data: class label " << hi << " but the model has " << logits.size(2) << " outputs");
    }
    const double alpha = fused_sgd ? -cfg_.lr : 1.0;
    const double beta = fused_sgd ? 1.0 : (into_momentum && s > 0 ? cfg_.momentum : 0.0);
    step_loss[s].narrow(0, 0, ka).copy_(
        engine_->loss_backward_clients(ps, xb, yb, weights_dev.narrow(0, start[s], ka * b), gs, alpha, beta));
    if (fused_sgd) continue;
    for (size_t i = 0; i < np; ++i) {
      // gs[i] is the gradient, or momentum * buf + gradient: add the
      // algorithm's terms, then step.
      const bool corrected = scaffold_ || feddyn_;
      const at::Tensor corr = corrected ? correction[i].narrow(0, 0, ka) : at::Tensor();
      detail::add_gradient_terms(gs[i], ps[i], cfg_, prox_ ? &anchor[i] : nullptr, corrected ? &corr : nullptr);
      ps[i].add_(gs[i], -cfg_.lr);
    }
  }

  // One host sync for all losses and the finiteness of every update.
  const at::Tensor losses = step_loss.t().to(at::kCPU, at::kDouble).contiguous();  // [K, S]
  std::vector<at::Tensor> delta(np);
  // A sum per client in the parameters' type: inf or nan anywhere makes it
  // non-finite (a double sum would first convert every delta to double).
  at::Tensor check = at::zeros({k_all}, popt);
  for (size_t i = 0; i < np; ++i) {
    delta[i] = stack[i].sub_(anchor[i]);  // the stack is not needed after: the delta takes its place
    check.add_(delta[i].reshape({k_all, -1}).sum(1));
  }
  const at::Tensor check_cpu = check.to(at::kCPU);
  std::vector<TrainResult> out(static_cast<size_t>(k_all));
  std::vector<int64_t> where(k_all);  // job -> stack position
  for (int64_t a = 0; a < k_all; ++a) where[pos[a]] = a;
  for (int64_t j = 0; j < k_all; ++j) {  // job order: the first diverged job is reported
    const int64_t a = where[j];
    TrainResult& r = out[static_cast<size_t>(j)];
    r.num_samples = n[j];
    r.steps = steps[j];
    r.mean_loss =
        detail::mean_step_loss(losses[a].data_ptr<double>(), steps[j], n[j], bs[j], cfg_.local_epochs, cfg_.lr);
    bool finite = std::isfinite(check_cpu[a].item<float>());
    if (!finite) {  // the float sum may overflow where every value is finite: look
      finite = true;
      for (size_t i = 0; i < np && finite; ++i) finite = at::isfinite(delta[i][a]).all().item<bool>();
    }
    SPARROW_CHECK(finite, "client training diverged: the update is not finite after " << steps[j] << " steps with lr "
                                                                                      << cfg_.lr);
    for (size_t i = 0; i < np; ++i) r.delta.emplace(names_[i], delta[i][a]);
  }
  // Errors above leave every control as it was; only now do they change.
  if (scripted_) {
    std::vector<int64_t> position(static_cast<size_t>(k_all));
    for (int64_t j = 0; j < k_all; ++j) position[static_cast<size_t>(j)] = where[j];
    scripted_->fold_running_stats(position, steps);
  }
  if (scaffold_)
    for (int64_t j = 0; j < k_all; ++j)
      detail::finish_scaffold(out[static_cast<size_t>(j)], names_, cfg_.lr, jobs[j].client_control, server_control);
  if (feddyn_)
    for (int64_t j = 0; j < k_all; ++j)
      detail::finish_feddyn(out[static_cast<size_t>(j)], names_, cfg_.mu, jobs[j].client_control);
  return out;
}

}  // namespace sparrow::client
