// The run folder's record of the rounds: run.db (table `rounds`, one row per
// completed round, written before the checkpoint that covers it), metrics.csv
// (the same rows as text) and config.toml; the summary line sparrow-sim
// prints last; what the folder will hold (estimate_disk) and, with
// keep_client_state = false, dropping the client states of a finished run.
// Client states and checkpoints live in client_state.db (checkpoint.cc).
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iomanip>
#include <sstream>

#include "aggregation/server_optimizer.h"
#include "compression/state.h"
#include "core/error.h"
#include "federation/client_pipeline.h"
#include "simulator/impl.h"
#include "simulator/report.h"

namespace sparrow::simulator {
namespace {

std::string fmt_double(double v) {
  std::ostringstream os;
  os << std::setprecision(17) << v;
  return os.str();
}

std::string csv_num(double v) { return std::isnan(v) ? "" : fmt_double(v); }

std::string csv_row(const RoundMetrics& m) {
  std::ostringstream os;
  os << m.round << ',' << csv_num(m.accuracy) << ',' << csv_num(m.loss) << ',' << csv_num(m.train_loss) << ','
     << m.bytes_up << ',' << m.bytes_down << ',' << csv_num(m.sim_round_s) << ',' << csv_num(m.real_s) << ','
     << m.clients << ',' << m.dropped << ',' << csv_num(m.epsilon) << ',' << csv_num(m.clip) << '\n';
  return os.str();
}

// Meta value of a client_state.db whose client states were dropped at the end
// of the run (keep_client_state = false): a resume refuses it.
constexpr const char* kDroppedKey = "checkpoint.client_states";

void remove_db_files(const fs::path& p) {
  for (const char* ext : {"", "-wal", "-shm"}) fs::remove(p.string() + ext);
}

constexpr const char* kCsvHeader =
    "round,accuracy,loss,train_loss,bytes_up,bytes_down,sim_round_s,real_s,clients,dropped,epsilon,clip\n";

// run.db's schema. Version 1 is the table as every sparrow-sim wrote it (run
// folders of versions before user_version was set read as 0 and lack the last
// two columns, which are added).
void migrate_run_db(sqlite::Db& db, int /*from_version*/) {
  db.exec(
      "CREATE TABLE IF NOT EXISTS rounds(round INTEGER PRIMARY KEY, accuracy REAL, loss REAL, train_loss REAL, "
      "bytes_up INTEGER, bytes_down INTEGER, sim_round_s REAL, real_s REAL, clients INTEGER, dropped INTEGER, "
      "epsilon REAL, clip REAL)");
  for (const char* col : {"epsilon", "clip"})
    if (!db.has_column("rounds", col)) db.exec(std::string("ALTER TABLE rounds ADD COLUMN ") + col + " REAL");
}

}  // namespace

std::string summary_json(const Summary& s) {
  auto num = [](double v) { return std::isfinite(v) ? fmt_double(v) : std::string("null"); };
  std::ostringstream os;
  os << "{\"rounds\":" << s.rounds << ",\"accuracy\":" << num(s.accuracy) << ",\"loss\":" << num(s.loss)
     << ",\"bytes_up\":" << s.bytes_up << ",\"bytes_down\":" << s.bytes_down << ",\"sim_wall_s\":" << num(s.sim_wall_s)
     << ",\"real_s\":" << num(s.real_s) << ",\"epsilon\":" << num(s.epsilon);
  if (s.ranks > 1) {
    os << ",\"ranks\":" << s.ranks << ",\"rank_bytes_per_round\":[";
    for (size_t r = 0; r < s.rank_bytes.size(); ++r) os << (r ? "," : "") << fmt_double(s.rank_bytes[r]);
    os << "],\"rank0_send_s\":" << fmt_double(s.rank0_send_s) << ",\"rank0_wait_s\":" << fmt_double(s.rank0_wait_s)
       << ",\"rank0_fold_s\":" << fmt_double(s.rank0_fold_s);
  }
  os << "}";
  return os.str();
}

void Simulator::Impl::open_db(bool resume) {
  fs::create_directories(dir);
  const fs::path dbp = dir / "run.db";
  const fs::path csv = dir / "metrics.csv";
  const fs::path cs = dir / "client_state.db";
  if (!resume) {
    for (const auto& p : {dbp, csv, cs}) remove_db_files(p);
    remove_db_files(cs.string() + ".new");  // left by a drop_client_states() that did not finish
  }
  if (resume) {
    // run.db holds the rounds' history: a missing or empty one would start
    // a new history silently (opening creates it).
    std::error_code ec;
    const auto size = fs::file_size(dbp, ec);
    SPARROW_CHECK_T(ConfigError, !ec && size > 0,
                    "resume: " << dbp.string() << (ec ? " is missing" : " is empty")
                               << ": the history of the run's rounds is gone; restore the run folder from a "
                                  "backup, or start the run again with --force");
  }
  // Refused before anything is written: not SQLite, a damaged -wal file, a
  // failed quick_check, another program's database (sqlite::Db).
  sqlite::OpenOptions o;
  o.what = resume ? "resume: run database" : "run database";
  o.tables = {"rounds"};
  o.fsync = false;  // synchronous=NORMAL: a row lost to a power cut is redone from the checkpoint
  o.migrate = migrate_run_db;
  db = std::make_unique<sqlite::Db>(dbp.string(), o);
  // Checkpoint mode: client states reach client_state.db only with a
  // checkpoint, in the same transaction as the run state (set_meta), on the
  // store's background thread; see checkpoint().
  store = open_store(cs.string(), cfg);
  if (resume && store->get_meta(kDroppedKey))
    throw ConfigError("resume: " + dir.string() +
                      " finished with keep_client_state = false: its client states were dropped after the last "
                      "round, so it cannot be continued (its model can still be exported: sparrow-sim export " +
                      dir.string() + "); start a new run, with keep_client_state = true to extend it later");
  if (!resume) {
    std::ofstream(csv) << kCsvHeader;
    std::ofstream(dir / "config.toml") << to_toml(cfg);
  }
}

void Simulator::Impl::commit(const RoundMetrics& m) {
  {
    sqlite::Transaction tx(*db);
    sqlite::Stmt r(*db, "INSERT OR REPLACE INTO rounds VALUES(?,?,?,?,?,?,?,?,?,?,?,?)");
    r.bind(1, m.round)
        .bind_real(2, m.accuracy)
        .bind_real(3, m.loss)
        .bind_real(4, m.train_loss)
        .bind(5, static_cast<int64_t>(m.bytes_up))
        .bind(6, static_cast<int64_t>(m.bytes_down))
        .bind_real(7, m.sim_round_s)
        .bind_real(8, m.real_s)
        .bind(9, m.clients)
        .bind(10, m.dropped)
        .bind_real(11, m.epsilon)
        .bind_real(12, m.clip);
    r.step("write the round's row");
    tx.commit();
  }
  std::ofstream(dir / "metrics.csv", std::ios::app) << csv_row(m);
}

void Simulator::Impl::load_history(int upto) {
  // Rounds after the checkpoint (a crash mid-commit) are forgotten.
  db->exec("DELETE FROM rounds WHERE round > " + std::to_string(upto));
  {
    // Every round up to the checkpoint has its row (they are written before
    // the checkpoint that covers them): fewer means run.db lost history.
    sqlite::Stmt c(*db, "SELECT COUNT(DISTINCT round) FROM rounds WHERE round BETWEEN 1 AND ?");
    c.bind(1, upto);
    const int64_t have = c.step() ? c.i64(0) : 0;
    SPARROW_CHECK_T(FormatError, have == upto,
                    "resume: " << (dir / "run.db").string() << " holds " << have << " of the " << upto
                               << " rounds its checkpoint covers: the run's history is damaged; restore the run "
                                  "folder from a backup, or start the run again with --force");
  }
  sqlite::Stmt r(*db,
                 "SELECT round, accuracy, loss, train_loss, bytes_up, bytes_down, sim_round_s, real_s, clients, "
                 "dropped, epsilon, clip FROM rounds ORDER BY round");
  while (r.step("read the rounds")) {
    RoundMetrics m;
    m.round = static_cast<int>(r.i64(0));
    m.accuracy = r.real(1);
    m.loss = r.real(2);
    m.train_loss = r.real(3);
    m.bytes_up = static_cast<uint64_t>(r.i64(4));
    m.bytes_down = static_cast<uint64_t>(r.i64(5));
    m.sim_round_s = r.real(6);
    m.real_s = r.real(7);
    m.clients = static_cast<int>(r.i64(8));
    m.dropped = static_cast<int>(r.i64(9));
    m.epsilon = r.real(10);
    m.clip = r.real(11);
    history.push_back(m);
  }
  std::ofstream csv(dir / "metrics.csv", std::ios::trunc);
  csv << kCsvHeader;
  for (const auto& m : history) csv << csv_row(m);
}

void Simulator::drop_client_states() {
  Impl& s = *impl_;
  if (s.remote() || !s.store) return;
  s.store->wait_written();  // the last round's checkpoint (step() waits for it after the last round)
  // The checkpoint again into a new file, then renamed over the old one: a
  // crash leaves either the full store or the small one, never neither.
  const fs::path cs = s.store->path();
  const fs::path fresh = cs.string() + ".new";
  remove_db_files(fresh);
  s.store.reset();
  s.store = open_store(fresh.string(), s.cfg);
  s.store->set_meta(kDroppedKey, "dropped");
  s.checkpoint(s.round, /*wait=*/true);
  s.store.reset();  // closing merges its -wal into the file
  remove_db_files(cs);
  fs::rename(fresh, cs);
  s.store = open_store(cs.string(), s.cfg);
}

DiskEstimate estimate_disk(const Simulator& sim) {
  const SimConfig& c = sim.config();
  DiskEstimate e;
  // A copy of the model for a probe of one client's pipeline: the run's own
  // model and every random stream stay untouched (the delta is a fixed pattern).
  federation::Weights w, delta;
  std::vector<std::string> names;
  for (const auto& [n, t] : sim.global()) {
    w[n] = t.detach().to(at::kCPU).to(at::kFloat).clone();
    const int64_t numel = w[n].numel();
    delta[n] = at::arange(numel, at::kFloat).mul_(0.37).sin_().mul_(1e-2).reshape(w[n].sizes());
    names.push_back(n);
  }
  federation::GlobalModel gm(federation::global_config_of(c), w, names);
  const aggregation::ContextMap round_ctx = gm.contexts(1, c.clients_per_round);
  std::map<std::string, compression::Context> ctx;
  for (const auto& n : names)
    ctx[n] = federation::client_context(round_ctx.at(n), /*task_seed=*/1, static_cast<uint32_t>(c.clients_per_round));
  compression::register_builtins();
  const std::unique_ptr<compression::Compressor> codec = compression::make_compressor(c.compression);
  state::ClientState probe;
  federation::make_update(1, "0", 1, names, delta, *codec, probe.compressor, ctx, {}, {});
  const state::Encoding enc = state::parse_encoding(c.state_encoding);  // bf16: half of residuals and controls
  const uint64_t empty = state::ClientState{}.serialize(enc).size();
  const uint64_t with_codec = probe.serialize(enc).size();
  if (c.algorithm == "scaffold")
    for (const auto& n : names) probe.control[n] = at::zeros_like(w[n]);
  e.state_per_client = probe.serialize(enc).size();
  e.codec_state = with_codec - empty;
  e.control_state = e.state_per_client - with_codec;

  // Clients that take part at least once: each round draws clients_per_round
  // of the available ones, so a client is in a round with probability p.
  const double n = c.clients, k = c.clients_per_round, r = c.rounds;
  if (c.effective_sampler("uniform") == "least_recent") {
    e.clients_with_state = std::min(n, k * r);
  } else {
    const double p = std::min(k, c.profiles.availability * n) / n;
    e.clients_with_state = n * (1 - std::pow(1 - p, r));
  }
  // A row's blob spills into full overflow pages: about 100 bytes over its size.
  e.client_states = static_cast<uint64_t>(e.clients_with_state * static_cast<double>(e.state_per_client + 100));

  const uint64_t model = compression::serialize_weights(w).size();
  aggregation::ServerOptimizer opt(c.server_optimizer);
  {
    federation::Weights w2, zero;
    for (const auto& [name, t] : w) {
      w2[name] = t.clone();
      zero[name] = at::zeros_like(t);
    }
    opt.step(w2, zero);
  }
  e.checkpoint = model + opt.serialize_state().size() + (c.algorithm == "scaffold" ? model : 0) +
                 (c.downlink != "none" ? model : 0) + compression::serialize_weights(gm.shared()).size() +
                 to_toml(c).size();
  e.client_state_db = e.client_states + e.checkpoint;
  // A checkpoint commits the states of checkpoint_every rounds (at most the
  // simulator's 512 MiB unflushed budget and a round) in one transaction,
  // which passes through the -wal file.
  const double per_checkpoint = std::min(e.clients_with_state, k * std::max(1, std::min(c.checkpoint_every, c.rounds)));
  const double budget = static_cast<double>(size_t{512} << 20) + k * static_cast<double>(e.state_per_client);
  e.checkpoint_wal =
      static_cast<uint64_t>(std::min(per_checkpoint * static_cast<double>(e.state_per_client), budget)) + e.checkpoint;
  e.history = static_cast<uint64_t>(c.rounds) * 300 + 16 * 1024;  // run.db's rows and pages, metrics.csv
  e.total = e.client_state_db + e.history;
  e.after_run = (c.keep_client_state ? e.client_state_db : e.checkpoint) + e.history;
  return e;
}

std::string disk_estimate_text(const DiskEstimate& e, const SimConfig& cfg) {
  using report_detail::format_bytes;
  auto b = [](uint64_t v) { return format_bytes(static_cast<double>(v)); };
  std::ostringstream os;
  os << "disk: about " << b(e.total) << " in " << cfg.out << ": client_state.db " << b(e.client_state_db) << " (about "
     << std::llround(e.clients_with_state) << " of " << cfg.clients << " clients take part x " << b(e.state_per_client)
     << " of state each" << (cfg.state_encoding == "bf16" ? " in bf16" : "");
  if (e.control_state > 0) os << ": codec " << b(e.codec_state) << ", SCAFFOLD control " << b(e.control_state);
  os << "; checkpoint " << b(e.checkpoint) << "), run.db and metrics.csv " << b(e.history) << "; up to "
     << b(e.checkpoint_wal) << " more in client_state.db-wal while a checkpoint commits";
  if (!cfg.keep_client_state)
    os << "; keep_client_state = false: after the last round only the checkpoint stays (" << b(e.after_run) << ")";
  else if (e.client_states >= 100'000'000)
    os << " (keep_client_state = false drops the client states after the last round)";
  return os.str();
}

}  // namespace sparrow::simulator
