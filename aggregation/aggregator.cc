#include "aggregation/aggregator.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>
#include <stdexcept>

#include "compression/codec_util.h"
#include "compression/lowrank.h"
#include "compression/update_norm.h"
#include "core/error.h"

namespace sparrow::aggregation {

namespace {

using compression::Context;
using compression::Encoded;
using compression::Format;

int g_fail_after = -1;  // detail::inject_add_failure_after

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// How one validated tensor of an update will be added.
struct Pending {
  // kFill: a dense fp32 tensor into an all-zero slot, finiteness checked while
  // it is written (compression::decode_fill).
  // kHold: the same, but its values are a view of a received frame: scanned,
  // then held by the slot (Slot::held) instead of copied.
  // kPair: a dense fp32 tensor into a slot that holds one: both written into
  // the sum in one pass (compression::decode_fill_pair), the new one scanned.
  enum Kind { kDecodeAdd, kScratch, kFactor, kFill, kHold, kPair } kind = kDecodeAdd;
  const std::string* name = nullptr;
  const Encoded* e = nullptr;
  Context ctx;
  at::Tensor scratch;  // kScratch: decode(e), unweighted
  at::Tensor factor;   // kFactor: the {k, r} factor, unweighted
  at::Tensor shared;   // kFactor: the shared factor it was taken against
  int which = -1;      // kFactor
  // A masked share with Context::share_mean: the mask entries it carried
  // (indices into ctx.mask), whose weights grow by the update's.
  bool shares = false;
  // Its decoded norm came out finite: every value is finite (a held dense
  // update then needs no second, finiteness-only read).
  bool measured = false;
  std::vector<int64_t> carried;
};

}  // namespace

namespace detail {
void inject_add_failure_after(int tensors) { g_fail_after = tensors; }

std::string norm_bound_text(double bound) {
  return bound < std::numeric_limits<float>::max() ? "max_update_norm = " + std::to_string(bound)
                                                   : std::string("float32's range (its product or decode overflows)");
}
}  // namespace detail

StreamingAggregator::StreamingAggregator(TensorShapes shapes)
    : shapes_(std::move(shapes)), max_norm_(std::numeric_limits<float>::max()) {
  for (const auto& [name, shape] : shapes_) {
    SPARROW_CHECK(!name.empty(), "StreamingAggregator: empty tensor name");
    SPARROW_CHECK(!slots_.count(name), "StreamingAggregator: duplicate tensor name '" << name << "'");
    for (int64_t d : shape) SPARROW_CHECK(d >= 0, "StreamingAggregator: '" << name << "' has a negative dimension");
    Slot s;
    s.shape = shape;
    s.sum = at::zeros(shape, at::TensorOptions().dtype(at::kFloat));
    slots_.emplace(name, std::move(s));
  }
}

StreamingAggregator::Slot& StreamingAggregator::slot(const std::string& name) {
  auto it = slots_.find(name);
  SPARROW_CHECK(it != slots_.end(), "StreamingAggregator: unknown tensor '" << name << "'");
  return it->second;
}

const StreamingAggregator::Slot& StreamingAggregator::slot(const std::string& name) const {
  auto it = slots_.find(name);
  SPARROW_CHECK(it != slots_.end(), "StreamingAggregator: unknown tensor '" << name << "'");
  return it->second;
}

void StreamingAggregator::set_max_update_norm(double bound) {
  SPARROW_CHECK(bound > 0, "aggregator: max_update_norm must be > 0, got " << bound);
  max_norm_ = std::min<double>(bound, std::numeric_limits<float>::max());
}

void StreamingAggregator::add(const EncodedUpdate& update, double weight, const ContextMap& contexts) {
  const float w = static_cast<float>(weight);  // NaN, inf and doubles beyond float's range fail as float
  SPARROW_CHECK(std::isfinite(w) && w > 0, "aggregator: weight must be finite and > 0 in float32, got " << weight);
  // ---- Phase 1: check everything; nothing below changes what the sums stand for
  // until phase 2 (settle() writes a held update into its sum: the same sum).
  std::set<std::string> seen;
  std::vector<Pending> pending;
  pending.reserve(update.size());
  const bool bounded = max_norm_ < std::numeric_limits<float>::max();
  const at::Tensor one = bounded ? at::ones({1, 1}, at::TensorOptions().dtype(at::kFloat)) : at::Tensor();
  double norm_sq = 0;
  for (const auto& [name, e] : update) {
    auto it = slots_.find(name);
    SPARROW_CHECK_T(FormatError, it != slots_.end(), "aggregator: unknown tensor '" << name << "' in update");
    SPARROW_CHECK_T(FormatError, seen.insert(name).second, "aggregator: tensor '" << name << "' sent twice");
    Slot& s = it->second;
    const bool dense_f32 = e.format == Format::kDense && e.value_type == compression::ValueType::kF32;
    const bool pair = s.held_weight > 0 && dense_f32;
    // A held update meets another kind: written into its sum first (the sum
    // the slot stands for does not change).
    if (!pair) settle(s);
    const bool fill = s.zero && s.held_weight == 0 && dense_f32;
    compression::validate(e, fill || pair ? compression::ValueCheck::kDeferDenseF32 : compression::ValueCheck::kScan);
    SPARROW_CHECK_T(
        FormatError, e.shape == s.shape,
        "aggregator: tensor '" << name << "' has shape " << shape_str(e.shape) << ", model has " << shape_str(s.shape));
    Pending p;
    p.name = &name;
    p.e = &e;
    auto cit = contexts.find(name);
    if (cit != contexts.end()) p.ctx = cit->second;
    if (p.ctx.name.empty()) p.ctx.name = name;

    if (e.format == Format::kLowRankFactor) {
      p.kind = Pending::kFactor;
      const int64_t rows = e.params[0], cols = e.params[1], r = e.params[2];
      p.which = static_cast<int>(e.params[3]);
      SPARROW_CHECK_T(FormatError, p.ctx.round < 0 || p.which == compression::acp_sent_factor(p.ctx.round),
                      "aggregator: tensor '" << name << "' carries factor " << (p.which == 0 ? "P" : "Q")
                                             << " but round " << p.ctx.round << " expects the other");
      const std::vector<int64_t> shared_shape = {p.which == 0 ? cols : rows, r};
      if (p.ctx.shared_factor.defined()) {
        const at::Tensor& sf = p.ctx.shared_factor;
        SPARROW_CHECK_T(FormatError,
                        sf.scalar_type() == at::kFloat && sf.device().is_cpu() && sf.sizes().equals(shared_shape),
                        "aggregator: shared factor of '" << name << "' is " << sf.sizes() << ", update needs "
                                                         << shape_str(shared_shape) << " float32");
        p.shared = sf.contiguous().clone();
      } else {
        p.shared = compression::acp_initial_factor(p.ctx, rows, cols, r, 1 - p.which);
      }
      if (s.which >= 0) {
        SPARROW_CHECK_T(
            FormatError,
            s.which == p.which && s.shared.sizes().equals(p.shared.sizes()) && at::equal(s.shared, p.shared),
            "aggregator: ACP update of '" << name
                                          << "' was taken against a different shared factor than "
                                             "earlier updates of this round");
      }
      p.factor = compression::acp_factor(e);
    } else if (compression::decodes_late(e.format)) {
      p.kind = Pending::kScratch;
      p.scratch = compression::decode(e, p.ctx);  // may throw FormatError; the sums are untouched
    } else if (e.format == Format::kSparse && e.index_coding == compression::IndexCoding::kMask) {
      // A masked update decodes only against this round's mask: checked here,
      // before anything is added, so a mismatch in a later tensor changes nothing.
      // (compression::check_mask's check, whose layout the share weights read.)
      const compression::detail::MaskLayout l = compression::detail::mask_layout_for(e, p.ctx);
      if (p.ctx.share_mean && l.m > 0) {
        // No mask in ctx: the update's mask is every position (tcs mask=all).
        if (!p.ctx.mask.defined()) p.ctx.mask = at::arange(e.numel(), at::TensorOptions().dtype(at::kLong));
        SPARROW_CHECK_T(FormatError,
                        !s.share_pos.defined() ||
                            (s.share_pos.numel() == static_cast<int64_t>(l.m) && at::equal(s.share_pos, p.ctx.mask)),
                        "aggregator: tensor '" << name << "' carries a share of another mask than this round's");
        p.shares = true;
        if (l.kept == l.m) {
          p.carried.resize(l.m);
          for (uint64_t j = 0; j < l.m; ++j) p.carried[j] = static_cast<int64_t>(j);
        } else {
          p.carried = compression::detail::seeded_indices(e.seed, l.kept, static_cast<int64_t>(l.m));
        }
      }
    }
    if (fill) p.kind = e.values.is_view() ? Pending::kHold : Pending::kFill;
    if (pair) p.kind = Pending::kPair;
    // Admission by norm (see add() in the header).
    double n = 0;
    bool computed = true;
    if (p.kind == Pending::kFactor)
      n = compression::lowrank_norm(p.factor, p.shared);
    else if (p.kind == Pending::kScratch && bounded)
      n = compression::lowrank_norm(p.scratch.reshape({-1, 1}), one);
    else if (e.format == Format::kLowRank || e.format == Format::kLowRankSparse || bounded)
      n = compression::decoded_norm(e, p.ctx);
    else
      computed = false;
    // A dense value that is not finite is the NonFiniteError the value scan
    // would have thrown (wire::parse deferred it); a product that overflows
    // is refused below with the norm.
    if (e.format == Format::kDense && std::isinf(n))
      throw compression::NonFiniteError("aggregator: tensor '" + name + "' has a value that is not finite");
    p.measured = computed && std::isfinite(n);
    norm_sq += n * n;
    pending.push_back(std::move(p));
  }
  for (const auto& [name, s] : slots_) {
    SPARROW_CHECK_T(FormatError, seen.count(name), "aggregator: update lacks tensor '" << name << "'");
  }
  const double norm = std::sqrt(norm_sq);
  SPARROW_CHECK_T(FormatError, std::isfinite(norm), "update decodes to a value that is not finite");
  SPARROW_CHECK_T(FormatError, norm <= max_norm_,
                  "update norm " << norm << " exceeds " << detail::norm_bound_text(max_norm_));

  // ---- Phase 2a: fills and holds, which may still find a non-finite value:
  // one throws with its slot zero again, and the fills and holds before it are
  // undone, exactly.
  std::vector<size_t> filled;
  filled.reserve(pending.size());  // push_back after a fill cannot throw
  auto undo_fills = [&] {
    for (size_t i : filled) {
      Slot& s = slots_.at(*pending[i].name);
      if (pending[i].kind == Pending::kHold) {
        s.held = Encoded();
        s.held_weight = 0;
      } else {
        s.sum.zero_();  // kFill, and kPair (whose held one stays held)
      }
    }
  };
  try {
    for (size_t i = 0; i < pending.size(); ++i) {
      const Pending& p = pending[i];
      Slot& s = slots_.at(*p.name);
      if (p.kind == Pending::kFill) {
        compression::decode_fill(*p.e, s.sum, w, p.ctx);
      } else if (p.kind == Pending::kHold) {
        if (!p.measured) compression::validate(*p.e);  // the finiteness scan; read only
        s.held = *p.e;                                 // a view: the frame stays alive, nothing is copied
        s.held_weight = w;
      } else if (p.kind == Pending::kPair) {
        compression::decode_fill_pair(s.held, s.held_weight, *p.e, w, s.sum);  // released once all succeed
      } else {
        continue;
      }
      filled.push_back(i);
    }
  } catch (...) {
    undo_fills();
    throw;
  }

  // ---- Phase 2b: add. After phase 1 only resource exhaustion should throw here;
  // if anything does, what this update already added is taken back out.
  size_t done = 0;
  std::vector<bool> created(pending.size(), false), shares_created(pending.size(), false);
  auto add_shares = [&](const Pending& p, Slot& s, double sign, size_t i) {
    if (!p.shares) return;
    if (sign > 0 && s.share_w.empty()) {
      s.share_w.assign(static_cast<size_t>(p.ctx.mask.numel()), 0.0);
      s.share_pos = p.ctx.mask.clone();
      shares_created[i] = true;
    } else if (sign < 0 && shares_created[i]) {
      s.share_w.clear();
      s.share_pos = at::Tensor();
      return;
    }
    for (const int64_t j : p.carried) s.share_w[static_cast<size_t>(j)] += sign * static_cast<double>(w);
  };
  try {
    for (; done < pending.size(); ++done) {
      if (g_fail_after >= 0 && done == static_cast<size_t>(g_fail_after)) {
        g_fail_after = -1;
        throw std::runtime_error("aggregator: injected failure");
      }
      Pending& p = pending[done];
      Slot& s = slots_.at(*p.name);
      switch (p.kind) {
        case Pending::kFill:
        case Pending::kHold:
        case Pending::kPair:
          break;
        case Pending::kDecodeAdd:
          compression::decode_add(*p.e, s.sum, w, p.ctx);
          add_shares(p, s, 1.0, done);
          break;
        case Pending::kScratch:
          s.sum.add_(p.scratch, w);
          break;
        case Pending::kFactor:
          if (s.which < 0) {
            s.factor_sum = p.factor * w;
            s.shared = p.shared;
            s.which = p.which;
            created[done] = true;
          } else {
            s.factor_sum.add_(p.factor, w);
          }
          break;
      }
    }
  } catch (...) {
    undo_fills();
    for (size_t i = 0; i < done; ++i) {
      Pending& p = pending[i];
      Slot& s = slots_.at(*p.name);
      switch (p.kind) {
        case Pending::kFill:
        case Pending::kHold:
        case Pending::kPair:
          break;
        case Pending::kDecodeAdd:
          compression::decode_add(*p.e, s.sum, -w, p.ctx);
          add_shares(p, s, -1.0, i);
          break;
        case Pending::kScratch:
          s.sum.sub_(p.scratch, w);
          break;
        case Pending::kFactor:
          if (created[i]) {
            s.factor_sum = at::Tensor();
            s.shared = at::Tensor();
            s.which = -1;
          } else {
            s.factor_sum.sub_(p.factor, w);
          }
          break;
      }
    }
    throw;
  }
  for (const Pending& p : pending) {
    Slot& s = slots_.at(*p.name);
    if (p.kind == Pending::kPair) {
      s.held = Encoded();
      s.held_weight = 0;
    }
    if (p.kind != Pending::kFactor && p.kind != Pending::kHold) s.zero = false;
  }
  total_weight_ += weight;
  ++count_;
}

void StreamingAggregator::settle(Slot& s) {
  if (s.held_weight == 0) return;
  compression::decode_fill(s.held, s.sum, s.held_weight);  // scanned already: a plain write
  s.zero = false;
  s.held = Encoded();
  s.held_weight = 0;
}

void StreamingAggregator::merge(const StreamingAggregator& partial) {
  SPARROW_CHECK(&partial != this, "aggregator merge: an aggregator cannot merge itself");
  SPARROW_CHECK(partial.slots_.size() == slots_.size(), "aggregator merge: partial has a different tensor list");
  for (const auto& [name, ps] : partial.slots_) {
    auto it = slots_.find(name);
    SPARROW_CHECK(it != slots_.end(), "aggregator merge: partial has unknown tensor '" << name << "'");
    const Slot& s = it->second;
    SPARROW_CHECK(s.shape == ps.shape, "aggregator merge: tensor '" << name << "' has shape " << shape_str(ps.shape)
                                                                    << ", expected " << shape_str(s.shape));
    if (s.which >= 0 && ps.which >= 0) {
      SPARROW_CHECK(s.which == ps.which && s.shared.sizes().equals(ps.shared.sizes()) && at::equal(s.shared, ps.shared),
                    "aggregator merge: ACP factors of '" << name << "' were taken against different shared factors");
    }
    if (!s.share_w.empty() && !ps.share_w.empty()) {
      SPARROW_CHECK(s.share_pos.numel() == ps.share_pos.numel() && at::equal(s.share_pos, ps.share_pos),
                    "aggregator merge: shares of '" << name << "' were taken over different masks");
    }
  }
  for (auto& [name, s] : slots_) {
    const Slot& ps = partial.slots_.at(name);
    if (ps.held_weight > 0) {
      if (s.zero && s.held_weight == 0) {  // share the view: still nothing copied
        s.held = ps.held;
        s.held_weight = ps.held_weight;
      } else {
        settle(s);
        compression::decode_add(ps.held, s.sum, ps.held_weight);
        s.zero = false;
      }
    }
    if (!ps.zero) {
      settle(s);
      s.sum.add_(ps.sum);
      s.zero = false;
    }
    if (!ps.share_w.empty()) {
      if (s.share_w.empty()) {
        s.share_w = ps.share_w;
        s.share_pos = ps.share_pos;
      } else {
        for (size_t j = 0; j < s.share_w.size(); ++j) s.share_w[j] += ps.share_w[j];
      }
    }
    if (ps.which < 0) continue;
    if (s.which < 0) {
      s.factor_sum = ps.factor_sum.clone();
      s.shared = ps.shared;
      s.which = ps.which;
    } else {
      s.factor_sum.add_(ps.factor_sum);
    }
  }
  total_weight_ += partial.total_weight_;
  count_ += partial.count_;
}

std::map<std::string, at::Tensor> StreamingAggregator::mean() const {
  SPARROW_CHECK(total_weight_ > 0, "aggregator: mean() of an empty aggregate (total weight 0)");
  const float inv = static_cast<float>(1.0 / total_weight_);
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, s] : slots_) {
    at::Tensor m;
    if (s.held_weight > 0) {  // (v·w)·inv, rounded as the written sum would be
      m = at::empty(s.shape, at::TensorOptions().dtype(at::kFloat));
      compression::decode_fill(s.held, m, s.held_weight);
      m.mul_(inv);
    } else {
      m = s.sum * inv;
    }
    if (s.which >= 0) compression::acp_update_add(s.factor_sum * inv, s.shared, s.which, m, 1.0f);
    if (!s.share_w.empty()) {  // m = sum / W there: sum / (the weight that carried the position)
      float* mp = m.data_ptr<float>();
      const int64_t* pos = s.share_pos.data_ptr<int64_t>();
      for (size_t j = 0; j < s.share_w.size(); ++j)
        if (s.share_w[j] > 0) mp[pos[j]] = static_cast<float>(mp[pos[j]] * (total_weight_ / s.share_w[j]));
    }
    out.emplace(name, std::move(m));
  }
  return out;
}

at::Tensor StreamingAggregator::factor_mean(const std::string& name) const {
  const Slot& s = slot(name);
  SPARROW_CHECK(total_weight_ > 0, "aggregator: factor_mean() of an empty aggregate (total weight 0)");
  if (s.which < 0) return at::Tensor();
  return s.factor_sum * static_cast<float>(1.0 / total_weight_);
}

void StreamingAggregator::reset() {
  for (auto& [name, s] : slots_) {
    if (!s.zero) s.sum.zero_();
    s.zero = true;
    s.held = Encoded();  // releases the frame it viewed
    s.held_weight = 0;
    s.factor_sum = at::Tensor();
    s.shared = at::Tensor();
    s.which = -1;
    s.share_pos = at::Tensor();
    s.share_w.clear();
  }
  total_weight_ = 0.0;
  count_ = 0;
}

}  // namespace sparrow::aggregation
