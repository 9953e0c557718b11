#include "simulator/config.h"

#include <cmath>
#include <filesystem>
#include <initializer_list>
#include <limits>
#include <optional>
#include <sstream>
#include <tuple>

#include <spdlog/spdlog.h>

#include "core/data_folder.h"
#include "core/error.h"
#include "core/flat_config.h"
#include "core/spec.h"
#include "simulator/attack.h"
#include "state/encoding.h"

namespace sparrow::simulator {
namespace {

// One table of keys drives reading, overriding, writing and comparing, so a new
// field is one line here (plus its validation). The shared keys come first
// (federation::bind); "profiles.x" lives in the [profiles] table.
void bind_fields(core::FlatConfig& f, SimConfig& c) {
  federation::bind(f, c);
  f.bind("dataset", &c.dataset);
  f.bind("test_fraction", &c.test_fraction);
  f.bind("validation", &c.validation);
  f.bind("partition", &c.partition);
  f.bind("adversaries", &c.adversaries);
  f.bind("attack", &c.attack);
  f.bind("workers", &c.workers);
  f.bind("client_batch", &c.client_batch);
  f.bind("threads", &c.threads);
  f.bind("device", &c.device);
  f.bind("checkpoint_every", &c.checkpoint_every);
  f.bind("keep_client_state", &c.keep_client_state);
  f.bind("state_encoding", &c.state_encoding);
  f.bind("out", &c.out);
  f.bind("deadline_s", &c.deadline_s);
  f.bind("profiles.compute_speed", &c.profiles.compute_speed);
  f.bind("profiles.uplink_mbps", &c.profiles.uplink_mbps);
  f.bind("profiles.downlink_mbps", &c.profiles.downlink_mbps);
  f.bind("profiles.availability", &c.profiles.availability);
}

constexpr const char* kAlpha = "alpha";  // shorthand folded into `partition`

// A binder that only reads `c` (writers and comparisons).
struct Reader {
  explicit Reader(const SimConfig& c) : f("") { bind_fields(f, const_cast<SimConfig&>(c)); }
  core::FlatConfig f;
};

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t") - b + 1);
}

// Parses a spec-string value (syntax errors name the key) and checks its
// method against `methods` when that list is not empty.
std::string spec_method(const core::FlatConfig& f, const std::string& key, const std::string& value,
                        std::initializer_list<const char*> methods) {
  std::string method;
  try {
    method = Spec::parse(value).method();
  } catch (const ConfigError& e) {
    f.fail(key, "is not a valid spec: " + std::string(e.what()));
  }
  bool ok = methods.size() == 0;
  std::string names;
  for (const char* m : methods) {
    ok = ok || method == m;
    names += std::string(names.empty() ? "" : ", ") + m;
  }
  f.check(key, ok, "has unknown method '" + method + "' (expected one of " + names + ")");
  return method;
}

// `alpha = A` rewrites the partition spec's alpha (see config.h). A whole alpha
// is written without ".0" ("alpha=1"), as a spec value.
void fold_alpha(const core::FlatConfig& f, SimConfig& c, const std::string& method, double alpha) {
  f.check(kAlpha, method == "dirichlet" || method == "quantity",
          "needs a dirichlet or quantity partition (partition is '" + c.partition + "')");
  f.check(kAlpha, alpha > 0 && std::isfinite(alpha), "must be > 0");
  std::string value = core::toml_number(alpha);
  if (value.size() > 2 && value.compare(value.size() - 2, 2, ".0") == 0) value.resize(value.size() - 2);
  std::string spec = method + ":alpha=" + value;
  const auto colon = c.partition.find(':');
  if (colon != std::string::npos) {
    std::stringstream rest(c.partition.substr(colon + 1));
    for (std::string item; std::getline(rest, item, ',');)
      if (trim(item.substr(0, item.find('='))) != kAlpha) spec += "," + trim(item);
  }
  c.partition = spec;
}

// The attack model (simulator/attack.h).
void check_attack(const core::FlatConfig& f, const SimConfig& c) {
  f.check("adversaries", c.adversaries >= 0 && c.adversaries < 1, "must be in [0, 1)");
  try {
    AttackSpec::parse(c.attack);
  } catch (const ConfigError& e) {
    f.fail("attack", e.what());
  }
}

// A key whose value cannot change this run is refused, naming the key and
// why. By value (not "was it set"): a run folder's config.toml holds every key,
// and it must load again for --resume, export and report.
void check_no_effect(const core::FlatConfig& f, const SimConfig& c, const std::string& dataset,
                     const std::string& path) {
  const SimConfig d;  // the defaults
  const bool fashion = dataset == "fashion-mnist", synthetic = dataset == "synthetic";
  f.check("data_dir", fashion || c.data_dir == d.data_dir,
          "has no effect with dataset = \"" + c.dataset + "\": it is where the fashion-mnist files are read");
  f.check("partition", !synthetic || c.partition == d.partition,
          "has no effect with the synthetic dataset: it generates each client's own data");
  const bool own_test = dataset == "folder" && core::has_data_folder_test(path);
  f.check("test_fraction", c.test_fraction == d.test_fraction || (dataset == "folder" && !own_test),
          dataset == "folder" ? "has no effect: " + path + " has its own test split (test/ or t10k files)"
                              : "has no effect with dataset = \"" + c.dataset +
                                    "\" (it is the share held out of a folder dataset without a test split)");
  f.check("attack", c.adversaries > 0 || c.attack == d.attack,
          "has no effect with adversaries = 0 (no client attacks)");
}

// Cross-key validation, after the file and the overrides.
void finish(const core::FlatConfig& f, SimConfig& c, std::optional<double> alpha) {
  federation::validate(c, f);  // the shared keys (and every double's finiteness), as sparrow-server
  f.check("clients", c.clients >= 1, "must be in [1, 10000000] (a simulation needs a population)");
  const bool folder = c.dataset.rfind("folder:", 0) == 0;
  std::string dmethod = "folder";
  if (folder) {  // a path, not a spec
    f.check("dataset", c.dataset.size() > 7, "'folder:PATH' needs a path");
  } else {
    dmethod = spec_method(f, "dataset", c.dataset, {});
    f.check("dataset", dmethod == "fashion-mnist" || dmethod == "synthetic",
            "has unknown dataset '" + dmethod +
                "' (expected one of fashion-mnist, synthetic[:alpha=A,beta=B], folder:PATH for your own data)");
  }
  f.check("test_fraction", c.test_fraction > 0 && c.test_fraction < 1, "must be in (0, 1)");
  f.check("validation", c.validation >= 0 && c.validation < 0.5, "must be in [0, 0.5) (0 = evaluate on the test set)");
  f.check("validation", c.validation == 0 || c.dataset.rfind("synthetic", 0) != 0,
          "is not available with the synthetic dataset (its test set is per client)");
  // A folder with its own clients (client_id.npy) is split by them unless
  // `partition` says otherwise (config.toml then records "natural").
  const std::string path = folder ? c.dataset.substr(7) : "";
  const bool ids = folder && core::has_client_ids(path);
  if (ids && !f.has("partition")) c.partition = "natural";
  const std::string pmethod =
      spec_method(f, "partition", c.partition, {"iid", "dirichlet", "shards", "quantity", "natural"});
  f.check("partition", pmethod != "natural" || ids,
          "\"natural\" needs a folder dataset with its own client ids (" + std::string(core::kClientIdFile) +
              ", one per sample)" + (folder ? "; " + path + " has none" : ""));
  if (alpha) fold_alpha(f, c, pmethod, *alpha);
  check_no_effect(f, c, dmethod, path);
  // The ranges of docs/simulator.md's key table (NaN fails every comparison).
  check_attack(f, c);
  f.check("workers", c.workers >= 1 && c.workers <= 1024, "must be in [1, 1024]");
  f.check("client_batch", c.client_batch >= 0 && c.client_batch <= 100000,
          "must be in [0, 100000] (0 = choose automatically, 1 = one client at a time)");
  f.check("threads", c.threads >= 0 && c.threads <= 1024, "must be in [0, 1024] (0 = cores / workers)");
  f.check("device", c.device == "cpu" || c.device == "cuda" || c.device.rfind("cuda:", 0) == 0,
          "must be \"cpu\", \"cuda\" or \"cuda:N\"");
  f.check("checkpoint_every", c.checkpoint_every >= 1 && c.checkpoint_every <= 100000000,
          "must be in [1, 100000000] (1 = every round)");
  f.check("out", !c.out.empty(), "must not be empty");
  f.check("state_encoding", state::valid_encoding(c.state_encoding), "must be \"fp32\" or \"bf16\"");
  // Simulated seconds: a deadline nobody meets is a legitimate experiment.
  f.check("deadline_s", c.deadline_s >= 0 && c.deadline_s <= 1e9, "must be in [0, 1e9] (0 = no deadline)");
  f.check("profiles.compute_speed", c.profiles.compute_speed >= 0 && c.profiles.compute_speed <= 10,
          "must be in [0, 10] (a lognormal sigma)");
  f.check("profiles.uplink_mbps", c.profiles.uplink_mbps > 0 && c.profiles.uplink_mbps <= 1e6, "must be in (0, 1e6]");
  f.check("profiles.downlink_mbps", c.profiles.downlink_mbps > 0 && c.profiles.downlink_mbps <= 1e6,
          "must be in (0, 1e6]");
  f.check("profiles.availability", c.profiles.availability > 0 && c.profiles.availability <= 1, "must be in (0, 1]");
}

SimConfig parse(const std::string& source, const std::string& text, const std::vector<std::string>& overrides,
                const std::string& default_out) {
  SimConfig c;
  double alpha = 0;
  core::FlatConfig f(source);
  bind_fields(f, c);
  f.bind(kAlpha, &alpha);
  // A deployment's own keys: accepted, reported, unused.
  const federation::OtherProgramKeys deployment_keys(f, federation::OtherProgramKeys::Program::kSimulator);
  f.read(text, overrides);
  if (!f.has("out") && !default_out.empty()) c.out = default_out;
  deployment_keys.collect(f, c);
  finish(f, c, f.has(kAlpha) ? std::optional<double>(alpha) : std::nullopt);
  return c;
}

}  // namespace

bool operator==(const DeviceProfiles& a, const DeviceProfiles& b) {
  return std::tie(a.compute_speed, a.uplink_mbps, a.downlink_mbps, a.availability) ==
         std::tie(b.compute_speed, b.uplink_mbps, b.downlink_mbps, b.availability);
}

// Field by field, as their TOML values (so a nan equals a nan).
bool operator==(const SimConfig& a, const SimConfig& b) {
  const Reader ra(a), rb(b);
  for (const std::string& key : ra.f.keys())
    if (ra.f.toml_value(key) != rb.f.toml_value(key)) return false;
  return true;
}

SimConfig parse_config_string(const std::string& toml_text, const std::vector<std::string>& overrides) {
  return parse("<string>", toml_text, overrides, "");
}

SimConfig load_config(const std::string& path, const std::vector<std::string>& overrides) {
  SimConfig c =
      parse(path, core::read_config_file(path), overrides, "runs/" + std::filesystem::path(path).stem().string());
  for (const std::string& key : c.no_effect)
    spdlog::info("{}", federation::OtherProgramKeys::note(key, federation::OtherProgramKeys::Program::kSimulator));
  return c;
}

std::string to_toml(const SimConfig& c) {
  SPARROW_CHECK_T(ConfigError, c.seed <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
                  "seed " << c.seed << " does not fit a TOML integer");
  const Reader r(c);
  std::string top = "# sparrow-sim effective configuration\n", profiles = "\n[profiles]\n";
  for (const std::string& key : r.f.keys()) {
    const auto dot = key.find('.');
    if (dot == std::string::npos)
      top += key + " = " + r.f.toml_value(key) + "\n";
    else
      profiles += key.substr(dot + 1) + " = " + r.f.toml_value(key) + "\n";
  }
  return top + profiles;
}

std::vector<std::string> config_differences(const SimConfig& a, const SimConfig& b) {
  const Reader ra(a), rb(b);
  std::vector<std::string> out;
  for (const std::string& key : ra.f.keys()) {
    const std::string va = ra.f.toml_value(key), vb = rb.f.toml_value(key);
    if (va != vb) out.push_back(key + " (" + va + " -> " + vb + ")");
  }
  return out;
}

}  // namespace sparrow::simulator
