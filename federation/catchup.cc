#include "federation/catchup.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>

#include "compression/codec_bits.h"
#include "compression/compressor.h"
#include "core/error.h"
#include "core/spec.h"

namespace sparrow::federation {
namespace {

// fp32 bit patterns: -0.0 and 0.0 differ, as they do for the client's model.
bool same_bits(float a, float b) {
  uint32_t x = 0, y = 0;
  std::memcpy(&x, &a, 4);
  std::memcpy(&y, &b, 4);
  return x == y;
}

}  // namespace

CatchupPolicy parse_catchup(const std::string& spec) {
  CatchupPolicy p;
  Spec s = Spec::parse(spec);
  const std::string m = s.method();
  if (m == "full")
    p.mode = CatchupMode::kFull;
  else if (m == "chain")
    p.mode = CatchupMode::kChain;
  else if (m == "patch")
    p.mode = CatchupMode::kPatch;
  else if (m == "auto")
    p.mode = CatchupMode::kAuto;
  else
    throw ConfigError("unknown downlink_catchup policy '" + m + "' (full, chain[:max=K], patch or auto[:max=K])");
  if (p.chain()) {
    const int64_t k = s.get_int("max", static_cast<int64_t>(p.max_steps));
    if (k < 2) throw ConfigError("downlink_catchup '" + spec + "': max must be >= 2 (the steps a chain may span)");
    p.max_steps = static_cast<uint64_t>(k);
  }
  try {
    s.check_all_consumed();
  } catch (const ConfigError& e) {
    throw ConfigError(std::string("downlink_catchup: ") + e.what());
  }
  return p;
}

const char* plan_name(CatchupPlan::Kind k) {
  switch (k) {
    case CatchupPlan::Kind::kFull:
      return "full";
    case CatchupPlan::Kind::kDelta:
      return "delta";
    case CatchupPlan::Kind::kChain:
      return "chain";
    case CatchupPlan::Kind::kPatch:
      return "patch";
  }
  return "?";
}

std::optional<compression::Encoded> make_patch(const std::vector<int64_t>& shape, const uint32_t* changed,
                                               const float* values, int64_t numel, uint64_t base) {
  std::vector<int64_t> idx;
  std::vector<float> vals;
  for (int64_t i = 0; i < numel; ++i)
    if (changed[i] > base) {
      idx.push_back(i);
      vals.push_back(values[i]);
    }
  if (idx.empty()) return std::nullopt;
  return compression::detail::make_sparse(shape, idx.data(), vals.data(), idx.size(), compression::ValueType::kF32,
                                          0.0f, compression::detail::IndexMode::kRice);
}

CatchupPlan CatchupView::plan(std::optional<uint64_t> held, uint16_t minor) const {
  const bool catchup = minor >= wire::kCatchupMinor, packed = minor >= wire::kPackedMinor;
  // A packed task: the name table and list count once (a bound: the model's
  // every name), then a list per step (list 0, the weights, empty in a chain).
  const auto frame = [&](size_t lists) {  // packed_frame_ counts the list count as one byte
    return packed_frame_ + (lists >= 128) + (lists >= 16384);
  };
  CatchupPlan full;
  full.bytes = full_bytes_;
  if (!held || *held > round_) return full;
  const uint64_t s = *held;
  CatchupPlan p;
  p.kind = CatchupPlan::Kind::kDelta;
  p.base = s;
  if (s == round_) return p;  // holds B_t: an empty Delta
  const bool newest = !steps_.empty() && steps_.back()->round == round_;
  if (s + 1 == round_) {
    if (!newest) return full;
    p.chain.push_back(steps_.back());
    p.bytes = packed ? frame(1) + steps_.back()->packed_bytes : steps_.back()->bytes;
    return p;
  }
  if (!catchup || s < known_from_ || policy_.mode == CatchupMode::kFull) return full;
  CatchupPlan best = full;
  if (policy_.chain() && newest && steps_.front()->round <= s + 1 && round_ - s <= policy_.max_steps) {
    CatchupPlan c;
    c.kind = CatchupPlan::Kind::kChain;
    c.base = s;
    for (const auto& st : steps_)
      if (st->round > s) {
        c.chain.push_back(st);
        c.bytes += packed ? st->packed_bytes : st->bytes;
      }
    if (packed) c.bytes += frame(1 + c.chain.size()) + 1;
    if (c.bytes < best.bytes) best = std::move(c);
  }
  if (policy_.patch() && !changed_.empty()) {
    // A lower bound first (4 bytes a value): most patches of a long absence
    // lose to the chain or the model, and then are never built.
    uint64_t k = 0;
    for (const auto& ch : changed_)
      for (uint32_t v : *ch) k += v > s;
    if (4 * k < best.bytes) {
      CatchupPlan c;
      c.kind = CatchupPlan::Kind::kPatch;
      c.base = s;
      if (packed) c.bytes = frame(1) + 1;
      for (size_t i = 0; i < names_.size(); ++i) {
        const at::Tensor& v = values_[i];
        auto e = make_patch(shapes_[i], changed_[i]->data(), v.data_ptr<float>(), v.numel(), s);
        if (!e) continue;
        c.bytes += packed ? wire::packed_tensor_size(*e, i) : wire::encoded_size(*e, names_[i]);
        c.patch.push_back({names_[i], std::move(*e)});
      }
      if (c.bytes < best.bytes) best = std::move(c);
    }
  }
  return best;
}

CatchupHistory::CatchupHistory(const CatchupPolicy& policy, const std::vector<std::string>& names, const Weights& b,
                               uint64_t round)
    : policy_(policy), names_(names), round_(round), known_from_(round) {
  for (const auto& n : names_) {
    const at::Tensor& t = b.at(n);
    shapes_.push_back(t.sizes().vec());
    full_bytes_ += wire::encoded_size(compression::dense_encoded(t), n);
    if (policy_.patch())
      changed_.push_back(
          std::make_shared<std::vector<uint32_t>>(static_cast<size_t>(t.numel()), static_cast<uint32_t>(round)));
  }
  packed_frame_ = wire::packed_frame_size(names_, shapes_, 1);
}

void CatchupHistory::forget_before(uint64_t r) {
  steps_.clear();
  known_from_ = r;
  for (auto& ch : changed_) ch = std::make_shared<std::vector<uint32_t>>(ch->size(), static_cast<uint32_t>(r));
}

void CatchupHistory::begin_step(uint64_t t) {
  SPARROW_CHECK(t >= 1, "CatchupHistory: steps start at 1");
  if (t != round_ + 1) forget_before(t - 1);  // a restored checkpoint: B_{t-1} is all we know
  stepping_ = t;
  // Copy on write: views of earlier rounds keep their arrays.
  for (auto& ch : changed_)
    if (ch.use_count() > 1) ch = std::make_shared<std::vector<uint32_t>>(*ch);
}

void CatchupHistory::record_tensor(size_t i, const at::Tensor& before, const at::Tensor& after) {
  if (changed_.empty()) return;
  SPARROW_CHECK(stepping_ > 0 && i < changed_.size(), "CatchupHistory: record_tensor outside a step");
  const at::Tensor b = before.contiguous(), a = after.contiguous();
  SPARROW_CHECK(b.scalar_type() == at::kFloat && a.scalar_type() == at::kFloat && b.numel() == a.numel() &&
                    static_cast<size_t>(a.numel()) == changed_[i]->size(),
                "CatchupHistory: tensor " << i << " is not the model's fp32 tensor");
  const float* pb = b.data_ptr<float>();
  const float* pa = a.data_ptr<float>();
  uint32_t* c = changed_[i]->data();
  const auto t = static_cast<uint32_t>(stepping_);
  for (int64_t j = 0; j < a.numel(); ++j)
    if (!same_bits(pb[j], pa[j])) c[j] = t;
}

void CatchupHistory::end_step(std::vector<wire::NamedTensor> c) {
  SPARROW_CHECK(stepping_ > 0, "CatchupHistory: end_step without begin_step");
  auto st = std::make_shared<DownStep>();
  st->round = stepping_;
  std::vector<size_t> index;  // each tensor's position in the model (its name's index at most)
  for (const auto& nt : c) {
    st->bytes += wire::encoded_size(nt.tensor, nt.name);
    index.push_back(static_cast<size_t>(std::find(names_.begin(), names_.end(), nt.name) - names_.begin()));
  }
  st->packed_bytes = wire::packed_list_size(c, index);
  st->tensors = std::move(c);
  newest_ = st;
  round_ = stepping_;
  stepping_ = 0;
  if (policy_.chain()) {
    steps_.push_back(std::move(st));
    // Keep what a chain may span: at most max_steps, and no step that only
    // a chain larger than the dense model would carry.
    uint64_t bytes = 0;
    size_t keep = 0;
    for (auto it = steps_.rbegin(); it != steps_.rend() && keep < policy_.max_steps; ++it) {
      if (keep > 0 && bytes + (*it)->bytes >= full_bytes_) break;
      bytes += (*it)->bytes;
      ++keep;
    }
    steps_.erase(steps_.begin(), steps_.end() - static_cast<ptrdiff_t>(keep));
  } else {
    // The newest step alone: the one-step Delta.
    steps_.assign(1, std::move(st));
  }
}

uint64_t CatchupHistory::delta_bytes(uint16_t minor) const {
  if (!newest_) return 0;
  return minor >= wire::kPackedMinor ? packed_frame_ + newest_->packed_bytes : newest_->bytes;
}

std::shared_ptr<const CatchupView> CatchupHistory::view(uint64_t t, const Weights& b) const {
  auto v = std::make_shared<CatchupView>();
  v->policy_ = policy_;
  v->packed_frame_ = packed_frame_;
  v->round_ = t;
  v->full_bytes_ = full_bytes_;
  if (t != round_) {
    // A restart at B_t: nothing before it is known.
    v->known_from_ = t;
    return v;
  }
  v->known_from_ = known_from_;
  v->steps_ = steps_;
  if (!changed_.empty()) {
    v->names_ = names_;
    v->shapes_ = shapes_;
    for (size_t i = 0; i < names_.size(); ++i) {
      v->changed_.push_back(changed_[i]);
      v->values_.push_back(b.at(names_[i]).detach().to(at::kCPU, at::kFloat).contiguous().clone());
    }
  }
  return v;
}

}  // namespace sparrow::federation
