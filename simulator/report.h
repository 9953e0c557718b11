#pragma once
// Plots of a finished run, for `sparrow-sim report RUN_DIR [--compare DIR...]`.
//
// A run folder holds metrics.csv whose header names (at least) the columns
//   round,accuracy,loss,train_loss,bytes_up,bytes_down,sim_round_s,real_s,clients,dropped
// in any order; accuracy and loss are empty on rounds without evaluation.
//
// Contract of write_report:
//  - Reads run_dir/metrics.csv and, to overlay several runs, each compare dir's
//    metrics.csv; every run is labelled by its folder name.
//  - Writes accuracy_vs_round.svg, accuracy_vs_bytes.svg (x = cumulative uplink
//    bytes, log scale, SI units: 1 KB = 1000 B) and loss_vs_round.svg (test loss
//    solid, training loss dashed, one colour per run) into run_dir or out_dir,
//    then dashboard.html (the live dashboard's page with every run's rounds
//    and config inlined: one self-contained file, docs/monitoring.md), then
//    accuracy_vs_total_bytes.svg (x = cumulative uplink + downlink bytes),
//    bytes_vs_round.svg (cumulative uplink solid, downlink dashed, total
//    dotted) and runs.md (a Markdown table: each run's compression, downlink,
//    rounds, final and best accuracy, uplink, downlink and total bytes, the
//    simulated seconds (sum of sim_round_s) and those at which the run's first
//    evaluation reached the first run's final accuracy, and its values of the
//    config keys in which the runs differ, `out` aside; read from each run's
//    config.toml), then accuracy_vs_sim_time.svg (x = cumulative sim_round_s,
//    the simulated clock, so a synchronous and an asynchronous run compare on
//    one axis), and returns their paths in that order. The page's runs table
//    shows the settings columns. Each run is one polyline through its
//    evaluated rounds with a marker per point; rows with an empty accuracy cell
//    are skipped. The y axis is scaled to the data (accuracy stays within [0, 1]).
//  - All inputs are read and checked before anything is written, so bad input
//    changes nothing. A missing metrics.csv throws ConfigError (the user named a
//    wrong folder); a malformed one (empty, missing header columns, wrong field
//    count, bad or non-finite numbers) throws FormatError "path:line: why".
//    Loss columns may be nan/inf (a diverged run is still worth plotting); the
//    plotted and counted columns must be finite, bytes and sim_round_s
//    non-negative.
//  - Hand-written SVG 1.1, valid XML; labels are escaped. No dependencies.

#include <cstdint>
#include <string>
#include <vector>

namespace sparrow::simulator {

// One row of metrics.csv. has_accuracy/has_loss are false where the cell was empty.
struct MetricsRow {
  double round = 0;
  bool has_accuracy = false;
  double accuracy = 0;
  bool has_loss = false;
  double loss = 0;
  double train_loss = 0;
  double bytes_up = 0;
  double bytes_down = 0;
  double sim_round_s = 0;
  double real_s = 0;
  double clients = 0;
  double dropped = 0;
  double epsilon = 0;  // NaN when the column is absent or empty (no DP)
};

// Parses run_dir/metrics.csv under the contract above (errors included).
std::vector<MetricsRow> read_metrics(const std::string& run_dir);

// Writes the plots, the page and the runs table into out_dir (default:
// run_dir); see the contract above. Returns their paths in that order.
std::vector<std::string> write_report(const std::string& run_dir, const std::vector<std::string>& compare = {},
                                      const std::string& out_dir = "");

// Exposed for tests and for anyone drawing more plots.
namespace report_detail {

struct Tick {
  double value;
  std::string label;
};

// Ticks for a log axis covering [lo, hi] (lo > 0): one per decade, plus 2x and
// 5x when the range spans at most two decades. Strictly increasing; the first
// is <= lo and the last >= hi (they are the axis ends). Labels via format_bytes.
std::vector<Tick> log_byte_ticks(double lo, double hi);

// Ticks for a linear axis covering [lo, hi] at a 1/2/5 x 10^k step (at least
// min_step), about `target` of them; first <= lo, last >= hi (the axis ends).
std::vector<Tick> linear_ticks(double lo, double hi, int target = 6, double min_step = 0);

// "0 B", "500 B", "1 KB", "2.5 MB", "10 GB" (SI units, up to 3 significant digits).
std::string format_bytes(double bytes);

// Escapes & < > " ' for XML text and attribute values.
std::string xml_escape(const std::string& s);

}  // namespace report_detail
}  // namespace sparrow::simulator
