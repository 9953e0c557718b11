#pragma once
// SessionTrainer (trainer.h) on the lite runtime (lite/trainer.h): a lite
// model file's model and this client's data (data.h), no LibTorch.

#include <memory>

#include "lite/model.h"
#include "lite/trainer.h"
#include "liteclient/data.h"
#include "liteclient/trainer.h"

namespace sparrow::liteclient {

class LiteTrainer : public SessionTrainer {
 public:
  // `data` must fit the model (load_local_data checked it against it).
  LiteTrainer(std::shared_ptr<lite::Model> model, LocalData data);

  const Layout& layout() const override { return layout_; }
  uint64_t num_samples() const override { return static_cast<uint64_t>(data_.y.size()); }
  bool stateful(const std::string& algorithm) const override { return algorithm == "scaffold"; }
  void check(const wire::TrainSettings& settings) override;
  LocalUpdate train(const wire::TrainSettings& settings, const std::vector<float>& global, uint64_t seed,
                    std::vector<float>* client_control, const std::vector<float>* server_control) override;

 private:
  std::shared_ptr<lite::Model> model_;
  LocalData data_;
  Layout layout_;
  std::unique_ptr<lite::Trainer> trainer_;  // rebuilt when the settings change
};

// lite::TrainConfig of a Task's settings, validated (ConfigError naming the
// setting the lite runtime refuses: e.g. an algorithm it does not run).
lite::TrainConfig train_config(const wire::TrainSettings& s);

}  // namespace sparrow::liteclient
