#include "liteclient/local_dp.h"

#include <cmath>
#include <map>

#include "core/error.h"
#include "core/rng.h"
#include "core/spec.h"

namespace sparrow::liteclient {

LocalDp parse_local_dp(const std::string& text) {
  Spec s = Spec::parse(text);
  LocalDp d;
  if (s.method() == "none") {
    s.check_all_consumed();
    return d;
  }
  SPARROW_CHECK_T(ConfigError, s.method() != "central",
                  "central DP is the server's setting (its `dp` key); a client takes \"none\" or "
                  "\"local:clip=,noise=\"");
  SPARROW_CHECK_T(ConfigError, s.method() == "local",
                  "unknown mode '" << s.method() << "' (none or local:clip=,noise=)");
  d.on = true;
  d.clip = s.require_double("clip");
  d.noise = s.require_double("noise");
  d.delta = s.get_double("delta", 1e-5);
  s.check_all_consumed();
  SPARROW_CHECK_T(ConfigError, d.clip > 0 && std::isfinite(d.clip), "clip must be > 0");
  SPARROW_CHECK_T(ConfigError, d.noise >= 0 && std::isfinite(d.noise), "noise must be >= 0");
  SPARROW_CHECK_T(ConfigError, d.delta > 0 && d.delta < 1, "delta must be in (0, 1)");
  return d;
}

double local_dp_update(const Layout& layout, std::vector<float>& delta, double clip, double noise, uint64_t key) {
  SPARROW_CHECK(static_cast<int64_t>(delta.size()) == layout.total,
                "local_dp_update: the update holds " << delta.size() << " values, the model " << layout.total);
  std::map<std::string, size_t> by_name;  // sparrow-client's order: its std::map's
  for (size_t k = 0; k < layout.names.size(); ++k) by_name[layout.names[k]] = k;
  double sq = 0;
  for (const auto& [name, k] : by_name) {
    const float* p = delta.data() + layout.offsets[k];
    double t = 0;
    for (int64_t i = 0; i < layout.sizes[k]; ++i) t += static_cast<double>(p[i]) * static_cast<double>(p[i]);
    sq += t;
  }
  const double norm = std::sqrt(sq);
  const double scale = norm > clip ? clip / norm : 1.0;
  const double stddev = noise * clip;
  uint64_t offset = 0;
  for (const auto& [name, k] : by_name) {
    float* p = delta.data() + layout.offsets[k];
    const int64_t n = layout.sizes[k];
    if (scale < 1)
      for (int64_t i = 0; i < n; ++i) p[i] *= static_cast<float>(scale);
    if (stddev > 0)
      for (int64_t i = 0; i < n; ++i)
        p[i] += static_cast<float>(stddev * rng::normal(key, offset + static_cast<uint64_t>(i)));
    offset += static_cast<uint64_t>(n);
  }
  return norm;
}

}  // namespace sparrow::liteclient
