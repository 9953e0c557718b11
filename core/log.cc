#include "core/log.h"

#include <spdlog/pattern_formatter.h>
#include <spdlog/spdlog.h>
#include <time.h>

#include <chrono>
#include <cstdio>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/json.h"

namespace sparrow::core {
namespace {

constexpr std::string_view kEvent = "event=";

bool key_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool key_char(char c) { return key_start(c) || (c >= '0' && c <= '9') || c == '.' || c == '-'; }

// Whether s[at..] is "KEY=" (the start of the next field after a quoted value).
bool key_at(std::string_view s, size_t at) {
  if (at >= s.size() || !key_start(s[at])) return false;
  while (at < s.size() && key_char(s[at])) ++at;
  return at < s.size() && s[at] == '=';
}

// A value JSON can hold as a number: -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?
bool json_number_text(std::string_view v) {
  size_t i = 0;
  auto digits = [&] {
    const size_t from = i;
    while (i < v.size() && v[i] >= '0' && v[i] <= '9') ++i;
    return i > from;
  };
  if (i < v.size() && v[i] == '-') ++i;
  if (i < v.size() && v[i] == '0') {
    ++i;
  } else if (!digits()) {
    return false;
  }
  if (i < v.size() && v[i] == '.') {
    ++i;
    if (!digits()) return false;
  }
  if (i < v.size() && (v[i] == 'e' || v[i] == 'E')) {
    ++i;
    if (i < v.size() && (v[i] == '+' || v[i] == '-')) ++i;
    if (!digits()) return false;
  }
  return i == v.size();
}

struct Field {
  std::string key, value;
  bool quoted = false;
};

// The fields of an event body, and its words that are not key=value.
std::vector<Field> parse_body(std::string_view s, std::string* words) {
  std::vector<Field> out;
  size_t i = 0;
  while (i < s.size()) {
    while (i < s.size() && s[i] == ' ') ++i;
    if (i >= s.size()) break;
    if (!key_at(s, i)) {  // a word
      const size_t end = std::min(s.find(' ', i), s.size());
      if (!words->empty()) *words += ' ';
      words->append(s.substr(i, end - i));
      i = end;
      continue;
    }
    const size_t eq = s.find('=', i);
    Field f;
    f.key = std::string(s.substr(i, eq - i));
    i = eq + 1;
    if (i < s.size() && s[i] == '"') {
      // Quoted: up to the '"' that ends the body or comes before " KEY=";
      // \" and \\ are a quote and a backslash, other backslashes are kept.
      f.quoted = true;
      ++i;
      while (i < s.size()) {
        const char c = s[i];
        if (c == '\\' && i + 1 < s.size() && (s[i + 1] == '"' || s[i + 1] == '\\')) {
          f.value += s[i + 1];
          i += 2;
          continue;
        }
        if (c == '"' && (i + 1 == s.size() || (s[i + 1] == ' ' && key_at(s, i + 2)))) {
          ++i;
          break;
        }
        f.value += c;
        ++i;
      }
    } else {
      const size_t end = std::min(s.find(' ', i), s.size());
      f.value = std::string(s.substr(i, end - i));
      i = end;
    }
    out.push_back(std::move(f));
  }
  return out;
}

std::string json_value(const Field& f) {
  if (!f.quoted && (json_number_text(f.value) || f.value == "true" || f.value == "false")) return f.value;
  // A number JSON cannot hold (a metric never measured) is null, as in the JSON summaries.
  if (!f.quoted && (f.value == "nan" || f.value == "-nan" || f.value == "inf" || f.value == "-inf")) return "null";
  return json_string(f.value);
}

std::string json_line(std::string_view ts, std::string_view offset, std::string_view level, std::string_view body) {
  std::string words;
  const std::vector<Field> fields = parse_body(body, &words);
  std::string out =
      "{\"ts\":" + json_string(std::string(ts) + std::string(offset)) + ",\"level\":" + json_string(std::string(level));
  std::vector<std::string> seen = {"ts", "level"};
  // The first field is the event (the body starts with it); a key that
  // repeats one already written gets a '_', so every key is unique.
  auto add = [&](std::string key, const std::string& value) {
    for (size_t k = 0; k < seen.size();) {
      if (seen[k] == key) {
        key += '_';
        k = 0;
      } else {
        ++k;
      }
    }
    out += "," + json_string(key) + ":" + value;
    seen.push_back(std::move(key));
  };
  bool has_msg = false;
  for (const Field& f : fields) {
    has_msg = has_msg || f.key == "msg";
    add(f.key, json_value(f));
  }
  if (!words.empty()) add(has_msg ? "text" : "msg", json_string(words));
  return out + "}\n";
}

// Local time with milliseconds, and the zone as +HH:MM.
std::pair<std::string, std::string> timestamp(spdlog::log_clock::time_point t) {
  const auto since = t.time_since_epoch();
  const time_t secs = static_cast<time_t>(std::chrono::duration_cast<std::chrono::seconds>(since).count());
  const int ms = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(since).count() % 1000);
  struct tm tm {};
  localtime_r(&secs, &tm);
  char buf[48];
  const size_t n = std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%S", &tm);
  std::snprintf(buf + n, sizeof buf - n, ".%03d", ms < 0 ? 0 : ms);
  char zone[16];
  std::string offset = "Z";
  if (std::strftime(zone, sizeof zone, "%z", &tm) == 5) offset = std::string(zone, 3) + ":" + std::string(zone + 3, 2);
  return {buf, offset};
}

class LineFormatter : public spdlog::formatter {
 public:
  explicit LineFormatter(LogFormat format) : format_(format) {}
  void format(const spdlog::details::log_msg& msg, spdlog::memory_buf_t& dest) override {
    const auto [ts, offset] = timestamp(msg.time);
    const auto level = spdlog::level::to_string_view(msg.level);
    const std::string line = format_log_line(ts, offset, std::string_view(level.data(), level.size()),
                                             std::string_view(msg.payload.data(), msg.payload.size()), format_);
    dest.append(line.data(), line.data() + line.size());
  }
  std::unique_ptr<spdlog::formatter> clone() const override { return std::make_unique<LineFormatter>(format_); }

 private:
  LogFormat format_;
};

}  // namespace

LogFormat parse_log_format(const std::string& name) {
  if (name == "text") return LogFormat::kText;
  if (name == "json") return LogFormat::kJson;
  throw ConfigError("--log-format must be text or json (got '" + name + "')");
}

std::string free_text_body(std::string_view text) {
  std::string out = "event=message msg=\"";
  for (const char ch : text) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += ch;
    } else if (c < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else {
      out += ch;  // UTF-8 passes through
    }
  }
  return out + "\"";
}

std::string format_log_line(std::string_view ts, std::string_view offset, std::string_view level, std::string_view body,
                            LogFormat format) {
  std::string wrapped;
  if (body.substr(0, kEvent.size()) != kEvent) {
    wrapped = free_text_body(body);
    body = wrapped;
  }
  if (format == LogFormat::kJson) return json_line(ts, offset, level, body);
  std::string out;
  out.reserve(ts.size() + level.size() + body.size() + 9);
  out.append(ts).append(" level=").append(level).append(" ").append(body).append("\n");
  return out;
}

void install_log_format(LogFormat format) { spdlog::set_formatter(std::make_unique<LineFormatter>(format)); }

}  // namespace sparrow::core
