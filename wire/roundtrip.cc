#include "wire/roundtrip.h"

#include <ATen/ATen.h>

#include <chrono>

#include "compression/lowrank.h"
#include "compression/mask.h"
#include "core/error.h"
#include "wire/wire.h"

namespace sparrow::wire {
namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

}  // namespace

RoundTrip::RoundTrip(const compression::Compressor& compressor, uint64_t seed) : compressor_(compressor), seed_(seed) {}

RoundTripResult RoundTrip::step(const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  RoundTripResult r;
  ModelUpdate update;
  update.round = static_cast<uint64_t>(round_);
  update.num_samples = 1;
  std::vector<compression::Context> contexts(tensors.size());
  auto t0 = Clock::now();
  for (size_t i = 0; i < tensors.size(); ++i) {
    compression::Context& ctx = contexts[i];
    ctx.name = tensors[i].first;
    ctx.seed = seed_;
    ctx.round = round_;
    auto it = shared_.find(ctx.name);
    if (it != shared_.end()) ctx.shared_factor = it->second;
    if (auto m = masks_.find(ctx.name); m != masks_.end()) ctx.mask = m->second;
    update.tensors.push_back({ctx.name, compressor_.encode(tensors[i].second, states_[ctx.name], ctx)});
  }
  r.encode_ms = ms_since(t0);

  t0 = Clock::now();
  Message sent;
  sent.body = std::move(update);
  const std::string bytes = serialize(sent);
  Message received = parse(bytes.data(), bytes.size());
  r.serialize_ms = ms_since(t0);
  r.wire_bytes = bytes.size();
  const auto& got = std::get<ModelUpdate>(received.body);
  SPARROW_CHECK(got.tensors.size() == tensors.size(), "round trip lost tensors");

  t0 = Clock::now();
  for (size_t i = 0; i < got.tensors.size(); ++i) {
    const compression::Encoded& e = got.tensors[i].tensor;
    // Decoded into a buffer kept per tensor, as an aggregator folds updates into
    // a running sum it already holds (decode_add): no fresh allocation per step.
    at::Tensor& out = decoded_[got.tensors[i].name];
    if (!out.defined() || out.sizes() != at::IntArrayRef(e.shape))
      out = at::zeros(e.shape, at::TensorOptions().dtype(at::kFloat));
    else
      out.zero_();
    compression::decode_add(e, out, 1.0f, contexts[i]);
    r.decoded.push_back(out);
    // The aggregator's half of ACP: the mean factor of this round (one client
    // here), orthonormalised, is the shared factor of the next round.
    if (e.format == compression::Format::kLowRankFactor)
      shared_[got.tensors[i].name] = compression::acp_next_shared(compression::acp_factor(e));
    // The aggregator's half of TCS: the next mask is where this round's (one
    // client's) update is largest.
    if (compressor_.mask_ratio() > 0)
      masks_[got.tensors[i].name] = compression::step_mask(out, compressor_.mask_ratio());
  }
  r.decode_ms = ms_since(t0);
  ++round_;
  return r;
}

}  // namespace sparrow::wire
