// The run's data and population: the data set loaded once (Fashion-MNIST,
// LEAF Synthetic or a folder in sparrow-client's format), partitioned over the
// clients as a deployed client of the same partition index holds it
// (federation::partition_seed), stored client-major so a client's samples are
// a view; and each client's speed and link rates, drawn from the seed.
#include <cmath>
#include <filesystem>
#include <optional>

#include "core/data_folder.h"
#include "core/datasets.h"
#include "core/error.h"
#include "core/idx.h"
#include "core/partition.h"
#include "core/rng.h"
#include "core/spec.h"
#include "federation/client_pipeline.h"
#include "simulator/impl.h"

namespace sparrow::simulator {
namespace {
constexpr uint64_t kProfileTag = 0x70726f66;  // "prof"

// `validation` of the training samples become the evaluation set (`ids`, a
// per-sample tensor such as the folder's client ids, kept in step).
void hold_validation_share(const SimConfig& cfg, core::Dataset& tr, core::Dataset& te, at::Tensor* ids,
                           std::string& note) {
  if (cfg.validation <= 0) return;
  const auto hold = static_cast<int64_t>(std::llround(cfg.validation * static_cast<double>(tr.size())));
  SPARROW_CHECK_T(ConfigError, hold >= 1 && hold < tr.size(),
                  "validation: " << cfg.validation << " of " << tr.size() << " training samples holds out " << hold);
  te = core::hold_out(tr, hold, federation::partition_seed(cfg.seed) ^ 0x7a11du, ids);
  note = "evaluating on " + std::to_string(hold) + " validation samples held out of the " +
         std::to_string(tr.size() + hold) + " training samples (validation = " + std::to_string(cfg.validation) +
         "); the test set is not used";
}
}  // namespace

void Simulator::Impl::load_data() {
  if (cfg.dataset.rfind("folder:", 0) == 0) {  // a path is no spec (it may hold ',' or '=')
    load_folder(cfg.dataset.substr(7));
    return;
  }
  Spec ds = Spec::parse(cfg.dataset);
  if (ds.method() == "fashion-mnist") {
    ds.check_all_consumed();
    // The images stay uint8 until store_client_major() writes them, in
    // client order, as floats (one 188 MB allocation, not two).
    core::ImageSplit trs = core::load_mnist_bytes(cfg.data_dir, "train");
    core::ImageSplit tes = core::load_mnist_bytes(cfg.data_dir, "test");
    core::Dataset tr{trs.images, trs.labels}, te{tes.images, tes.labels};
    hold_validation(tr, te);
    auto parts = core::partition(tr.y, cfg.clients, cfg.partition, federation::partition_seed(cfg.seed));
    train_x = tr.x;
    train_y = tr.y;
    test_x = core::normalize_bytes(te.x, core::kFashionMnistMean, core::kFashionMnistStd);
    test_y = te.y;
    for (auto& p : parts) client_idx.push_back(at::tensor(p, at::kLong));
  } else if (ds.method() == "synthetic") {
    const double a = ds.get_double("alpha", 1.0), b = ds.get_double("beta", 1.0);
    ds.check_all_consumed();
    core::FederatedData fd = core::make_synthetic(a, b, cfg.clients, cfg.seed);
    std::vector<at::Tensor> xs, ys, txs, tys;
    int64_t off = 0;
    for (size_t k = 0; k < fd.train.size(); ++k) {
      const int64_t n = fd.train[k].size();
      client_idx.push_back(at::arange(off, off + n, at::kLong));
      off += n;
      xs.push_back(fd.train[k].x);
      ys.push_back(fd.train[k].y);
      txs.push_back(fd.test[k].x);
      tys.push_back(fd.test[k].y);
    }
    train_x = at::cat(xs);
    train_y = at::cat(ys);
    test_x = at::cat(txs);
    test_y = at::cat(tys);
  } else {
    throw ConfigError("dataset: unknown dataset '" + cfg.dataset + "' (known: fashion-mnist, synthetic, folder:PATH)");
  }
  store_client_major();
}

void Simulator::Impl::load_folder(const std::string& path) {
  SPARROW_CHECK_T(ConfigError, !path.empty(), "dataset: 'folder:PATH' needs a path");
  const std::string model = cfg.model == "logreg" ? "torchscript:" : cfg.model;  // logreg: any features
  core::Dataset tr = core::check_data_for_model(core::load_data_folder(path), model);
  // The folder's own clients (client_id.npy), kept in step with every holdout
  // below; only the natural partition reads them.
  std::optional<at::Tensor> ids = core::load_client_ids(path, tr.size());
  at::Tensor* keep = ids ? &*ids : nullptr;
  std::optional<core::Dataset> te = core::load_data_folder_test(path);
  std::string test_from =
      path + (std::filesystem::is_directory(std::filesystem::path(path) / "test") ? "/test" : " (t10k files)");
  if (te) {
    te = core::check_data_for_model(std::move(*te), model);
    SPARROW_CHECK_T(ConfigError, te->x.sizes().slice(1) == tr.x.sizes().slice(1),
                    "dataset: test samples of " << path << " have another shape than the training samples");
  } else {
    const int64_t n = tr.size();
    const auto hold = static_cast<int64_t>(std::llround(cfg.test_fraction * static_cast<double>(n)));
    SPARROW_CHECK_T(
        ConfigError, hold >= 1 && hold < n,
        "dataset: " << path << " has no test split (test/ or t10k files) and test_fraction = " << cfg.test_fraction
                    << " of " << n << " samples holds out " << hold << ": need at least 1 test and 1 training sample");
    te = core::hold_out(tr, hold, federation::partition_seed(cfg.seed) ^ 0x7e57u, keep);
    test_from = std::to_string(hold) + " samples held out (test_fraction = " + std::to_string(cfg.test_fraction) + ")";
  }
  hold_validation_share(cfg, tr, *te, keep, validation_note);
  SPARROW_CHECK_T(ConfigError, tr.size() >= cfg.clients,
                  "clients: " << cfg.clients << " clients but " << path << " has " << tr.size() << " training samples");
  auto parts = core::partition_folder(tr.y, ids, cfg.clients, cfg.partition, federation::partition_seed(cfg.seed));
  std::string natural_note;
  if (cfg.partition == "natural") {  // client c is the c-th distinct id, as sparrow-client's index c
    SPARROW_CHECK_T(ConfigError, parts.size() >= static_cast<size_t>(cfg.clients),
                    "clients: " << cfg.clients << " clients but " << path << "/" << core::kClientIdFile << " has "
                                << parts.size() << " distinct client ids"
                                << (parts.size() > 0 ? " (set clients = " + std::to_string(parts.size()) + ")" : ""));
    if (parts.size() > static_cast<size_t>(cfg.clients)) {
      natural_note = "; natural partition: the first " + std::to_string(cfg.clients) + " of " +
                     std::to_string(parts.size()) + " client ids";
      parts.resize(static_cast<size_t>(cfg.clients));
    }
  }
  train_x = tr.x;
  train_y = tr.y;
  test_x = te->x;
  test_y = te->y;
  for (auto& p : parts) client_idx.push_back(at::tensor(p, at::kLong));
  data_note = std::to_string(tr.size()) + " training samples from " + path + ", test set: " + test_from + natural_note;
  store_client_major();
}

void Simulator::Impl::hold_validation(core::Dataset& tr, core::Dataset& te) {
  hold_validation_share(cfg, tr, te, nullptr, validation_note);
}

void Simulator::Impl::store_client_major() {
  int64_t off = 0;
  for (const auto& idx : client_idx) {
    client_off.push_back(off);
    off += idx.numel();
  }
  const at::Tensor order = client_idx.empty() ? at::empty({0}, at::kLong) : at::cat(client_idx);
  train_x = train_x.scalar_type() == at::kByte
                ? core::normalize_bytes(train_x, core::kFashionMnistMean, core::kFashionMnistStd, order)
                : train_x.index_select(0, order);
  train_y = train_y.index_select(0, order);
}

void Simulator::Impl::stage_data() {
  if (device.is_cpu()) return;
  train_x = train_x.to(device);
  train_y = train_y.to(device);
  test_x = test_x.to(device);
  test_y = test_y.to(device);
  for (auto& idx : client_idx) idx = idx.to(device);
}

void Simulator::Impl::build_population() {
  const uint64_t key = rng::derive(cfg.seed, kProfileTag);
  const auto& p = cfg.profiles;
  availability = p.availability;
  profiles.resize(cfg.clients);
  for (int c = 0; c < cfg.clients; ++c) {
    const uint64_t i = 3 * static_cast<uint64_t>(c);
    Profile& q = profiles[c];
    q.speed = p.compute_speed > 0 ? std::exp(p.compute_speed * rng::normal(key, i)) : 1.0;
    q.up_bps = p.uplink_mbps * 1e6 * std::exp(0.5 * rng::normal(key, i + 1));
    q.down_bps = p.downlink_mbps * 1e6 * std::exp(0.5 * rng::normal(key, i + 2));
  }
}
}  // namespace sparrow::simulator
