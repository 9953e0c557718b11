// The run folder's record of the rounds: run.db (table `rounds`, one row per
// completed round, written before the checkpoint that covers it), metrics.csv
// (the same rows as text) and config.toml; and the summary line sparrow-sim
// prints last. Client states and checkpoints live in client_state.db
// (checkpoint.cc).
#include <cmath>
#include <fstream>
#include <iomanip>
#include <sstream>

#include "core/error.h"
#include "simulator/impl.h"

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
    for (const auto& p : {dbp, csv, cs}) {
      fs::remove(p);
      fs::remove(p.string() + "-wal");
      fs::remove(p.string() + "-shm");
    }
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
  state::ClientStateStore::Options so;
  so.background = true;
  so.explicit_flush = true;
  store = state::ClientStateStore::open(cs.string(), so);
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

}  // namespace sparrow::simulator
