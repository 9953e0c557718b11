#pragma once
// The local-training settings both trainers check the same way (the LibTorch
// client's client::validate and the LibTorch-free lite::validate): one place,
// with one wording. Header-only and torch-free, so the lite runtime's device
// build uses it too. `Config` has local_epochs, batch_size, lr, momentum,
// weight_decay and mu; which algorithms exist, and which use mu, each trainer
// checks itself.

#include <cmath>

#include "core/error.h"

namespace sparrow::core {

template <class Config>
void check_training_numbers(const Config& cfg) {
  SPARROW_CHECK_T(ConfigError, cfg.local_epochs >= 1, "local_epochs must be >= 1, got " << cfg.local_epochs);
  SPARROW_CHECK_T(ConfigError, cfg.batch_size >= 1, "batch_size must be >= 1, got " << cfg.batch_size);
  SPARROW_CHECK_T(ConfigError, std::isfinite(cfg.lr) && cfg.lr > 0, "lr must be finite and > 0, got " << cfg.lr);
  SPARROW_CHECK_T(ConfigError, cfg.momentum >= 0 && cfg.momentum < 1,
                  "momentum must be in [0, 1), got " << cfg.momentum);
  SPARROW_CHECK_T(ConfigError, std::isfinite(cfg.weight_decay) && cfg.weight_decay >= 0,
                  "weight_decay must be finite and >= 0, got " << cfg.weight_decay);
  SPARROW_CHECK_T(ConfigError, std::isfinite(cfg.mu) && cfg.mu >= 0, "mu must be finite and >= 0, got " << cfg.mu);
}

}  // namespace sparrow::core
