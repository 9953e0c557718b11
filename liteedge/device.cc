#include "liteedge/device.h"

#include <algorithm>

#include "liteedge/bottom.h"

namespace sparrow::liteedge {

namespace {

namespace cflat = compression::flat;

// The lite bottom and the device's data as the protocol's device::Bottom.
class LiteBottom : public edge::device::Bottom {
 public:
  LiteBottom(const DeviceConfig& cfg, DeviceData data) : bottom_(cfg), data_(std::move(data)) {}

  liteedge::Bottom& bottom() { return bottom_; }
  const liteedge::Bottom& bottom() const { return bottom_; }

  int64_t train_size() const override { return data_.train.size(); }
  int64_t test_size() const override { return data_.test.size(); }
  std::vector<int64_t> train_labels(const std::vector<int64_t>& rows) const override {
    std::vector<int64_t> y;
    y.reserve(rows.size());
    for (int64_t i : rows) y.push_back(data_.train.y[static_cast<size_t>(i)]);
    return y;
  }
  std::vector<int64_t> test_labels(int64_t begin, int64_t end) const override {
    return std::vector<int64_t>(data_.test.y.begin() + begin, data_.test.y.begin() + end);
  }

  uint64_t digest() const override { return bottom_.digest(); }
  const std::string& codec_spec() const override { return bottom_.codec().spec(); }
  bool lowrank() const override { return bottom_.codec().lowrank(); }
  edge::ActPacket forward(const std::vector<int64_t>& rows) override {
    const int64_t per = bottom_.input_size();
    batch_x_.resize(rows.size() * static_cast<size_t>(per));
    for (size_t i = 0; i < rows.size(); ++i)
      std::copy_n(data_.train.x.begin() + rows[i] * per, per, batch_x_.begin() + static_cast<int64_t>(i) * per);
    return bottom_.forward(batch_x_.data(), static_cast<int64_t>(rows.size()));
  }
  void backward(const edge::ActPacket& gradient) override { bottom_.backward(gradient); }
  void step() override { bottom_.step(); }
  edge::ActPacket infer(int64_t begin, int64_t end) override {
    return bottom_.infer(data_.test.x.data() + begin * bottom_.input_size(), end - begin);
  }
  edge::flat::CodecState codec_state() const override { return bottom_.codec_state(); }
  void set_codec_state(const edge::flat::CodecState& s) override { bottom_.codec_state() = s; }
  void force_basis_refresh() override { bottom_.force_basis_refresh(); }

  std::vector<std::string> names() const override { return bottom_.names(); }
  std::vector<cflat::Tensor> tensors(Slot slot) const override {
    const auto shapes = bottom_.shapes();
    std::vector<cflat::Tensor> out;
    for (size_t i = 0; i < shapes.size(); ++i)
      out.push_back(cflat::Tensor{shapes[i], slot == Slot::kWeights ? bottom_.value(i) : bottom_.momentum(i)});
    return out;
  }
  void load(Slot slot, const std::vector<cflat::Tensor>& t) override {
    for (size_t i = 0; i < t.size(); ++i) (slot == Slot::kWeights ? bottom_.value(i) : bottom_.momentum(i)) = t[i].data;
  }

 private:
  liteedge::Bottom bottom_;
  DeviceData data_;
  std::vector<float> batch_x_;  // the rows of the current minibatch
};

edge::device::Config protocol_config(const DeviceConfig& cfg) {
  edge::device::Config p = edge::device::config_of(cfg);
  p.software = "sparrow-edge-lite 0.1.0";
  p.step_log = edge::device::StepLog::kPlain;
  return p;
}

}  // namespace

struct EdgeDevice::Impl {
  Impl(EdgeDevice& self, DeviceConfig cfg, DeviceData data)
      : bottom(cfg, std::move(data)), protocol(protocol_config(cfg), bottom, self.stop_) {}
  LiteBottom bottom;
  edge::device::Protocol protocol;
};

EdgeDevice::EdgeDevice(DeviceConfig cfg, DeviceData data)
    : impl_(std::make_unique<Impl>(*this, std::move(cfg), std::move(data))) {}
EdgeDevice::~EdgeDevice() = default;

EdgeDevice::Summary EdgeDevice::run() { return impl_->protocol.run(); }
void EdgeDevice::set_drop_hook(std::function<bool(uint64_t)> hook) { impl_->protocol.set_drop_hook(std::move(hook)); }
uint64_t EdgeDevice::completed_steps() const { return impl_->protocol.completed_steps(); }
std::map<std::string, compression::flat::Tensor> EdgeDevice::bottom_weights() const {
  return impl_->bottom.bottom().weights();
}

}  // namespace sparrow::liteedge
