#pragma once
// The dashboard page (monitor/assets/dashboard.html + dashboard.js) with
// Chart.js inlined: one self-contained HTML document, no network at run time.
//
// Live mode (static_data empty): the page polls the endpoint's /api/* on the
// origin it was loaded from. Report mode: the page shows the runs in
// static_data, a JSON object {"generated":..., "runs":[{"name", "run", "rounds",
// "settings"}]}
// (docs/monitoring.md), and fetches nothing.

#include <string>
#include <utility>
#include <vector>

#include "monitor/board.h"

namespace sparrow::monitor {

std::string dashboard_page(const std::string& static_data = "");

// One run of a report: its name (the run folder's name), identity and rounds.
struct ReportRun {
  std::string name;
  RunInfo run;
  std::vector<RoundPoint> rounds;
  // The settings its row in the runs table shows, in order: what compresses
  // each way, then the config keys in which the report's runs differ.
  std::vector<std::pair<std::string, std::string>> settings;
};
// The report-mode page for `runs` (the first is the main run).
std::string report_page(const std::vector<ReportRun>& runs);

}  // namespace sparrow::monitor
