// The split cloud's config (sparrow-edge serve) and its step guard.
#include "edge/cloud.h"

#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>

#include "core/error.h"
#include "core/flat_config.h"
#include "core/error_text.h"
#include "core/model_digest.h"
#include "core/spec.h"
#include "edge/split.h"
#include "wire/net.h"

namespace sparrow::edge {

// ---- config ------------------------------------------------------------------------

CloudConfig parse_cloud_config(const std::string& toml_text, const std::vector<std::string>& overrides,
                               const std::string& source) {
  CloudConfig c;
  const core::FlatConfig f = read_flat_config(toml_text, source,
                                              {{"listen", &c.listen},
                                               {"key", &c.key},
                                               {"allow", &c.allow},
                                               {"insecure", &c.insecure},
                                               {"model", &c.model},
                                               {"cut", &c.cut},
                                               {"weights", &c.weights},
                                               {"seed", &c.seed},
                                               {"grad_codec", &c.grad_codec},
                                               {"lr", &c.lr},
                                               {"momentum", &c.momentum},
                                               {"max_grad_norm", &c.max_grad_norm},
                                               {"grad_norm_factor", &c.grad_norm_factor},
                                               {"fedavg_devices", &c.fedavg_devices},
                                               {"state", &c.state},
                                               {"checkpoint_every", &c.checkpoint_every},
                                               {"fsync", &c.fsync},
                                               {"heartbeat_ms", &c.heartbeat_ms},
                                               {"max_message_mb", &c.max_message_mb},
                                               {"threads", &c.threads}},
                                              overrides);
  SPARROW_CHECK_T(ConfigError, !c.listen.empty(), source << ": listen: must not be empty");
  net::check_endpoint(source + ": listen", c.listen, /*for_bind=*/true);
  SPARROW_CHECK_T(ConfigError, c.insecure || (!c.key.empty() && !c.allow.empty()),
                  source << ": key and allow must be set (or insecure = true)");
  // The ranges of docs/split.md's key table (NaN fails every comparison).
  SPARROW_CHECK_T(ConfigError, c.max_message_mb >= 1 && c.max_message_mb <= 2047,
                  source << ": max_message_mb: must be in [1, 2047]");
  SPARROW_CHECK_T(ConfigError, c.checkpoint_every >= 1 && c.checkpoint_every <= 1000000,
                  source << ": checkpoint_every: must be in [1, 1000000]");
  SPARROW_CHECK_T(ConfigError, c.threads >= 0 && c.threads <= 1024,
                  source << ": threads: must be in [0, 1024] (0 = one per core)");
  // ZeroMQ keeps the heartbeat TTL (3 x heartbeat_ms) in deciseconds below 2^16.
  SPARROW_CHECK_T(ConfigError, c.heartbeat_ms >= 10 && c.heartbeat_ms <= 600000,
                  source << ": heartbeat_ms: must be in [10, 600000]");
  SPARROW_CHECK_T(ConfigError, c.lr > 0 && c.lr <= 10, source << ": lr: must be in (0, 10]");
  SPARROW_CHECK_T(ConfigError, c.momentum >= 0 && c.momentum < 1, source << ": momentum: must be in [0, 1)");
  SPARROW_CHECK_T(ConfigError, c.max_grad_norm > 0 && c.max_grad_norm <= 1e12,
                  source << ": max_grad_norm: must be in (0, 1e12]");
  SPARROW_CHECK_T(ConfigError, c.grad_norm_factor == 0 || (c.grad_norm_factor >= 2 && c.grad_norm_factor <= 1e6),
                  source << ": grad_norm_factor: must be 0 (off) or in [2, 1e6]");
  SPARROW_CHECK_T(ConfigError, c.fedavg_devices <= 10000, source << ": fedavg_devices: must be in [0, 10000]");
  // No key without an effect (docs/split.md): each is refused where it would change nothing.
  for (const char* k : {"checkpoint_every", "fsync"})
    f.check(k, c.state != "" || !f.has(k), "has no effect with state = \"\" (the cloud keeps nothing on disk)");
  if (c.insecure && f.where("insecure") != "--set")  // --insecure on a secure file is the documented try-out
    for (const char* k : {"key", "allow"})
      f.check(k, !f.has(k), "has no effect with insecure = true (plain TCP, no CURVE keys)");
  return c;
}

CloudConfig load_cloud_config(const std::string& path, const std::vector<std::string>& overrides) {
  return parse_cloud_config(core::read_config_file(path), overrides, path);
}

// ---- the step guard ----------------------------------------------------------------

std::string StepGuard::refusal(double loss, double grad_norm) const {
  if (!std::isfinite(loss)) return "the loss is not finite";
  if (!std::isfinite(grad_norm)) return "the top's gradient is not finite";
  const double b = bound();
  if (grad_norm > b) {
    std::ostringstream os;
    os << "the top's gradient norm " << grad_norm << " is above the bound " << b
       << (b < max_norm_ ? " (grad_norm_factor x the median of recent steps)" : " (max_grad_norm)");
    return os.str();
  }
  return "";
}

double StepGuard::bound() const {
  if (factor_ <= 0 || history_.size() < kWarmup) return max_norm_;
  std::vector<double> h = history_;
  std::nth_element(h.begin(), h.begin() + static_cast<std::ptrdiff_t>(h.size() / 2), h.end());
  return std::min(max_norm_, factor_ * h[h.size() / 2]);
}

void StepGuard::accepted(double grad_norm) {
  history_.push_back(grad_norm);
  if (history_.size() > kWindow) history_.erase(history_.begin());
}

void StepGuard::restore(std::vector<double> h) {
  if (h.size() > kWindow) h.erase(h.begin(), h.end() - static_cast<std::ptrdiff_t>(kWindow));
  history_ = std::move(h);
}

}  // namespace sparrow::edge
