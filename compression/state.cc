#include "compression/state.h"

#include <ATen/ATen.h>

#include <vector>

#include "compression/state_format.h"
#include "core/error.h"

namespace sparrow::compression {

at::Tensor& State::slot(const std::string& key, const at::Tensor& like) {
  auto it = tensors.find(key);
  if (it == tensors.end() || !it->second.sizes().equals(like.sizes())) {
    at::Tensor z = at::zeros(like.sizes(), at::TensorOptions().dtype(at::kFloat));
    it = tensors.insert_or_assign(key, z).first;
  }
  return it->second;
}

std::string State::serialize() const {
  std::vector<at::Tensor> held;  // contiguous CPU views (copies only of tensors that are not)
  held.reserve(tensors.size());
  std::vector<state_format::SlotView> slots;
  slots.reserve(tensors.size());
  for (const auto& [name, t] : tensors) {
    SPARROW_CHECK(t.scalar_type() == at::kFloat, "compressor state '" << name << "' is not float32");
    const at::Tensor& c = held.emplace_back(t.contiguous().cpu());
    slots.push_back({&name, c.sizes().data(), c.sizes().size(), c.data_ptr<float>(), static_cast<size_t>(c.numel())});
  }
  return state_format::write({step, last_round}, slots);
}

State State::deserialize(const std::string& bytes) {
  State s;
  const state_format::Header h =
      state_format::read(bytes.data(), bytes.size(), [&s](std::string name, const std::vector<int64_t>& shape) {
        at::Tensor& t = s.tensors[std::move(name)];
        t = at::empty(shape, at::TensorOptions().dtype(at::kFloat));
        return t.data_ptr<float>();
      });
  s.step = h.step;
  s.last_round = h.last_round;
  return s;
}

std::string serialize_weights(const std::map<std::string, at::Tensor>& weights) {
  State s;
  for (const auto& [k, v] : weights) s.tensors[k] = v.to(at::kCPU, at::kFloat).contiguous();
  return s.serialize();
}

std::map<std::string, at::Tensor> deserialize_weights(const std::string& bytes) {
  if (bytes.empty()) return {};
  return State::deserialize(bytes).tensors;
}

}  // namespace sparrow::compression
