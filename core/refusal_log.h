#pragma once
// Refused CurveZMQ handshakes (keys not on the allow-list), aggregated for the
// log (docs/security.md, "Log rate limits").
//
// A peer can open connections with a fresh key each time; a line per key
// would let it write the log at its connection rate. RefusalLog turns
// refusals into at most one line per source address and period (the first
// refusal from an address is reported at once; the rest are counted and
// reported, with the number of distinct keys, when the period has passed),
// and at most `max_lines` lines per period in all, so many addresses cannot
// flood it either. Beyond `max_addresses` tracked addresses, new ones are
// counted together under the address "*". Counts are never dropped: a line
// held back by the global cap is written in a later period.
//
// Thread-safe (the ZAP thread notes, the I/O thread collects due lines).

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace sparrow::core {

class RefusalLog {
 public:
  using Clock = std::chrono::steady_clock;

  struct Line {
    std::string address;       // the peer's address as ZAP gives it, or "*" (addresses beyond the table)
    std::string key;           // the latest refused key from it
    uint64_t refused = 0;      // refused handshakes since the address's previous line
    uint64_t keys = 0;         // distinct keys among them, counted up to kMaxKeys
    bool keys_capped = false;  // more than kMaxKeys distinct keys
  };

  static constexpr size_t kMaxKeys = 1024;

  explicit RefusalLog(std::chrono::seconds period = std::chrono::seconds(60), size_t max_lines = 20,
                      size_t max_addresses = 4096);

  // Records one refusal; the line to write now, if this address has had no
  // line for a period and the global cap allows one.
  std::optional<Line> note(const std::string& address, const std::string& key, Clock::time_point now = Clock::now());

  // The lines whose period has passed (counts waiting since an address's
  // last line), within the global cap. Cheap when called often: it looks at
  // the table at most once a second.
  std::vector<Line> due(Clock::time_point now = Clock::now());

  // At shutdown: every count still waiting, period or not, in at most
  // max_lines + 1 lines (the addresses beyond max_lines summed under "*").
  std::vector<Line> drain();

  // The warning's text, the same in every program: `event=zap key=K
  // address=A admitted=0 refused_since_last_warning=N keys=M msg="..."`
  // (keys=M+ when capped), values printable().
  static std::string text(const Line& l);

 private:
  struct Entry {
    bool logged = false;  // a line was written for it (then `last` is its time)
    Clock::time_point last;
    uint64_t refused = 0;
    std::set<std::string> keys;
    bool keys_capped = false;
    std::string key;
  };
  void roll(Clock::time_point now);
  bool may_write(const Entry& e, Clock::time_point now) const;
  Line take(const std::string& address, Entry& e, Clock::time_point now);

  const std::chrono::seconds period_;
  const size_t max_lines_, max_addresses_;
  std::mutex mu_;
  std::map<std::string, Entry> entries_;
  Clock::time_point window_start_{};
  size_t lines_in_window_ = 0;
  std::optional<Clock::time_point> last_scan_;
};

}  // namespace sparrow::core
