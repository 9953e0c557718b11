#include "liteclient/lite_trainer.h"

#include "core/error.h"

namespace sparrow::liteclient {
namespace {

bool same(const lite::TrainConfig& a, const lite::TrainConfig& b) {
  return a.algorithm == b.algorithm && a.local_epochs == b.local_epochs && a.batch_size == b.batch_size &&
         a.lr == b.lr && a.momentum == b.momentum && a.weight_decay == b.weight_decay && a.mu == b.mu;
}

}  // namespace

lite::TrainConfig train_config(const wire::TrainSettings& s) {
  lite::TrainConfig c;
  c.algorithm = s.algorithm;
  c.local_epochs = static_cast<int>(s.local_epochs);
  c.batch_size = static_cast<int>(s.batch_size);
  c.lr = s.lr;
  c.momentum = s.momentum;
  c.weight_decay = s.weight_decay;
  c.mu = s.mu;
  if (c.algorithm != "fedavg" && c.algorithm != "fedprox" && c.algorithm != "scaffold")
    throw ConfigError("algorithm '" + c.algorithm +
                      "' is not supported by sparrow-client-lite (fedavg, fedprox, scaffold); use sparrow-client");
  lite::validate(c);
  return c;
}

LiteTrainer::LiteTrainer(std::shared_ptr<lite::Model> model, LocalData data)
    : model_(std::move(model)), data_(std::move(data)) {
  layout_ = Layout::make(model_->param_names(), model_->param_shapes());
}

void LiteTrainer::check(const wire::TrainSettings& settings) { train_config(settings); }

LocalUpdate LiteTrainer::train(const wire::TrainSettings& settings, const std::vector<float>& global, uint64_t seed,
                               std::vector<float>* client_control, const std::vector<float>* server_control) {
  const lite::TrainConfig c = train_config(settings);
  if (!trainer_ || !same(trainer_->config(), c)) trainer_ = std::make_unique<lite::Trainer>(model_, c);
  lite::TrainResult r = trainer_->train(global, data_.x, data_.y, seed, client_control, server_control);
  LocalUpdate u;
  u.delta = std::move(r.delta);
  u.control_delta = std::move(r.control_delta);
  u.num_samples = r.num_samples;
  u.mean_loss = r.mean_loss;
  return u;
}

}  // namespace sparrow::liteclient
