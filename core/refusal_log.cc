#include "core/refusal_log.h"

#include "core/peer_text.h"

namespace sparrow::core {

RefusalLog::RefusalLog(std::chrono::seconds period, size_t max_lines, size_t max_addresses)
    : period_(period), max_lines_(max_lines), max_addresses_(max_addresses) {}

void RefusalLog::roll(Clock::time_point now) {
  if (lines_in_window_ == 0 || now - window_start_ >= period_) {
    window_start_ = now;
    lines_in_window_ = 0;
  }
}

bool RefusalLog::may_write(const Entry& e, Clock::time_point now) const {
  return e.refused > 0 && (!e.logged || now - e.last >= period_) && lines_in_window_ < max_lines_;
}

RefusalLog::Line RefusalLog::take(const std::string& address, Entry& e, Clock::time_point now) {
  Line l;
  l.address = address;
  l.key = std::move(e.key);
  l.refused = e.refused;
  l.keys = e.keys.size();
  l.keys_capped = e.keys_capped;
  e.key.clear();
  e.refused = 0;
  e.keys.clear();
  e.keys_capped = false;
  e.logged = true;
  e.last = now;
  ++lines_in_window_;
  return l;
}

std::optional<RefusalLog::Line> RefusalLog::note(const std::string& address, const std::string& key,
                                                 Clock::time_point now) {
  std::lock_guard<std::mutex> g(mu_);
  roll(now);
  auto it = entries_.find(address);
  if (it == entries_.end()) it = entries_.try_emplace(entries_.size() < max_addresses_ ? address : "*").first;
  Entry& e = it->second;
  ++e.refused;
  if (e.keys.size() < kMaxKeys)
    e.keys.insert(key);
  else if (!e.keys.count(key))
    e.keys_capped = true;
  e.key = key;
  if (!may_write(e, now)) return std::nullopt;
  return take(it->first, e, now);
}

std::vector<RefusalLog::Line> RefusalLog::due(Clock::time_point now) {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<Line> out;
  if (last_scan_ && now - *last_scan_ < std::chrono::seconds(1)) return out;
  last_scan_ = now;
  roll(now);
  for (auto it = entries_.begin(); it != entries_.end();) {
    Entry& e = it->second;
    if (may_write(e, now)) out.push_back(take(it->first, e, now));
    // Quiet for a period with nothing waiting: forgotten (its next refusal
    // is reported at once, as a new address's).
    if (e.refused == 0 && e.logged && now - e.last >= period_)
      it = entries_.erase(it);
    else
      ++it;
  }
  return out;
}

std::vector<RefusalLog::Line> RefusalLog::drain() {
  std::lock_guard<std::mutex> g(mu_);
  const Clock::time_point now = Clock::now();
  std::vector<Line> out;
  Line rest;
  rest.address = "*";
  for (auto& [address, e] : entries_) {
    if (e.refused == 0) continue;
    if (out.size() < max_lines_) {
      out.push_back(take(address, e, now));
      continue;
    }
    rest.refused += e.refused;
    rest.keys += e.keys.size();  // an upper bound: keys are counted per address
    rest.keys_capped = rest.keys_capped || e.keys_capped;
    rest.key = e.key;
    e.refused = 0;
  }
  if (rest.refused) out.push_back(std::move(rest));
  return out;
}

std::string RefusalLog::text(const Line& l) {
  return "event=zap key=" + printable(l.key) + " address=" + printable(l.address) +
         " admitted=0 refused_since_last_warning=" + std::to_string(l.refused) + " keys=" + std::to_string(l.keys) +
         (l.keys_capped ? "+" : "") + " msg=\"key not on the allow-list (one line per address and minute)\"";
}

}  // namespace sparrow::core
