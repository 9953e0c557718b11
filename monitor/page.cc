#include "monitor/page.h"

#include <algorithm>
#include <ctime>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/json.h"

namespace sparrow::monitor {

namespace assets {
extern const char kDashboardHtml[];
extern const char kDashboardJs[];
extern const char kChartJs[];
}  // namespace assets

namespace {

// The template with each marker's line replaced by its text. The markers are
// found in the template before anything is inserted, so inserted text (a
// user's config inside the static data) can never be taken for a marker.
std::string fill(const std::string& tpl, std::vector<std::pair<std::string, std::string>> parts) {
  struct Cut {
    size_t begin, end;
    const std::string* text;
  };
  std::vector<Cut> cuts;
  for (const auto& [marker, text] : parts) {
    const size_t at = tpl.find(marker);
    SPARROW_CHECK(at != std::string::npos, "dashboard.html has no " << marker << " line");
    const size_t begin = tpl.rfind('\n', at) + 1;  // npos + 1 = 0
    size_t end = tpl.find('\n', at);
    if (end == std::string::npos) end = tpl.size();
    cuts.push_back({begin, end, &text});
  }
  std::sort(cuts.begin(), cuts.end(), [](const Cut& a, const Cut& b) { return a.begin < b.begin; });
  std::string out;
  size_t pos = 0;
  for (const Cut& c : cuts) {
    out.append(tpl, pos, c.begin - pos);
    out += *c.text;
    pos = c.end;
  }
  out.append(tpl, pos, std::string::npos);
  return out;
}

// Inside a <script> element the text may not contain "</" (it would close the
// element) nor "<!--" (it changes how the element ends): every '<' is written
// as the JSON escape \u003c, which the JSON parser reads back as '<'. '<' only
// occurs inside JSON strings.
std::string script_safe(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    if (c == '<')
      out += "\\u003c";
    else
      out += c;
  }
  return out;
}

}  // namespace

std::string dashboard_page(const std::string& static_data) {
  return fill(assets::kDashboardHtml,
              {{"/*SPARROW_STATIC*/",
                static_data.empty() ? std::string() : "window.SPARROW_STATIC = " + script_safe(static_data) + ";"},
               {"/*SPARROW_CHARTJS*/", assets::kChartJs},
               {"/*SPARROW_APP*/", assets::kDashboardJs}});
}

std::string report_page(const std::vector<ReportRun>& runs) {
  char when[64];
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  std::strftime(when, sizeof when, "%Y-%m-%d %H:%M UTC", &tm);
  std::string json = "{\"generated\":" + json_string(when) + ",\"runs\":[";
  for (size_t i = 0; i < runs.size(); ++i) {
    const ReportRun& r = runs[i];
    json += (i ? "," : "");
    json += "{\"name\":" + json_string(r.name) + ",\"run\":" + Board::run_json(r.run, r.run.started) + ",\"rounds\":[";
    for (size_t k = 0; k < r.rounds.size(); ++k) json += (k ? "," : "") + Board::round_json(r.rounds[k]);
    // [[key, value], ...]: an array keeps the order.
    json += "],\"settings\":[";
    for (size_t k = 0; k < r.settings.size(); ++k)
      json += (k ? "," : "") + std::string("[") + json_string(r.settings[k].first) + "," +
              json_string(r.settings[k].second) + "]";
    json += "]}";
  }
  json += "]}";
  return dashboard_page(json);
}

}  // namespace sparrow::monitor
