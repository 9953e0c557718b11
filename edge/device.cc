#include "edge/device.h"

#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include <cstring>

#include "core/peer_text.h"
#include "core/spec.h"
#include "edge/act_codec.h"
#include "edge/cloud.h"
#include "edge/split.h"
#include "wire/net.h"

namespace sparrow::edge {

namespace {

void validate(const DeviceConfig& c) {
  auto need = [](bool ok, const std::string& msg) {
    if (!ok) throw ConfigError("device config: " + msg);
  };
  need(!c.cloud.empty(), "cloud: must not be empty");
  net::check_endpoint("device config: cloud", c.cloud, /*for_bind=*/false);
  // The cloud refuses other ids at Hello (docs/security.md).
  need(core::valid_client_id(c.device_id), "device_id: " + core::client_id_problem(c.device_id));
  need(c.insecure || (!c.cloud_key.empty() && !c.key.empty()), "cloud_key and key must be set (or insecure = true)");
  need(c.batch_size >= 1 && c.batch_size <= 65536, "batch_size: must be in [1, 65536]");
  need(c.save_every >= 1, "save_every: must be >= 1");
  need(c.threads >= 0 && c.threads <= 1024, "threads: must be in [0, 1024] (0 = one per core)");
  need(c.reply_timeout_ms >= 10, "reply_timeout_ms: must be >= 10");
  need(c.backoff_initial_ms >= 1 && c.backoff_max_ms >= c.backoff_initial_ms,
       "backoff: need 1 <= backoff_initial_ms <= backoff_max_ms");
  need(c.max_message_mb >= 1 && c.max_message_mb <= 2047, "max_message_mb: must be in [1, 2047]");
  need(c.clients >= 1 && c.clients <= 1000000 && c.index >= 0 && c.index < c.clients,
       "clients/index: need clients >= 1 and 0 <= index < clients");
}

namespace cflat = compression::flat;

cflat::Tensor to_flat_tensor(const at::Tensor& t) {
  const at::Tensor c = t.detach().to(at::kCPU, at::kFloat).contiguous();
  return cflat::Tensor{std::vector<int64_t>(c.sizes().begin(), c.sizes().end()),
                       std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel())};
}

// Copies `t` into `dst` (shapes checked by the protocol).
void copy_into(at::Tensor& dst, const cflat::Tensor& t) {
  torch::NoGradGuard no_grad;
  dst.copy_(torch::from_blob(const_cast<float*>(t.data.data()), t.shape, torch::kFloat));
}

std::vector<int64_t> to_vector(const at::Tensor& y) {
  const at::Tensor c = y.to(at::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

// The LibTorch bottom as the protocol's device::Bottom: the model's bottom at
// `cut` (EdgeHalf: forward, the codec, backward into .grad), its Sgd and the
// device's data.
class TorchBottom : public device::Bottom {
 public:
  TorchBottom(const DeviceConfig& cfg, DeviceData data) : data_(std::move(data)) {
    model_ = core::make_model(cfg.model, cfg.seed);
    if (!cfg.weights.empty()) load_weights(*model_, cfg.weights);
    split_ = std::make_unique<Split>(split_model(model_, cfg.cut));
    edge_ = std::make_unique<EdgeHalf>(split_->bottom, cfg.codec, cfg.freeze);
    sgd_ = std::make_unique<Sgd>(split_->bottom.parameters(), cfg.lr, cfg.momentum);
    digest_ = bottom_digest(split_->bottom.parameter_names(), split_->bottom.parameters());
  }

  const ModelPart& part() const { return split_->bottom; }

  int64_t train_size() const override { return data_.train.size(); }
  int64_t test_size() const override { return data_.test.size(); }
  std::vector<int64_t> train_labels(const std::vector<int64_t>& rows) const override {
    return to_vector(data_.train.y.index_select(0, torch::tensor(rows, torch::kLong)));
  }
  std::vector<int64_t> test_labels(int64_t begin, int64_t end) const override {
    return to_vector(data_.test.y.slice(0, begin, end));
  }

  uint64_t digest() const override { return digest_; }
  const std::string& codec_spec() const override { return edge_->codec().spec(); }
  bool lowrank() const override { return edge_->codec().lowrank(); }
  ActPacket forward(const std::vector<int64_t>& rows) override {
    split_->bottom.train(true);
    sgd_->zero_grad();
    return edge_->forward(data_.train.x.index_select(0, torch::tensor(rows, torch::kLong)));
  }
  void backward(const ActPacket& gradient) override { edge_->backward(gradient); }
  void step() override {
    sgd_->step();
    sgd_->zero_grad();
  }
  ActPacket infer(int64_t begin, int64_t end) override {
    split_->bottom.train(false);
    ActPacket p = edge_->infer(data_.test.x.slice(0, begin, end));
    split_->bottom.train(true);
    return p;
  }
  flat::CodecState codec_state() const override { return to_flat(edge_->codec_state()); }
  void set_codec_state(const flat::CodecState& s) override { edge_->codec_state() = from_flat(s); }
  void force_basis_refresh() override { edge_->force_basis_refresh(); }

  std::vector<std::string> names() const override { return split_->bottom.parameter_names(); }
  std::vector<cflat::Tensor> tensors(Slot slot) const override {
    const std::vector<at::Tensor> t = slot == Slot::kWeights ? split_->bottom.parameters() : sgd_->buffers();
    std::vector<cflat::Tensor> out;
    for (const at::Tensor& x : t) out.push_back(to_flat_tensor(x));
    return out;
  }
  void load(Slot slot, const std::vector<cflat::Tensor>& t) override {
    std::vector<at::Tensor> params = split_->bottom.parameters();
    std::vector<at::Tensor>& dst = slot == Slot::kWeights ? params : sgd_->buffers();
    for (size_t i = 0; i < t.size(); ++i) copy_into(dst[i], t[i]);
  }
  std::vector<std::pair<std::string, cflat::Tensor>> buffers() const override {
    std::vector<std::pair<std::string, cflat::Tensor>> out;
    for (const auto& b : split_->bottom.model()->named_buffers(/*recurse=*/true))
      out.emplace_back(b.key(), to_flat_tensor(b.value()));
    return out;
  }
  void load_buffer(const std::string& name, const cflat::Tensor& t) override {
    for (auto& b : split_->bottom.model()->named_buffers(/*recurse=*/true))
      if (b.key() == name) copy_into(b.value(), t);
  }

 private:
  DeviceData data_;
  std::shared_ptr<core::Model> model_;
  std::unique_ptr<Split> split_;
  std::unique_ptr<EdgeHalf> edge_;
  std::unique_ptr<Sgd> sgd_;
  uint64_t digest_ = 0;
};

device::Config protocol_config(const DeviceConfig& cfg) {
  device::Config p = device::config_of(cfg);
  p.label = split_model_label(cfg.model, cfg.cut);
  p.software = "sparrow-edge 0.1.0";
  p.step_log = device::StepLog::kFramed;
  return p;
}

}  // namespace

struct EdgeDevice::Impl {
  Impl(EdgeDevice& self, DeviceConfig cfg, DeviceData data)
      : bottom((validate(cfg), cfg), std::move(data)), protocol(protocol_config(cfg), bottom, self.stop_) {}
  TorchBottom bottom;
  device::Protocol protocol;
};

EdgeDevice::EdgeDevice(DeviceConfig cfg, DeviceData data)
    : impl_(std::make_unique<Impl>(*this, std::move(cfg), std::move(data))) {}
EdgeDevice::~EdgeDevice() = default;

EdgeDevice::Summary EdgeDevice::run() { return impl_->protocol.run(); }
void EdgeDevice::set_drop_hook(std::function<bool(uint64_t)> hook) { impl_->protocol.set_drop_hook(std::move(hook)); }
uint64_t EdgeDevice::completed_steps() const { return impl_->protocol.completed_steps(); }

std::map<std::string, at::Tensor> EdgeDevice::model_buffers() const {
  std::map<std::string, at::Tensor> out;
  for (const auto& b : impl_->bottom.part().model()->named_buffers(/*recurse=*/true))
    out[b.key()] = b.value().detach().to(at::kCPU).clone();
  return out;
}

std::map<std::string, at::Tensor> EdgeDevice::bottom_weights() const {
  return copy_weights(impl_->bottom.part().parameter_names(), impl_->bottom.part().parameters());
}

}  // namespace sparrow::edge
