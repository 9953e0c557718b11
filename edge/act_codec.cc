// The LibTorch face of the activation codecs (act_codec.h): tensors in and
// out, the CodecState conversions; the codecs themselves are the torch-free
// ones (edge/codec/act_codec_flat.h), run on CPU fp32 copies.
#include "edge/act_codec.h"

#include <torch/torch.h>

#include <cmath>
#include <cstring>

#include "compression/state.h"
#include "core/error.h"

namespace sparrow::edge {
namespace {

constexpr int64_t kMaxNumel = (int64_t{1} << 31) - 1;

flat::Matrix to_matrix(const at::Tensor& t) {
  flat::Matrix m;
  if (!t.defined() || t.numel() == 0) return m;
  SPARROW_CHECK(t.dim() == 2, "codec state: a state tensor is not a matrix");
  const at::Tensor c = t.detach().to(at::kCPU, at::kFloat).contiguous();
  m.rows = c.size(0);
  m.cols = c.size(1);
  m.data.assign(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
  return m;
}

at::Tensor to_tensor(const flat::Matrix& m) {
  if (m.empty()) return at::Tensor();
  at::Tensor t = at::empty({m.rows, m.cols}, at::kFloat);
  std::memcpy(t.data_ptr<float>(), m.data.data(), 4 * m.data.size());
  return t;
}

at::Tensor to_tensor(const std::vector<float>& v, const std::vector<int64_t>& shape) {
  at::Tensor t = at::empty(shape, at::kFloat);
  if (!v.empty()) std::memcpy(t.data_ptr<float>(), v.data(), 4 * v.size());
  return t;
}

// The basis half of a state (all the decoders read).
flat::CodecState basis_only(const CodecState& s) {
  flat::CodecState f;
  f.basis = to_matrix(s.basis);
  f.basis_id = s.basis_id;
  return f;
}

}  // namespace

flat::CodecState to_flat(const CodecState& s) {
  flat::CodecState f;
  f.basis = to_matrix(s.basis);
  f.sketch = to_matrix(s.sketch);
  f.tracker = to_matrix(s.tracker);
  f.basis_id = s.basis_id;
  f.steps = s.steps;
  f.refresh_next = s.refresh_next;
  return f;
}

CodecState from_flat(const flat::CodecState& f) {
  CodecState s;
  s.basis = to_tensor(f.basis);
  s.sketch = to_tensor(f.sketch);
  s.tracker = to_tensor(f.tracker);
  s.basis_id = f.basis_id;
  s.steps = f.steps;
  s.refresh_next = f.refresh_next;
  return s;
}

ActCodec::ActCodec(const std::string& spec) : flat_(spec) {}

ActPacket ActCodec::encode(const at::Tensor& x, CodecState& state, bool infer) const {
  SPARROW_CHECK(x.defined() && x.dim() >= 1 && x.numel() > 0, "encode: empty activation");
  SPARROW_CHECK(x.numel() <= kMaxNumel, "encode: activation too large");
  at::NoGradGuard no_grad;
  const at::Tensor a = x.detach().to(at::kCPU, at::kFloat).contiguous();
  if (!flat_.lowrank()) {  // stateless but for the step count
    flat::CodecState f;
    f.steps = state.steps;
    ActPacket p = flat_.encode(a.data_ptr<float>(), x.sizes().vec(), f, infer);
    state.steps = f.steps;
    return p;
  }
  flat::CodecState f = to_flat(state);
  ActPacket p = flat_.encode(a.data_ptr<float>(), x.sizes().vec(), f, infer);
  state = from_flat(f);
  return p;
}

at::Tensor decode(const ActPacket& p) { return to_tensor(flat::decode(p), p.shape); }

at::Tensor decode_activation(const ActPacket& p, CodecState& peer) {
  flat::CodecState f = basis_only(peer);
  at::Tensor out = to_tensor(flat::decode_activation(p, f), p.shape);
  if (f.basis_id != peer.basis_id || p.format == ActFormat::kLowRank || p.format == ActFormat::kLowRankQ) {
    peer.basis = to_tensor(f.basis);
    peer.basis_id = f.basis_id;
  }
  return out;
}

ActPacket encode_gradient(const at::Tensor& grad, const ActPacket& act, const ActCodec& codec, const CodecState& peer) {
  SPARROW_CHECK(grad.defined() && grad.sizes().vec() == act.shape,
                "encode_gradient: gradient shape does not match the activation");
  at::NoGradGuard no_grad;
  const at::Tensor g = grad.detach().to(at::kCPU, at::kFloat).contiguous();
  return flat::encode_gradient(g.data_ptr<float>(), act, codec.flat(), basis_only(peer));
}

at::Tensor decode_gradient(const ActPacket& p, const CodecState& state, const std::vector<int64_t>& expected_shape) {
  return to_tensor(flat::decode_gradient(p, basis_only(state), expected_shape), p.shape);
}

std::map<std::string, at::Tensor> codec_state_tensors(const CodecState& s, const std::string& prefix) {
  std::map<std::string, at::Tensor> t;
  const std::pair<const char*, const at::Tensor*> slots[] = {
      {"basis", &s.basis}, {"sketch", &s.sketch}, {"tracker", &s.tracker}};
  for (const auto& [name, v] : slots)
    if (v->defined()) t[prefix + name] = v->detach().to(at::kCPU, at::kFloat).contiguous();
  std::vector<float> meta{static_cast<float>(s.basis_id & 0xffffu), static_cast<float>(s.basis_id >> 16),
                          s.refresh_next ? 1.0f : 0.0f};
  for (int i = 0; i < 4; ++i) meta.push_back(static_cast<float>((s.steps >> (16 * i)) & 0xffffu));
  t[prefix + "meta"] = torch::tensor(meta);
  return t;
}

CodecState codec_state_from_tensors(const std::map<std::string, at::Tensor>& t, const std::string& prefix) {
  auto meta = t.find(prefix + "meta");
  SPARROW_CHECK_T(FormatError, meta != t.end() && meta->second.numel() == 7, "codec state: no '" << prefix << "meta'");
  const at::Tensor m = meta->second.to(at::kFloat).contiguous();
  const float* v = m.data_ptr<float>();
  auto piece = [&](int i) {
    SPARROW_CHECK_T(FormatError, v[i] >= 0 && v[i] < 65536 && v[i] == std::floor(v[i]),
                    "codec state: bad '" << prefix << "meta'");
    return static_cast<uint64_t>(v[i]);
  };
  CodecState s;
  s.basis_id = static_cast<uint32_t>(piece(0) | (piece(1) << 16));
  s.refresh_next = piece(2) != 0;
  for (int i = 0; i < 4; ++i) s.steps |= piece(3 + i) << (16 * i);
  for (auto [name, slot] :
       {std::pair<const char*, at::Tensor*>{"basis", &s.basis}, {"sketch", &s.sketch}, {"tracker", &s.tracker}}) {
    auto it = t.find(prefix + name);
    if (it == t.end()) continue;
    SPARROW_CHECK_T(FormatError, it->second.dim() == 2, "codec state: '" << prefix << name << "' is not a matrix");
    *slot = it->second.clone();
  }
  SPARROW_CHECK_T(FormatError, !s.basis.defined() || s.basis_id != 0, "codec state: a basis without an id");
  return s;
}

std::string serialize_codec_state(const CodecState& s) {
  compression::State st;
  st.tensors = codec_state_tensors(s);
  return st.serialize();
}

CodecState deserialize_codec_state(const std::string& bytes) {
  if (bytes.compare(0, 4, "SPAC") == 0) return from_flat(flat::CodecState::deserialize(bytes));
  return codec_state_from_tensors(compression::State::deserialize(bytes).tensors);
}

}  // namespace sparrow::edge
