#include "simulator/report.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "core/error.h"
#include "monitor/page.h"
#include "simulator/config.h"

namespace sparrow::simulator {
namespace fs = std::filesystem;
using report_detail::Tick;

namespace {

constexpr const char* kMetricsFile = "metrics.csv";
constexpr const char* kColumns[] = {"round",      "accuracy",    "loss",   "train_loss", "bytes_up",
                                    "bytes_down", "sim_round_s", "real_s", "clients",    "dropped"};

std::string trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t\r");
  if (b == std::string::npos) return "";
  size_t e = s.find_last_not_of(" \t\r");
  return s.substr(b, e - b + 1);
}

std::vector<std::string> split_csv(const std::string& line) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : line) {
    if (c == ',') {
      out.push_back(trim(cur));
      cur.clear();
    } else {
      cur += c;
    }
  }
  out.push_back(trim(cur));
  return out;
}

// Where a CSV problem is: "path:line: ".
std::string at(const std::string& path, size_t line) { return path + ":" + std::to_string(line) + ": "; }

// Parses one cell. Empty cells are allowed only where `optional`; non-finite
// values only where `allow_nonfinite`. Returns false for an allowed empty cell.
bool parse_cell(const std::string& path, size_t line, const std::string& column, const std::string& cell, bool optional,
                bool allow_nonfinite, double* out) {
  if (cell.empty()) {
    SPARROW_CHECK_T(FormatError, optional, at(path, line) << "empty value in column '" << column << "'");
    return false;
  }
  errno = 0;
  char* end = nullptr;
  double v = std::strtod(cell.c_str(), &end);
  SPARROW_CHECK_T(FormatError, end == cell.c_str() + cell.size() && errno != ERANGE,
                  at(path, line) << "bad number '" << cell << "' in column '" << column << "'");
  SPARROW_CHECK_T(FormatError, allow_nonfinite || std::isfinite(v),
                  at(path, line) << "non-finite value '" << cell << "' in column '" << column << "'");
  *out = v;
  return true;
}

// The label of a run: the name of its folder (also for "runs/a/" and ".").
std::string run_label(const std::string& run_dir) {
  fs::path p = fs::absolute(fs::path(run_dir)).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  std::string name = p.filename().string();
  return name.empty() ? run_dir : name;
}

// ---- drawing -------------------------------------------------------------

constexpr double kWidth = 860, kHeight = 520;
constexpr double kLeft = 80, kRight = 640, kTop = 50, kBottom = 450;  // plot area
constexpr const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e",
                                   "#9467bd", "#8c564b", "#e377c2", "#17becf"};

constexpr const char* kDashed = "6 4";  // e.g. the training loss next to the test loss; downlink bytes
constexpr const char* kDotted = "2 3";  // total bytes

struct Series {
  std::string label;
  std::vector<std::pair<double, double>> points;  // (x, y): evaluated rounds only for accuracy and test loss
  std::string dash;                               // SVG stroke-dasharray; "" = solid
  int color = -1;                                 // index into kColors; -1 = the series' position
};

struct PlotSpec {
  std::string title, x_label, y_label;
  bool log_x = false;
  std::vector<Series> series;
  bool fraction = true;  // y in [0, 1] (accuracy): the axis never leaves it
  bool bytes_y = false;  // y is a byte count: ticks labelled "2 MB"
  bool whole_x = true;   // a linear x in whole steps (rounds); false for seconds
};

// The y axis around the data (a 6% margin), not 0..1 whatever the data: a run
// between 70% and 85% fills the plot. Never below 0 for non-negative data,
// never above 1 for fractions.
std::pair<double, double> y_range(double ymin, double ymax, bool fraction) {
  const double pad = std::max((ymax - ymin) * 0.06, fraction ? 0.01 : std::max(1e-3, std::abs(ymax) * 0.05));
  double lo = ymin - pad, hi = ymax + pad;
  if (ymin >= 0) lo = std::max(0.0, lo);
  if (fraction && ymax <= 1) hi = std::min(1.0, hi);  // percentages (> 1) keep their own scale
  if (!(lo < hi)) hi = lo + 1;
  return {lo, hi};
}

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f", v);
  return buf;
}

std::string render(const PlotSpec& spec) {
  using namespace report_detail;
  // Data ranges over every run's points.
  double xmin = INFINITY, xmax = -INFINITY, ymin = INFINITY, ymax = -INFINITY;
  for (const Series& s : spec.series) {
    for (auto [x, y] : s.points) {
      xmin = std::min(xmin, x), xmax = std::max(xmax, x);
      ymin = std::min(ymin, y), ymax = std::max(ymax, y);
    }
  }
  bool empty = !(xmin <= xmax);
  std::vector<Tick> xt;
  if (spec.log_x) {
    xt = empty ? log_byte_ticks(1e3, 1e6) : log_byte_ticks(xmin, xmax);
  } else {
    // Rounds (or seconds): start the axis at 0 (or below, for odd data); rounds step by whole numbers.
    const double min_step = spec.whole_x ? 1 : 0;
    xt = empty ? linear_ticks(0, 1, 6, min_step) : linear_ticks(std::min(0.0, xmin), xmax, 6, min_step);
  }
  std::vector<Tick> yt;
  if (empty) {
    yt = linear_ticks(0, 1);
  } else {
    const auto [lo, hi] = y_range(ymin, ymax, spec.fraction);
    yt = linear_ticks(lo, hi);
  }
  if (spec.bytes_y)
    for (Tick& t : yt) t.label = format_bytes(t.value);
  double x0 = xt.front().value, x1 = xt.back().value, y0 = yt.front().value, y1 = yt.back().value;
  auto fx = [&](double x) {
    double t = spec.log_x ? (std::log10(x) - std::log10(x0)) / (std::log10(x1) - std::log10(x0)) : (x - x0) / (x1 - x0);
    return kLeft + t * (kRight - kLeft);
  };
  auto fy = [&](double y) { return kBottom - (y - y0) / (y1 - y0) * (kBottom - kTop); };

  std::ostringstream o;
  o << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
    << "<svg xmlns=\"http://www.w3.org/2000/svg\" version=\"1.1\" width=\"" << kWidth << "\" height=\"" << kHeight
    << "\" viewBox=\"0 0 " << kWidth << " " << kHeight << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
    << "<rect width=\"" << kWidth << "\" height=\"" << kHeight << "\" fill=\"white\"/>\n"
    << "<text class=\"title\" x=\"" << num((kLeft + kRight) / 2) << "\" y=\"30\" text-anchor=\"middle\" "
    << "font-size=\"16\" font-weight=\"bold\">" << xml_escape(spec.title) << "</text>\n";

  // Gridlines, then ticks and tick labels.
  o << "<g class=\"grid\" stroke=\"#dddddd\" stroke-width=\"1\">\n";
  for (const Tick& t : xt) {
    o << "<line x1=\"" << num(fx(t.value)) << "\" y1=\"" << num(kTop) << "\" x2=\"" << num(fx(t.value)) << "\" y2=\""
      << num(kBottom) << "\"/>\n";
  }
  for (const Tick& t : yt) {
    o << "<line x1=\"" << num(kLeft) << "\" y1=\"" << num(fy(t.value)) << "\" x2=\"" << num(kRight) << "\" y2=\""
      << num(fy(t.value)) << "\"/>\n";
  }
  o << "</g>\n";
  o << "<rect class=\"frame\" x=\"" << num(kLeft) << "\" y=\"" << num(kTop) << "\" width=\"" << num(kRight - kLeft)
    << "\" height=\"" << num(kBottom - kTop) << "\" fill=\"none\" stroke=\"black\"/>\n";
  o << "<g class=\"x-ticks\" stroke=\"black\">\n";
  for (const Tick& t : xt) {
    o << "<line x1=\"" << num(fx(t.value)) << "\" y1=\"" << num(kBottom) << "\" x2=\"" << num(fx(t.value)) << "\" y2=\""
      << num(kBottom + 5) << "\"/>\n"
      << "<text x=\"" << num(fx(t.value)) << "\" y=\"" << num(kBottom + 19)
      << "\" stroke=\"none\" text-anchor=\"middle\">" << xml_escape(t.label) << "</text>\n";
  }
  o << "</g>\n<g class=\"y-ticks\" stroke=\"black\">\n";
  for (const Tick& t : yt) {
    o << "<line x1=\"" << num(kLeft - 5) << "\" y1=\"" << num(fy(t.value)) << "\" x2=\"" << num(kLeft) << "\" y2=\""
      << num(fy(t.value)) << "\"/>\n"
      << "<text x=\"" << num(kLeft - 8) << "\" y=\"" << num(fy(t.value) + 4)
      << "\" stroke=\"none\" text-anchor=\"end\">" << xml_escape(t.label) << "</text>\n";
  }
  o << "</g>\n";
  o << "<text class=\"x-label\" x=\"" << num((kLeft + kRight) / 2) << "\" y=\"" << num(kBottom + 42)
    << "\" text-anchor=\"middle\" font-size=\"13\">" << xml_escape(spec.x_label) << "</text>\n";
  double ly = (kTop + kBottom) / 2;
  o << "<text class=\"y-label\" x=\"25\" y=\"" << num(ly) << "\" transform=\"rotate(-90 25 " << num(ly)
    << ")\" text-anchor=\"middle\" font-size=\"13\">" << xml_escape(spec.y_label) << "</text>\n";

  // One polyline per run, a marker per evaluated point.
  for (size_t i = 0; i < spec.series.size(); ++i) {
    const Series& s = spec.series[i];
    const size_t ci = s.color >= 0 ? static_cast<size_t>(s.color) : i;
    const char* color = kColors[ci % (sizeof(kColors) / sizeof(kColors[0]))];
    o << "<g class=\"series\">\n<polyline class=\"run\" fill=\"none\" stroke=\"" << color << "\" stroke-width=\"2\""
      << (s.dash.empty() ? "" : " stroke-dasharray=\"" + s.dash + "\"") << " points=\"";
    for (size_t k = 0; k < s.points.size(); ++k) {
      o << (k ? " " : "") << num(fx(s.points[k].first)) << "," << num(fy(s.points[k].second));
    }
    o << "\"/>\n";
    for (auto [x, y] : s.points) {
      o << "<circle cx=\"" << num(fx(x)) << "\" cy=\"" << num(fy(y)) << "\" r=\"3\" fill=\"" << color << "\"/>\n";
    }
    o << "</g>\n";
  }

  // Legend to the right of the plot area.
  o << "<g class=\"legend\">\n";
  for (size_t i = 0; i < spec.series.size(); ++i) {
    const Series& s = spec.series[i];
    const size_t ci = s.color >= 0 ? static_cast<size_t>(s.color) : i;
    const char* color = kColors[ci % (sizeof(kColors) / sizeof(kColors[0]))];
    double y = kTop + 10 + 20 * static_cast<double>(i);
    std::string label = s.label;
    if (label.size() > 24) {
      size_t cut = 23;  // never split a UTF-8 sequence: the SVG must stay valid
      while (cut > 0 && (static_cast<unsigned char>(label[cut]) & 0xC0) == 0x80) --cut;
      label = label.substr(0, cut) + "~";
    }
    if (s.points.empty()) label += " (no data)";
    o << "<g class=\"legend-entry\">"
      << "<line x1=\"" << num(kRight + 15) << "\" y1=\"" << num(y) << "\" x2=\"" << num(kRight + 40) << "\" y2=\""
      << num(y) << "\" stroke=\"" << color << "\" stroke-width=\"2\""
      << (s.dash.empty() ? "" : " stroke-dasharray=\"" + s.dash + "\"") << "/>"
      << "<circle cx=\"" << num(kRight + 27.5) << "\" cy=\"" << num(y) << "\" r=\"3\" fill=\"" << color << "\"/>"
      << "<text x=\"" << num(kRight + 46) << "\" y=\"" << num(y + 4) << "\">" << xml_escape(label) << "</text></g>\n";
  }
  o << "</g>\n</svg>\n";
  return o.str();
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << text;
  f.flush();
  if (!f) throw Error("cannot write " + path);
}

}  // namespace

std::vector<MetricsRow> read_metrics(const std::string& run_dir) {
  const std::string path = (fs::path(run_dir) / kMetricsFile).string();
  std::error_code ec;
  SPARROW_CHECK_T(ConfigError, fs::is_regular_file(path, ec),
                  "no metrics.csv in run folder '" << run_dir << "' (looked for " << path << ")");
  std::ifstream f(path, std::ios::binary);
  SPARROW_CHECK_T(ConfigError, f.good(), "cannot open " << path);

  std::string line;
  SPARROW_CHECK_T(FormatError, std::getline(f, line) && !trim(line).empty(), at(path, 1) << "empty file, no header");
  std::vector<std::string> header = split_csv(line);
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < header.size(); ++i) {
    SPARROW_CHECK_T(FormatError, index.emplace(header[i], i).second,
                    at(path, 1) << "duplicate column '" << header[i] << "'");
  }
  std::vector<size_t> col;
  for (const char* name : kColumns) {
    auto it = index.find(name);
    SPARROW_CHECK_T(FormatError, it != index.end(), at(path, 1) << "header lacks column '" << name << "'");
    col.push_back(it->second);
  }

  const size_t eps_col = index.count("epsilon") ? index.at("epsilon") : header.size();  // optional column
  std::vector<MetricsRow> rows;
  for (size_t line_no = 2; std::getline(f, line); ++line_no) {
    if (trim(line).empty()) continue;
    std::vector<std::string> cells = split_csv(line);
    SPARROW_CHECK_T(FormatError, cells.size() == header.size(),
                    at(path, line_no) << "expected " << header.size() << " fields, found " << cells.size());
    MetricsRow r;
    auto cell = [&](size_t k, bool optional, bool nonfinite, double* out) {
      return parse_cell(path, line_no, kColumns[k], cells[col[k]], optional, nonfinite, out);
    };
    cell(0, false, false, &r.round);
    r.has_accuracy = cell(1, true, false, &r.accuracy);
    r.has_loss = cell(2, true, true, &r.loss);
    cell(3, false, true, &r.train_loss);
    cell(4, false, false, &r.bytes_up);
    cell(5, false, false, &r.bytes_down);
    cell(6, false, false, &r.sim_round_s);
    cell(7, false, false, &r.real_s);
    cell(8, false, false, &r.clients);
    cell(9, false, false, &r.dropped);
    r.epsilon = NAN;
    if (eps_col != header.size() && !parse_cell(path, line_no, "epsilon", cells[eps_col], true, true, &r.epsilon))
      r.epsilon = NAN;
    SPARROW_CHECK_T(FormatError, r.bytes_up >= 0 && r.bytes_down >= 0, at(path, line_no) << "negative byte count");
    SPARROW_CHECK_T(FormatError, r.sim_round_s >= 0, at(path, line_no) << "negative sim_round_s");
    rows.push_back(r);
  }
  SPARROW_CHECK_T(FormatError, !f.bad(), path << ": read error");
  return rows;
}

namespace {

// The keys of a run's config.toml (as to_toml writes it: `key = value` lines,
// the [profiles] table as "profiles.key") in file order, values as written
// with a string's quotes taken off. Empty when the file is missing.
std::vector<std::pair<std::string, std::string>> config_keys(const std::string& text) {
  std::vector<std::pair<std::string, std::string>> out;
  std::istringstream in(text);
  std::string prefix;
  for (std::string line; std::getline(in, line);) {
    line = trim(line);
    if (line.empty() || line[0] == '#') continue;
    if (line[0] == '[') {
      prefix = trim(line.substr(1, line.find(']') - 1)) + ".";
      continue;
    }
    const size_t eq = line.find('=');
    if (eq == std::string::npos) continue;
    std::string value = trim(line.substr(eq + 1));
    if (value.size() >= 2 && value.front() == '"' && value.back() == '"') value = value.substr(1, value.size() - 2);
    out.emplace_back(prefix + trim(line.substr(0, eq)), value);
  }
  return out;
}

// The keys whose values differ between the runs (a key one run lacks differs),
// in the first run's order; `out` (the folder) always differs and is left out.
std::vector<std::string> differing_keys(const std::vector<std::vector<std::pair<std::string, std::string>>>& cfgs) {
  std::vector<std::string> order;
  std::vector<std::map<std::string, std::string>> maps;
  for (const auto& c : cfgs) {
    maps.emplace_back(c.begin(), c.end());
    for (const auto& kv : c)
      if (std::find(order.begin(), order.end(), kv.first) == order.end()) order.push_back(kv.first);
  }
  std::vector<std::string> out;
  for (const std::string& key : order) {
    if (key == "out") continue;
    const auto value = [&](const std::map<std::string, std::string>& m) {
      const auto it = m.find(key);
      return it == m.end() ? std::string("\x01missing") : it->second;
    };
    for (const auto& m : maps)
      if (value(m) != value(maps.front())) {
        out.push_back(key);
        break;
      }
  }
  return out;
}

// A run's value of `key`, "?" where its config does not say.
std::string setting(const std::vector<std::pair<std::string, std::string>>& cfg, const std::string& key) {
  for (const auto& kv : cfg)
    if (kv.first == key) return kv.second;
  return "?";
}

// The columns every runs table has besides the byte totals: what compresses
// each way.
constexpr const char* kMethodKeys[] = {"compression", "downlink"};

// One run of the tables: its label, totals, and the settings shown.
struct RunRow {
  std::string name;
  size_t rounds = 0;
  double final_accuracy = NAN, best_accuracy = NAN;
  double up = 0, down = 0;
  double sim_s = 0;                                           // the simulated seconds of every row
  std::vector<std::pair<double, double>> by_time;             // (simulated seconds so far, accuracy) per evaluation
  double reach_s = NAN;                                       // when the first run's final accuracy was reached
  std::vector<std::pair<std::string, std::string>> settings;  // compression, downlink, then the differing keys
};

// The simulated time of the first evaluation at or above `target` (NaN: never,
// or no target). Ties to the first crossing, not a smoothed curve: what a user
// watching the run would have seen.
double time_to_reach(const std::vector<std::pair<double, double>>& by_time, double target) {
  if (std::isnan(target)) return NAN;
  for (const auto& [t, acc] : by_time)
    if (acc >= target) return t;
  return NAN;
}

std::string seconds(double v) {
  if (std::isnan(v)) return "-";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", v);
  return buf;
}

std::string percent(double v) {
  if (std::isnan(v)) return "-";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f%%", 100 * v);
  return buf;
}

// runs.md: the runs side by side, the keys in which they differ last.
std::string runs_markdown(const std::vector<RunRow>& rows, const std::vector<std::string>& differing) {
  using report_detail::format_bytes;
  auto cell = [](std::string v) {  // a Markdown table cell: no '|' or newline
    for (char& ch : v)
      if (ch == '|' || ch == '\n') ch = ' ';
    return v;
  };
  const double target = rows.empty() ? NAN : rows.front().final_accuracy;
  std::ostringstream o;
  o << "| run | compression | downlink | rounds | final accuracy | best accuracy | uplink | downlink bytes | "
       "total bytes | simulated s | simulated s to "
    << (std::isnan(target) ? std::string("the first run's final accuracy") : percent(target))
    << " | differing settings |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  for (const RunRow& r : rows) {
    std::string diff;
    for (size_t i = 2; i < r.settings.size(); ++i)
      diff += (diff.empty() ? "" : ", ") + r.settings[i].first + " = " + r.settings[i].second;
    o << "| " << cell(r.name) << " | `" << cell(r.settings[0].second) << "` | `" << cell(r.settings[1].second) << "` | "
      << r.rounds << " | " << percent(r.final_accuracy) << " | " << percent(r.best_accuracy) << " | "
      << format_bytes(r.up) << " | " << format_bytes(r.down) << " | " << format_bytes(r.up + r.down) << " | "
      << seconds(r.sim_s) << " | " << seconds(r.reach_s) << " | " << (diff.empty() ? "-" : cell(diff)) << " |\n";
  }
  o << "\nSimulated seconds are the sum of `sim_round_s` (the simulated clock: device and network profiles, "
       "rounds or asynchronous steps). The time to reach "
    << (std::isnan(target) ? std::string("the first run's final accuracy") : percent(target))
    << " (the first run's final accuracy) is that of the first evaluation at or above it; `-`: never reached.\n";
  if (rows.size() > 1) {
    o << "\nThe runs differ in ";
    if (differing.empty()) o << "no setting";
    for (size_t i = 0; i < differing.size(); ++i) o << (i ? ", " : "") << "`" << differing[i] << "`";
    o << " (besides `out`).\n";
  }
  return o.str();
}

// A run folder as the dashboard page shows it: its rounds and its config.
monitor::ReportRun report_run(const std::string& dir, const std::vector<MetricsRow>& rows) {
  monitor::ReportRun r;
  r.name = run_label(dir);
  r.run.program = "sparrow-sim";
  r.run.run_id = r.name;
  const fs::path config = fs::path(dir) / "config.toml";
  std::ifstream in(config, std::ios::binary);
  if (in) {
    std::stringstream ss;
    ss << in.rdbuf();
    r.run.config = ss.str();
    try {
      const SimConfig c = load_config(config.string());
      r.run.model = c.model;
      r.run.rounds_total = c.rounds;
    } catch (const std::exception&) {
      // A config this version cannot read still shows as text.
    }
  }
  for (const MetricsRow& m : rows) {
    monitor::RoundPoint p;
    p.round = static_cast<int64_t>(m.round);
    p.duration_s = m.real_s;
    p.accuracy = m.has_accuracy ? m.accuracy : NAN;
    p.loss = m.has_loss ? m.loss : NAN;
    p.train_loss = m.train_loss;
    p.bytes_up = static_cast<uint64_t>(m.bytes_up);
    p.bytes_down = static_cast<uint64_t>(m.bytes_down);
    p.selected = static_cast<int64_t>(m.clients);
    p.dropped = static_cast<int64_t>(m.dropped);
    p.accepted = p.selected - p.dropped;
    p.epsilon = m.epsilon;
    r.rounds.push_back(p);
  }
  if (r.run.rounds_total == 0 && !r.rounds.empty()) r.run.rounds_total = r.rounds.back().round;
  return r;
}

}  // namespace

std::vector<std::string> write_report(const std::string& run_dir, const std::vector<std::string>& compare,
                                      const std::string& out_dir) {
  // Read and check everything first: bad input writes nothing.
  std::vector<std::string> dirs{run_dir};
  dirs.insert(dirs.end(), compare.begin(), compare.end());
  PlotSpec by_round{"Accuracy vs round", "round", "accuracy", false, {}};
  PlotSpec by_bytes{"Accuracy vs cumulative uplink bytes", "cumulative uplink bytes (log scale)", "accuracy", true, {}};
  PlotSpec by_total{"Accuracy vs cumulative bytes, uplink + downlink",
                    "cumulative uplink + downlink bytes (log scale)",
                    "accuracy",
                    true,
                    {}};
  PlotSpec by_time{"Accuracy vs simulated time", "simulated time (s)", "accuracy", false, {}};
  by_time.whole_x = false;
  PlotSpec loss{"Loss vs round (solid: test, dashed: training)", "round", "loss", false, {}};
  loss.fraction = false;
  PlotSpec bytes{
      "Cumulative bytes vs round (solid: uplink, dashed: downlink, dotted: total)", "round", "bytes", false, {}};
  bytes.fraction = false;
  bytes.bytes_y = true;
  int color = 0;
  std::vector<monitor::ReportRun> page_runs;
  std::vector<RunRow> table;
  std::vector<std::vector<std::pair<std::string, std::string>>> configs;
  for (const std::string& dir : dirs) {
    std::vector<MetricsRow> rows = read_metrics(dir);
    page_runs.push_back(report_run(dir, rows));
    configs.push_back(config_keys(page_runs.back().run.config));
    Series r{run_label(dir), {}, "", -1}, b{r.label, {}, "", -1}, tot{r.label, {}, "", -1}, t{r.label, {}, "", -1};
    Series test{r.label + " test", {}, "", color}, train{r.label + " train", {}, kDashed, color};
    Series up{r.label + " up", {}, "", color}, down{r.label + " down", {}, kDashed, color},
        total{r.label + " total", {}, kDotted, color};
    RunRow row_sum;
    row_sum.name = r.label;
    row_sum.rounds = rows.size();
    double cumulative = 0, cumulative_down = 0, clock = 0;
    for (const MetricsRow& row : rows) {
      clock += row.sim_round_s;  // a row's evaluation is of the model at the end of its round or step
      cumulative += row.bytes_up;
      cumulative_down += row.bytes_down;
      up.points.emplace_back(row.round, cumulative);
      down.points.emplace_back(row.round, cumulative_down);
      total.points.emplace_back(row.round, cumulative + cumulative_down);
      if (std::isfinite(row.train_loss)) train.points.emplace_back(row.round, row.train_loss);
      if (row.has_loss && std::isfinite(row.loss)) test.points.emplace_back(row.round, row.loss);
      if (!row.has_accuracy) continue;
      row_sum.final_accuracy = row.accuracy;
      if (!(row.accuracy <= row_sum.best_accuracy)) row_sum.best_accuracy = row.accuracy;  // NaN at first
      r.points.emplace_back(row.round, row.accuracy);
      t.points.emplace_back(clock, row.accuracy);
      if (cumulative > 0) b.points.emplace_back(cumulative, row.accuracy);  // log axis: nothing at 0 bytes
      if (cumulative + cumulative_down > 0) tot.points.emplace_back(cumulative + cumulative_down, row.accuracy);
    }
    row_sum.up = cumulative;
    row_sum.down = cumulative_down;
    row_sum.sim_s = clock;
    row_sum.by_time = t.points;
    table.push_back(std::move(row_sum));
    by_time.series.push_back(std::move(t));
    by_round.series.push_back(std::move(r));
    by_bytes.series.push_back(std::move(b));
    by_total.series.push_back(std::move(tot));
    loss.series.push_back(std::move(test));
    loss.series.push_back(std::move(train));
    bytes.series.push_back(std::move(up));
    bytes.series.push_back(std::move(down));
    bytes.series.push_back(std::move(total));
    ++color;
  }
  // The settings each run shows: what compresses each way, then every key in
  // which the runs differ.
  const std::vector<std::string> differing = differing_keys(configs);
  for (RunRow& row : table) row.reach_s = time_to_reach(row.by_time, table.front().final_accuracy);
  for (size_t i = 0; i < table.size(); ++i) {
    for (const char* key : kMethodKeys) table[i].settings.emplace_back(key, setting(configs[i], key));
    for (const std::string& key : differing)
      if (key != kMethodKeys[0] && key != kMethodKeys[1]) table[i].settings.emplace_back(key, setting(configs[i], key));
    page_runs[i].settings = table[i].settings;
  }
  if (dirs.size() == 1) {
    by_round.title += " (" + by_round.series[0].label + ")";
    by_bytes.title += " (" + by_bytes.series[0].label + ")";
    by_total.title += " (" + by_total.series[0].label + ")";
    by_time.title += " (" + by_time.series[0].label + ")";
  }
  const fs::path out = out_dir.empty() ? fs::path(run_dir) : fs::path(out_dir);
  if (!out_dir.empty()) {
    std::error_code ec;
    fs::create_directories(out, ec);
    SPARROW_CHECK_T(ConfigError, !ec, "report: cannot create '" << out_dir << "': " << ec.message());
  }
  const std::vector<std::pair<std::string, std::string>> files = {{"accuracy_vs_round.svg", render(by_round)},
                                                                  {"accuracy_vs_bytes.svg", render(by_bytes)},
                                                                  {"loss_vs_round.svg", render(loss)},
                                                                  {"dashboard.html", monitor::report_page(page_runs)},
                                                                  {"accuracy_vs_total_bytes.svg", render(by_total)},
                                                                  {"bytes_vs_round.svg", render(bytes)},
                                                                  {"runs.md", runs_markdown(table, differing)},
                                                                  {"accuracy_vs_sim_time.svg", render(by_time)}};
  std::vector<std::string> paths;
  for (const auto& [name, text] : files) {
    paths.push_back((out / name).string());
    write_file(paths.back(), text);
  }
  return paths;
}

namespace report_detail {

std::string format_bytes(double bytes) {
  static const char* kUnits[] = {"B", "KB", "MB", "GB", "TB", "PB"};
  constexpr int kLast = 5;
  if (!(bytes > 0)) return "0 B";
  int unit = 0;
  double v = bytes;
  while (v >= 1000 && unit < kLast) v /= 1000, ++unit;
  // Round to 3 significant digits; 999.9 KB rounds up to 1 MB.
  double scale = std::pow(10.0, 2 - std::floor(std::log10(v)));
  v = std::round(v * scale) / scale;
  if (v >= 1000 && unit < kLast) v /= 1000, ++unit;
  char buf[48];
  std::snprintf(buf, sizeof(buf), "%g %s", v, kUnits[unit]);
  return buf;
}

std::vector<Tick> log_byte_ticks(double lo, double hi) {
  SPARROW_CHECK(lo > 0 && hi >= lo && std::isfinite(hi), "log axis needs 0 < lo <= hi, got " << lo << ", " << hi);
  // 1e-9 slack so that exact powers of ten (log10(1000) = 2.9999...) land on their decade.
  int dlo = static_cast<int>(std::floor(std::log10(lo) + 1e-9));
  int dhi = static_cast<int>(std::ceil(std::log10(hi) - 1e-9));
  if (dhi <= dlo) dhi = dlo + 1;
  int stride = std::max(1, (dhi - dlo + 6) / 7);  // at most ~8 decade ticks
  dhi = dlo + (dhi - dlo + stride - 1) / stride * stride;
  std::vector<Tick> ticks;
  for (int d = dlo; d <= dhi; d += stride) {
    double base = std::pow(10.0, d);
    ticks.push_back({base, format_bytes(base)});
    if (dhi - dlo <= 2 && d < dhi) {
      ticks.push_back({2 * base, format_bytes(2 * base)});
      ticks.push_back({5 * base, format_bytes(5 * base)});
    }
  }
  return ticks;
}

std::vector<Tick> linear_ticks(double lo, double hi, int target, double min_step) {
  SPARROW_CHECK(std::isfinite(lo) && std::isfinite(hi) && lo <= hi && target >= 2,
                "bad linear axis [" << lo << ", " << hi << "]");
  if (hi == lo) {
    double pad = lo == 0 ? 1 : std::abs(lo) * 0.1;
    lo -= pad, hi += pad;
  }
  double raw = (hi - lo) / (target - 1);
  double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double f = raw / mag;
  double step = (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * mag;
  step = std::max(step, min_step);
  long long k0 = static_cast<long long>(std::floor(lo / step + 1e-9));
  long long k1 = static_cast<long long>(std::ceil(hi / step - 1e-9));
  if (k1 <= k0) k1 = k0 + 1;
  int decimals = std::max(0, static_cast<int>(-std::floor(std::log10(step) + 1e-9)));
  std::vector<Tick> ticks;
  for (long long k = k0; k <= k1; ++k) {
    double v = static_cast<double>(k) * step;
    char buf[48];
    std::snprintf(buf, sizeof(buf), "%.*f", decimals, k == 0 ? 0.0 : v);
    ticks.push_back({v, buf});
  }
  return ticks;
}

std::string xml_escape(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        // Control characters are not allowed in XML 1.0; drop them.
        if (static_cast<unsigned char>(c) >= 0x20 || c == '\t' || c == '\n') out += c;
    }
  }
  return out;
}

}  // namespace report_detail
}  // namespace sparrow::simulator
