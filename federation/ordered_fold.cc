// federation::OrderedFold: a round's updates summed in canonical client order.
#include "federation/ordered_fold.h"

#include <ATen/ATen.h>

#include <utility>

#include "core/error.h"
#include "wire/wire.h"

namespace sparrow::federation {

OrderedFold::OrderedFold(const aggregation::Aggregator& aggregator, aggregation::TensorShapes shapes, size_t slots,
                         int64_t budget_bytes)
    : aggregator_(aggregator),
      shapes_(std::move(shapes)),
      budget_(budget_bytes),
      acc_(aggregator.make_accumulator(shapes_)),
      scratch_(slots) {
  SPARROW_CHECK(slots >= 1, "OrderedFold: no slots");
}

OrderedFold::~OrderedFold() = default;

void OrderedFold::set_max_update_norm(double bound) {
  max_norm_ = bound;
  acc_.set_max_update_norm(bound);
  for (auto& s : scratch_)
    if (s) s->set_max_update_norm(bound);
}

void OrderedFold::open(std::vector<std::string> order, aggregation::ContextMap contexts, double clip) {
  std::lock_guard<std::mutex> g(mu_);
  pos_.clear();
  for (size_t i = 0; i < order.size(); ++i)
    SPARROW_CHECK(pos_.emplace(order[i], i).second, "OrderedFold: client '" << order[i] << "' twice in the order");
  order_ = std::move(order);
  state_.assign(order_.size(), State::kPending);
  held_.clear();
  held_.resize(order_.size());
  held_size_.assign(order_.size(), 0);
  next_ = 0;
  held_bytes_ = held_peak_ = 0;
  relaxed_ = budget_ <= 0;
  late_failures_.clear();
  contexts_ = std::move(contexts);
  clip_ = clip;
  acc_.reset(clip);
  for (auto& s : scratch_)  // a round's checks start from an empty scratch with its clip
    if (s) s->reset(clip);
  control_sum_.clear();
  metric_sum_.clear();
  metric_weight_.clear();
}

int64_t OrderedFold::bytes_of(const Arrival& a) {
  int64_t b = 0;
  for (const auto& [name, e] : a.update) b += static_cast<int64_t>(wire::encoded_size(e, name));
  for (const auto& [name, t] : a.control_delta) b += static_cast<int64_t>(t.numel() * t.element_size());
  return b;
}

void add_side_sums(const Arrival& a, std::map<std::string, at::Tensor>& control_sum,
                   std::map<std::string, double>& metric_sum, std::map<std::string, double>& metric_weight) {
  for (const auto& [k, d] : a.control_delta) {
    auto it = control_sum.find(k);
    if (it == control_sum.end())
      control_sum[k] = d.clone();
    else
      it->second.add_(d);
  }
  for (const auto& [k, v] : a.metrics) {
    metric_sum[k] += a.weight * v;
    metric_weight[k] += a.weight;
  }
}

void OrderedFold::fold_locked(const std::string& client, Arrival& a) {
  acc_.add(a.update, a.weight, contexts_, client);  // all or nothing: a refusal changes nothing
  add_side_sums(a, control_sum_, metric_sum_, metric_weight_);
}

void OrderedFold::advance_locked() {
  for (; next_ < state_.size() && state_[next_] != State::kPending; ++next_) {
    if (state_[next_] != State::kHeld) continue;
    Arrival a = std::move(*held_[next_]);
    held_[next_].reset();
    held_bytes_ -= held_size_[next_];
    state_[next_] = State::kDone;
    try {
      fold_locked(order_[next_], a);
    } catch (const std::exception&) {  // checked when it came: only an unchecked one, or memory
      late_failures_.push_back(order_[next_]);
    }
  }
}

void OrderedFold::flush_locked() {
  for (size_t i = next_; i < state_.size(); ++i) {
    if (state_[i] != State::kHeld) continue;
    Arrival a = std::move(*held_[i]);
    held_[i].reset();
    state_[i] = State::kDone;
    try {
      fold_locked(order_[i], a);
    } catch (const std::exception&) {
      late_failures_.push_back(order_[i]);
    }
  }
  held_bytes_ = 0;
}

void OrderedFold::add(size_t slot, const std::string& client, Arrival a, bool check) {
  SPARROW_CHECK(slot < scratch_.size(), "OrderedFold: slot " << slot << " of " << scratch_.size());
  size_t i = 0;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = pos_.find(client);
    SPARROW_CHECK(it != pos_.end(), "client '" << client << "' is not in this round");
    i = it->second;
    SPARROW_CHECK(state_[i] == State::kPending, "client '" << client << "' already sent this round");
    if (i == next_ || relaxed_) {
      fold_locked(client, a);
      state_[i] = State::kDone;
      advance_locked();
      return;
    }
  }
  if (check) {  // an early one: refused now exactly as its fold would refuse it
    auto& s = scratch_[slot];
    if (!s) {
      s = std::make_unique<aggregation::Accumulator>(aggregator_.make_accumulator(shapes_));
      if (max_norm_ > 0) s->set_max_update_norm(max_norm_);
      s->reset(clip_);
    }
    // The scratch's sums are never read: on the streaming path they are not
    // cleared between checks (a reset is a pass over the model's size, which
    // would cost more than checking a sparse update); a buffering rule keeps
    // a row per add, dropped at once.
    s->add(a.update, a.weight, contexts_);
    if (aggregator_.robust().buffers()) s->reset(clip_);
  }
  std::lock_guard<std::mutex> g(mu_);
  SPARROW_CHECK(state_[i] == State::kPending, "client '" << client << "' already sent this round");
  if (i == next_ || relaxed_) {  // its turn came while it was checked
    fold_locked(client, a);
    state_[i] = State::kDone;
    advance_locked();
    return;
  }
  const int64_t b = bytes_of(a);
  held_[i] = std::move(a);
  held_size_[i] = b;
  state_[i] = State::kHeld;
  held_bytes_ += b;
  held_peak_ = std::max(held_peak_, held_bytes_);
  if (held_bytes_ > budget_) {  // bounded memory first: the rest of the round in arrival order
    relaxed_ = true;
    flush_locked();
  }
}

void OrderedFold::skip(const std::string& client) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = pos_.find(client);
  if (it == pos_.end() || state_[it->second] != State::kPending) return;
  state_[it->second] = State::kDone;
  advance_locked();
}

void OrderedFold::close() {
  std::lock_guard<std::mutex> g(mu_);
  flush_locked();
  for (auto& s : state_) s = State::kDone;
  next_ = state_.size();
}

}  // namespace sparrow::federation
