#include "tests/sparrow_test.h"

#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "simulator/report.h"

using namespace sparrow::simulator;
using namespace sparrow::simulator::report_detail;
namespace fs = std::filesystem;

namespace {

const char* kHeader = "round,accuracy,loss,train_loss,bytes_up,bytes_down,sim_round_s,real_s,clients,dropped\n";

// A run folder with a name unique to this test and process, removed on scope exit.
struct TempRun {
  fs::path dir;
  explicit TempRun(const std::string& name) : dir(fs::path("report_test_" + std::to_string(getpid())) / name) {
    fs::create_directories(dir);
  }
  ~TempRun() {
    std::error_code ec;
    fs::remove_all(dir, ec);
    fs::remove(dir.parent_path(), ec);  // only succeeds once the last run of this process is gone
  }
  void write(const std::string& csv) const { std::ofstream(dir / "metrics.csv", std::ios::binary) << csv; }
  std::string str() const { return dir.string(); }
};

// `rounds` rounds, evaluated every `eval_every` rounds (and never otherwise),
// `up` bytes uplink per round.
std::string synthetic_csv(int rounds, int eval_every, double up) {
  std::ostringstream o;
  o << kHeader;
  for (int r = 1; r <= rounds; ++r) {
    bool eval = r % eval_every == 0;
    o << r << ",";
    if (eval) o << 0.1 + 0.8 * r / rounds;
    o << ",";
    if (eval) o << 2.0 / r;
    o << "," << 1.5 / r << "," << up << "," << 4 * up << ",0.5,0.01,10,0\n";
  }
  return o.str();
}

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream o;
  o << f.rdbuf();
  return o.str();
}

size_t count(const std::string& s, const std::string& part) {
  size_t n = 0;
  for (size_t p = s.find(part); p != std::string::npos; p = s.find(part, p + 1)) ++n;
  return n;
}

// A small XML well-formedness check: tags balance and nest, '<' never occurs in
// text, and every '&' starts one of the five predefined entities.
bool well_formed(const std::string& x, std::string* why) {
  std::vector<std::string> stack;
  size_t i = 0;
  bool root_seen = false;
  while (i < x.size()) {
    if (x[i] == '&') {
      bool ok = false;
      for (const char* e : {"&amp;", "&lt;", "&gt;", "&quot;", "&apos;"}) ok |= x.compare(i, strlen(e), e) == 0;
      if (!ok) return *why = "bare & at " + std::to_string(i), false;
      ++i;
      continue;
    }
    if (x[i] != '<') {
      ++i;
      continue;
    }
    size_t end = x.find('>', i);
    if (end == std::string::npos) return *why = "unterminated tag", false;
    std::string tag = x.substr(i + 1, end - i - 1);
    if (tag.find('<') != std::string::npos) return *why = "'<' inside tag " + tag, false;
    for (size_t k = 0; k < tag.size(); ++k) {
      if (tag[k] == '&') {
        bool ok = false;
        for (const char* e : {"&amp;", "&lt;", "&gt;", "&quot;", "&apos;"}) ok |= tag.compare(k, strlen(e), e) == 0;
        if (!ok) return *why = "bare & in tag " + tag, false;
      }
    }
    i = end + 1;
    if (tag.front() == '?') continue;  // XML declaration
    if (tag.front() == '/') {
      std::string name = tag.substr(1);
      if (stack.empty() || stack.back() != name) return *why = "mismatched </" + name + ">", false;
      stack.pop_back();
      continue;
    }
    std::string name = tag.substr(0, tag.find_first_of(" \t\n/"));
    if (stack.empty()) {
      if (root_seen) return *why = "second root element " + name, false;
      root_seen = true;
    }
    if (tag.back() != '/') stack.push_back(name);
  }
  if (!stack.empty()) return *why = "unclosed <" + stack.back() + ">", false;
  if (!root_seen) return *why = "no element", false;
  return true;
}

// The points="..." of every polyline, in order.
std::vector<std::string> polylines(const std::string& svg) {
  std::vector<std::string> out;
  for (size_t p = svg.find("<polyline"); p != std::string::npos; p = svg.find("<polyline", p + 1)) {
    size_t a = svg.find("points=\"", p) + 8;
    out.push_back(svg.substr(a, svg.find('"', a) - a));
  }
  return out;
}

size_t point_count(const std::string& points) {
  if (points.empty()) return 0;
  return count(points, " ") + 1;
}

// x1 of each tick mark inside the <g class="x-ticks"> group, in document order.
std::vector<double> x_tick_positions(const std::string& svg) {
  std::vector<double> xs;
  size_t g = svg.find("<g class=\"x-ticks\"");
  size_t end = svg.find("</g>", g);
  for (size_t p = svg.find("<line x1=\"", g); p != std::string::npos && p < end; p = svg.find("<line x1=\"", p + 1)) {
    xs.push_back(std::atof(svg.c_str() + p + 10));
  }
  return xs;
}

template <class E, class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("report writes two well-formed plots of one run") {
  TempRun run("single");
  run.write(synthetic_csv(10, 2, 250000));  // 5 evaluated rounds, 250 KB .. 2.5 MB cumulative
  std::vector<std::string> paths = write_report(run.str());
  REQUIRE(paths.size() == 8);
  CHECK(paths[0] == (run.dir / "accuracy_vs_round.svg").string());
  CHECK(paths[1] == (run.dir / "accuracy_vs_bytes.svg").string());
  CHECK(paths[2] == (run.dir / "loss_vs_round.svg").string());
  // The dashboard page with the run inlined (its charts are checked in a browser by the
  // integration tests).
  CHECK(paths[3] == (run.dir / "dashboard.html").string());
  const std::string page = slurp(paths[3]);
  CHECK(contains(page, "window.SPARROW_STATIC = {"));
  CHECK(contains(page, "\"name\":\"single"));
  CHECK(contains(page, "Chart.js v3.9.1"));
  for (const std::string& p : {paths[0], paths[1]}) {
    REQUIRE(fs::exists(p));
    std::string svg = slurp(p);
    std::string why;
    CHECK_MESSAGE(well_formed(svg, &why), p << ": " << why);
    CHECK(contains(svg, "<svg"));
    CHECK(contains(svg, ">accuracy</text>"));
    CHECK(contains(svg, "single"));  // run label in the title and legend
    CHECK(count(svg, "class=\"legend-entry\"") == 1);
    std::vector<std::string> lines = polylines(svg);
    REQUIRE(lines.size() == 1);
    CHECK(point_count(lines[0]) == 5);
    CHECK(count(svg, "<circle") == 5 + 1);  // markers plus the legend's
    std::vector<double> xs = x_tick_positions(svg);
    REQUIRE(xs.size() >= 2);
    for (size_t i = 1; i < xs.size(); ++i) CHECK(xs[i] > xs[i - 1]);
  }
  std::string by_round = slurp(paths[0]), by_bytes = slurp(paths[1]);
  CHECK(contains(by_round, ">round</text>"));
  CHECK(contains(by_bytes, ">cumulative uplink bytes (log scale)</text>"));
  CHECK(contains(by_bytes, ">1 MB</text>"));
  CHECK(contains(by_bytes, ">100 KB</text>"));
  CHECK(contains(by_bytes, ">10 MB</text>"));
}

TEST_CASE("report ticks on a log axis are monotone and cover the data") {
  for (auto [lo, hi] : std::vector<std::pair<double, double>>{
           {1500, 3e6}, {1e3, 1e6}, {7, 7}, {2e6, 8e6}, {1, 1e15}, {999, 1001}, {0.5, 3}}) {
    std::vector<Tick> t = log_byte_ticks(lo, hi);
    REQUIRE(t.size() >= 2);
    CHECK(t.front().value <= lo);
    CHECK(t.back().value >= hi);
    for (size_t i = 1; i < t.size(); ++i) {
      CHECK(t[i].value > t[i - 1].value);
      CHECK(t[i].label != t[i - 1].label);
    }
    CHECK(t.size() <= 12);
  }
  std::vector<Tick> t = log_byte_ticks(1500, 3e6);
  std::vector<std::string> labels;
  for (const Tick& k : t) labels.push_back(k.label);
  CHECK(labels == std::vector<std::string>{"1 KB", "10 KB", "100 KB", "1 MB", "10 MB"});
  std::vector<Tick> narrow = log_byte_ticks(2e6, 8e6);  // one decade: 1/2/5 ticks
  CHECK(narrow.size() == 4);
  CHECK(narrow[1].label == "2 MB");
  CHECK(narrow[2].label == "5 MB");
  CHECK_THROWS_AS(log_byte_ticks(0, 10), sparrow::Error);
}

TEST_CASE("report formats bytes and linear ticks") {
  CHECK(format_bytes(0) == "0 B");
  CHECK(format_bytes(500) == "500 B");
  CHECK(format_bytes(1000) == "1 KB");
  CHECK(format_bytes(2.5e6) == "2.5 MB");
  CHECK(format_bytes(999999) == "1 MB");
  CHECK(format_bytes(1.234e10) == "12.3 GB");
  std::vector<Tick> t = linear_ticks(0, 1);
  REQUIRE(t.size() == 6);
  CHECK(t[0].label == "0.0");
  CHECK(t[5].label == "1.0");
  CHECK(t[5].value == doctest::Approx(1));
  std::vector<Tick> r = linear_ticks(0, 3, 6, 1);  // rounds: whole steps
  CHECK(r.size() == 4);
  CHECK(r[3].label == "3");
  std::vector<Tick> odd = linear_ticks(3, 97);
  CHECK(odd.front().value <= 3);
  CHECK(odd.back().value >= 97);
  CHECK(xml_escape("a&b<c>\"d'") == "a&amp;b&lt;c&gt;&quot;d&apos;");
}

TEST_CASE("report overlays runs labelled by folder name") {
  TempRun a("fedavg"), b("dgc&<top>");
  a.write(synthetic_csv(6, 1, 1e6));
  b.write(synthetic_csv(6, 3, 1e4));
  std::vector<std::string> paths = write_report(a.str(), {b.str() + "/"});
  for (const std::string& p : {paths[0], paths[1]}) {
    std::string svg = slurp(p);
    std::string why;
    CHECK_MESSAGE(well_formed(svg, &why), p << ": " << why);
    CHECK(count(svg, "class=\"legend-entry\"") == 2);
    CHECK(contains(svg, ">fedavg</text>"));
    CHECK(contains(svg, ">dgc&amp;&lt;top&gt;</text>"));
    std::vector<std::string> lines = polylines(svg);
    REQUIRE(lines.size() == 2);
    CHECK(point_count(lines[0]) == 6);
    CHECK(point_count(lines[1]) == 2);
  }
  CHECK_FALSE(fs::exists(b.dir / "accuracy_vs_round.svg"));  // only the main run folder gets plots
}

TEST_CASE("report rejects malformed metrics and writes nothing") {
  TempRun run("bad");
  auto format_error = [&](const std::string& csv) {
    run.write(csv);
    return error_of<sparrow::FormatError>([&] { write_report(run.str()); });
  };
  std::string csv_path = (run.dir / "metrics.csv").string();

  SUBCASE("empty file") { CHECK(contains(format_error(""), csv_path + ":1:")); }
  SUBCASE("missing header column") {
    std::string e = format_error("round,accuracy,loss,train_loss,bytes_up,bytes_down,sim_round_s,real_s,clients\n");
    CHECK(contains(e, csv_path + ":1:"));
    CHECK(contains(e, "dropped"));
  }
  SUBCASE("bad number") {
    std::string e = format_error(std::string(kHeader) + "1,0.5,1,1,100,100,1,1,1,0\n2,0.6x,1,1,100,100,1,1,1,0\n");
    CHECK(contains(e, csv_path + ":3:"));
    CHECK(contains(e, "accuracy"));
  }
  SUBCASE("wrong field count") {
    CHECK(contains(format_error(std::string(kHeader) + "1,0.5,1,1,100\n"), csv_path + ":2:"));
  }
  SUBCASE("empty required cell") {
    CHECK(contains(format_error(std::string(kHeader) + ",0.5,1,1,100,100,1,1,1,0\n"), "round"));
  }
  SUBCASE("non-finite accuracy and negative bytes") {
    CHECK(contains(format_error(std::string(kHeader) + "1,nan,1,1,100,100,1,1,1,0\n"), ":2:"));
    CHECK(contains(format_error(std::string(kHeader) + "1,0.5,1,1,-100,100,1,1,1,0\n"), ":2:"));
  }
  SUBCASE("a bad compare run stops the report") {
    run.write(synthetic_csv(4, 1, 100));
    TempRun other("bad_other");
    other.write("round,accuracy\n1,0.5\n");
    CHECK(contains(error_of<sparrow::FormatError>([&] { write_report(run.str(), {other.str()}); }), "bad_other"));
  }
  CHECK_FALSE(fs::exists(run.dir / "accuracy_vs_round.svg"));
  CHECK_FALSE(fs::exists(run.dir / "accuracy_vs_bytes.svg"));
}

TEST_CASE("report on a folder without metrics is a config error") {
  TempRun run("empty_dir");
  CHECK(contains(error_of<sparrow::ConfigError>([&] { write_report(run.str()); }), "metrics.csv"));
  CHECK(contains(error_of<sparrow::ConfigError>([&] { write_report((run.dir / "nope").string()); }), "nope"));
}

TEST_CASE("report accepts diverged losses and unevaluated runs") {
  TempRun run("diverged");
  run.write(std::string(kHeader) + "1,,,nan,100,100,1,1,1,0\n\n2,,inf,inf,100,100,1,1,1,0\n");
  std::vector<MetricsRow> rows = read_metrics(run.str());
  REQUIRE(rows.size() == 2);
  CHECK_FALSE(rows[0].has_accuracy);
  CHECK(rows[1].has_loss);
  std::vector<std::string> paths = write_report(run.str());
  std::string svg = slurp(paths[1]);
  std::string why;
  CHECK_MESSAGE(well_formed(svg, &why), why);
  CHECK(contains(svg, "(no data)"));
  CHECK(point_count(polylines(svg).at(0)) == 0);
}

TEST_CASE("report: loss plot (test and training), y axis scaled to the data, --out folder") {
  TempRun run("lossplot");
  // Accuracy 0.7 .. 0.85 over 10 rounds, every round evaluated.
  std::ostringstream o;
  o << kHeader;
  for (int r = 1; r <= 10; ++r)
    o << r << "," << 0.7 + 0.15 * (r - 1) / 9 << "," << 1.0 / r << "," << 1.2 / r << ",1000,4000,0.5,0.01,10,0\n";
  run.write(o.str());
  const fs::path out = run.dir / "plots";
  std::vector<std::string> paths = write_report(run.str(), {}, out.string());
  REQUIRE(paths.size() == 8);
  for (const std::string& p : paths) CHECK(fs::path(p).parent_path() == out);
  CHECK_FALSE(fs::exists(run.dir / "accuracy_vs_round.svg"));  // only in --out
  const std::string acc = slurp(paths[0]), loss = slurp(paths[2]);
  std::string why;
  CHECK_MESSAGE(well_formed(loss, &why), why);
  // Accuracy ticks start near the data, not at 0.
  CHECK_FALSE(contains(acc, ">0.0</text>"));
  CHECK(contains(acc, ">0.70</text>"));
  // Loss: a test and a training series per run, the training one dashed.
  CHECK(polylines(loss).size() == 2);
  CHECK(count(loss, "stroke-dasharray") == 2);  // the line and its legend entry
  CHECK(contains(loss, ">lossplot test</text>"));
  CHECK(contains(loss, ">lossplot train</text>"));
  CHECK(contains(loss, ">loss</text>"));
}

TEST_CASE("report: uplink, downlink and total bytes, and a runs table with the settings in which runs differ") {
  TempRun dense("dense"), dgc("dgc");
  dense.write(synthetic_csv(4, 2, 1000));  // 1 KB up, 4 KB down per round
  dgc.write(synthetic_csv(4, 2, 10));
  std::ofstream(dense.dir / "config.toml") << "# sparrow-sim effective configuration\nseed = 1\nlr = 0.1\n"
                                              "compression = \"none\"\ndownlink = \"none\"\nout = \"runs/dense\"\n"
                                              "\n[profiles]\nuplink_mbps = 10\n";
  std::ofstream(dgc.dir / "config.toml")
      << "# sparrow-sim effective configuration\nseed = 1\nlr = 0.05\n"
         "compression = \"dgc:ratio=0.01\"\ndownlink = \"none\"\nout = \"runs/dgc\"\n"
         "\n[profiles]\nuplink_mbps = 5\n";
  const std::vector<std::string> paths = write_report(dense.str(), {dgc.str()});
  REQUIRE(paths.size() == 8);
  CHECK(paths[4] == (dense.dir / "accuracy_vs_total_bytes.svg").string());
  CHECK(paths[5] == (dense.dir / "bytes_vs_round.svg").string());
  CHECK(paths[6] == (dense.dir / "runs.md").string());
  // Cumulative bytes by round: uplink, downlink and total for each run.
  const std::string bytes = slurp(paths[5]);
  std::string why;
  CHECK_MESSAGE(well_formed(bytes, &why), why);
  CHECK(polylines(bytes).size() == 6);
  for (const char* label : {">dense up</text>", ">dense down</text>", ">dense total</text>", ">dgc total</text>"})
    CHECK(contains(bytes, label));
  CHECK(contains(bytes, ">20 KB</text>"));  // the dense total after 4 rounds is 20 KB: bytes on the y axis
  const std::string total = slurp(paths[4]);
  CHECK_MESSAGE(well_formed(total, &why), why);
  CHECK(contains(total, ">cumulative uplink + downlink bytes (log scale)</text>"));
  // The table: compression and downlink of each run, its byte totals, and the
  // keys that differ (not `out`, not those that agree).
  const std::string md = slurp(paths[6]);
  INFO(md);
  CHECK(contains(md,
                 "| run | compression | downlink | rounds | final accuracy | best accuracy | uplink | "
                 "downlink bytes | total bytes | simulated s | simulated s to 90.00% | differing settings |"));
  CHECK(contains(md,
                 "| dense | `none` | `none` | 4 | 90.00% | 90.00% | 4 KB | 16 KB | 20 KB | 2.0 | 2.0 | lr = 0.1, "
                 "profiles.uplink_mbps = 10 |"));
  CHECK(contains(md,
                 "| dgc | `dgc:ratio=0.01` | `none` | 4 | 90.00% | 90.00% | 40 B | 160 B | 200 B | 2.0 | 2.0 | "
                 "lr = 0.05, profiles.uplink_mbps = 5 |"));
  CHECK(contains(md, "The runs differ in `lr`, `compression`, `profiles.uplink_mbps` (besides `out`)."));
  CHECK_FALSE(contains(md, "seed ="));
  // The page carries the same settings for its runs table.
  const std::string page = slurp(paths[3]);
  CHECK(contains(page,
                 "\"settings\":[[\"compression\",\"none\"],[\"downlink\",\"none\"],[\"lr\",\"0.1\"],"
                 "[\"profiles.uplink_mbps\",\"10\"]]"));
}

namespace {

// (x position, value) of each x tick label, in document order.
std::vector<std::pair<double, double>> x_tick_labels(const std::string& svg) {
  std::vector<std::pair<double, double>> out;
  const size_t g = svg.find("<g class=\"x-ticks\"");
  const size_t end = svg.find("</g>", g);
  for (size_t p = svg.find("<text x=\"", g); p != std::string::npos && p < end; p = svg.find("<text x=\"", p + 1)) {
    const size_t v = svg.find('>', p) + 1;
    out.emplace_back(std::atof(svg.c_str() + p + 9), std::atof(svg.c_str() + v));
  }
  return out;
}

// The x values of a polyline's points, mapped back through the axis ticks.
std::vector<double> x_values(const std::string& svg, const std::string& points) {
  const auto ticks = x_tick_labels(svg);
  REQUIRE(ticks.size() >= 2);
  const double scale = (ticks.back().second - ticks.front().second) / (ticks.back().first - ticks.front().first);
  std::vector<double> xs;
  std::istringstream in(points);
  for (std::string pt; in >> pt;)
    xs.push_back(ticks.front().second + (std::atof(pt.c_str()) - ticks.front().first) * scale);
  return xs;
}

}  // namespace

TEST_CASE("report: accuracy against simulated time puts a synchronous and an asynchronous run on one clock") {
  TempRun sync("sync"), async("async"), slow("slow");
  // Sync: 3 rounds of 10 simulated seconds, accuracy 0.5, 0.6, 0.7 at 10, 20, 30 s.
  sync.write(std::string(kHeader) +
             "1,0.5,1,1,100,100,10,0.01,10,0\n2,0.6,1,1,100,100,10,0.01,10,0\n"
             "3,0.7,1,1,100,100,10,0.01,10,0\n");
  // Async: 6 steps of 2.5 s, evaluated every second step: 0.55, 0.72, 0.8 at 5, 10, 15 s.
  std::ostringstream a;
  a << kHeader;
  const double acc[] = {0.55, 0.72, 0.8};
  for (int s = 1; s <= 6; ++s) {
    a << s << ",";
    if (s % 2 == 0)
      a << acc[s / 2 - 1] << ",0.9";
    else
      a << ",";
    a << ",1,100,100,2.5,0.01,10,0\n";
  }
  async.write(a.str());
  // Never reaches the synchronous run's final accuracy.
  slow.write(std::string(kHeader) + "1,0.3,1,1,100,100,20,0.01,10,0\n2,0.4,1,1,100,100,20,0.01,10,0\n");

  const std::vector<std::string> paths = write_report(sync.str(), {async.str(), slow.str()});
  REQUIRE(paths.size() == 8);
  CHECK(paths[7] == (sync.dir / "accuracy_vs_sim_time.svg").string());
  const std::string svg = slurp(paths[7]);
  std::string why;
  CHECK_MESSAGE(well_formed(svg, &why), why);
  CHECK(contains(svg, ">simulated time (s)</text>"));
  CHECK(contains(svg, ">sync</text>"));
  CHECK(contains(svg, ">async</text>"));
  const std::vector<std::string> lines = polylines(svg);
  REQUIRE(lines.size() == 3);
  const std::vector<double> xs_sync = x_values(svg, lines[0]), xs_async = x_values(svg, lines[1]),
                            xs_slow = x_values(svg, lines[2]);
  const std::vector<double> want_sync{10, 20, 30}, want_async{5, 10, 15}, want_slow{20, 40};
  REQUIRE(xs_sync.size() == want_sync.size());
  REQUIRE(xs_async.size() == want_async.size());
  REQUIRE(xs_slow.size() == want_slow.size());
  for (size_t i = 0; i < want_sync.size(); ++i) CHECK(xs_sync[i] == doctest::Approx(want_sync[i]).epsilon(1e-3));
  for (size_t i = 0; i < want_async.size(); ++i) CHECK(xs_async[i] == doctest::Approx(want_async[i]).epsilon(1e-3));
  for (size_t i = 0; i < want_slow.size(); ++i) CHECK(xs_slow[i] == doctest::Approx(want_slow[i]).epsilon(1e-3));
  // The round plot keeps rounds and steps on its own axis: the async run's last point is at step 6.
  const std::string by_round = slurp(paths[0]);
  CHECK(x_values(by_round, polylines(by_round)[1]).back() == doctest::Approx(6).epsilon(1e-3));

  // The runs table: total simulated time and when each run first reached the sync run's final 70%.
  const std::string md = slurp(paths[6]);
  INFO(md);
  CHECK(contains(md, "| simulated s | simulated s to 70.00% |"));
  CHECK(contains(md, "| sync | `?` | `?` | 3 | 70.00% | 70.00% | 300 B | 300 B | 600 B | 30.0 | 30.0 | - |"));
  CHECK(contains(md, "| async | `?` | `?` | 6 | 80.00% | 80.00% | 600 B | 600 B | 1.2 KB | 15.0 | 10.0 | - |"));
  CHECK(contains(md, "| slow | `?` | `?` | 2 | 40.00% | 40.00% | 200 B | 200 B | 400 B | 40.0 | - | - |"));
}

TEST_CASE("report: a short run's simulated-time axis is not forced to whole seconds, and negative time is refused") {
  TempRun run("subsecond");
  run.write(std::string(kHeader) +
            "1,0.5,1,1,100,100,0.1,0.01,10,0\n2,0.6,1,1,100,100,0.1,0.01,10,0\n"
            "3,0.7,1,1,100,100,0.1,0.01,10,0\n");
  const std::vector<std::string> paths = write_report(run.str());
  const std::string svg = slurp(paths[7]);
  CHECK(contains(svg, "Accuracy vs simulated time (subsecond)"));
  const auto ticks = x_tick_labels(svg);
  REQUIRE(ticks.size() >= 3);
  CHECK(ticks.back().second == doctest::Approx(0.3).epsilon(1e-6));  // not stretched to 1 s
  const std::vector<double> xs = x_values(svg, polylines(svg).at(0));
  REQUIRE(xs.size() == 3);
  CHECK(xs[2] == doctest::Approx(0.3).epsilon(1e-3));

  TempRun bad("negative_time");
  bad.write(std::string(kHeader) + "1,0.5,1,1,100,100,-1,0.01,10,0\n");
  CHECK(contains(error_of<sparrow::FormatError>([&] { write_report(bad.str()); }), "sim_round_s"));
  CHECK_FALSE(fs::exists(bad.dir / "accuracy_vs_sim_time.svg"));
}
