#include "server/store.h"

#include <algorithm>
#include <utility>

#include "core/error.h"
#include "core/sqlite_db.h"

namespace sparrow::server {
namespace {

// 2: checkpoints.aggregator; 3: checkpoints.checksum; 4: clients.bytes_up/down;
// 5: async_updates (mode = "async": the acknowledged updates of the open buffer)
constexpr int kSchemaVersion = 5;

const char* kSchema =
    "CREATE TABLE IF NOT EXISTS runs(run_id TEXT PRIMARY KEY, config_hash TEXT NOT NULL, config TEXT NOT NULL, "
    "created INTEGER NOT NULL);"
    "CREATE TABLE IF NOT EXISTS rounds(round INTEGER PRIMARY KEY, started REAL, finished REAL, selected INTEGER, "
    "updates INTEGER, rejected INTEGER, stale INTEGER, bytes_in INTEGER, bytes_out INTEGER, train_loss REAL, "
    "eval_loss REAL, eval_accuracy REAL);"
    "CREATE TABLE IF NOT EXISTS metrics(round INTEGER NOT NULL, name TEXT NOT NULL, value REAL, "
    "PRIMARY KEY(round, name));"
    "CREATE TABLE IF NOT EXISTS clients(client_id TEXT PRIMARY KEY, public_key TEXT, first_seen INTEGER, "
    "last_seen INTEGER, last_selected INTEGER, selected INTEGER, updates INTEGER, rejects INTEGER, "
    "num_samples INTEGER, software TEXT, bytes_up INTEGER DEFAULT 0, bytes_down INTEGER DEFAULT 0);"
    "CREATE TABLE IF NOT EXISTS checkpoints(round INTEGER PRIMARY KEY, weights BLOB NOT NULL, server_opt BLOB, "
    "control BLOB, broadcast BLOB, downlink_state BLOB, downlink_last BLOB, acp BLOB, rng TEXT, aggregator BLOB, "
    "checksum INTEGER);"
    "CREATE TABLE IF NOT EXISTS async_updates(seq INTEGER PRIMARY KEY, step INTEGER NOT NULL, "
    "client_id TEXT NOT NULL, body BLOB NOT NULL);";

// Creates the tables of a new file; older files gain the columns their tables
// lack (version 2: checkpoints.aggregator; 3: checkpoints.checksum, NULL for
// their rows, which are then loaded unverified; 4: the clients' byte counts,
// 0 for what came before). In the transaction that writes user_version.
void migrate(sqlite::Db& db, int /*from_version*/) {
  db.exec(kSchema);
  for (const auto& [table, column] :
       std::vector<std::pair<std::string, std::string>>{{"checkpoints", "aggregator BLOB"},
                                                        {"checkpoints", "checksum INTEGER"},
                                                        {"clients", "bytes_up INTEGER DEFAULT 0"},
                                                        {"clients", "bytes_down INTEGER DEFAULT 0"}}) {
    if (!db.has_column(table, column.substr(0, column.find(' '))))
      db.exec("ALTER TABLE " + table + " ADD COLUMN " + column);
  }
}

sqlite::OpenOptions options(bool read_only) {
  sqlite::OpenOptions o;
  o.what = "server database";
  o.owner = "sparrow-server";
  o.tables = {"runs", "rounds", "metrics", "clients", "checkpoints"};
  o.schema_version = kSchemaVersion;
  o.fsync = true;  // FULL: a committed round survives power loss too, not only a process crash
  o.exclusive = true;
  o.existing_needs_tables = true;  // a lost database is not a new run
  o.read_only = read_only;
  if (!read_only) o.migrate = migrate;
  return o;
}

// CRC-32 over the checkpoint's round and every blob, each preceded by its
// length, so that a flipped bit or a moved boundary changes it.
int64_t checkpoint_checksum(const Checkpoint& c) {
  return sqlite::checksum({&c.weights, &c.server_opt, &c.control, &c.broadcast, &c.downlink_state, &c.downlink_last,
                           &c.acp, &c.rng, &c.aggregator},
                          c.round);
}

}  // namespace

struct ServerStore::Impl {
  sqlite::Db db;
  std::vector<int64_t> damaged;  // latest_checkpoint's skipped rounds
  Impl(const std::string& path, bool read_only) : db(path, options(read_only)) {}
};

ServerStore::ServerStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ServerStore::~ServerStore() = default;
const std::string& ServerStore::path() const { return impl_->db.path(); }

std::unique_ptr<ServerStore> ServerStore::open(const std::string& path) {
  return std::unique_ptr<ServerStore>(new ServerStore(std::make_unique<Impl>(path, /*read_only=*/false)));
}

std::unique_ptr<ServerStore> ServerStore::open_readonly(const std::string& path) {
  auto impl = std::make_unique<Impl>(path, /*read_only=*/true);
  // A version 1 file (checkpoints only) has nothing status could show.
  SPARROW_CHECK_T(FormatError, impl->db.has_column("runs", "run_id"),
                  "server database '" << path << "' has no runs table");
  return std::unique_ptr<ServerStore>(new ServerStore(std::move(impl)));
}

std::optional<RunRow> ServerStore::run() {
  sqlite::Stmt s(impl_->db, "SELECT run_id, config_hash, config, created FROM runs ORDER BY created LIMIT 1");
  if (!s.step()) return std::nullopt;
  return RunRow{s.blob(0), s.blob(1), s.blob(2), s.i64(3)};
}

void ServerStore::create_run(const RunRow& run) {
  sqlite::Stmt s(impl_->db, "INSERT INTO runs(run_id, config_hash, config, created) VALUES(?,?,?,?)");
  s.bind_text(1, run.run_id).bind_text(2, run.config_hash).bind_text(3, run.config).bind(4, run.created);
  s.step();
}

void ServerStore::commit_round(const RoundRow& r, const std::map<std::string, double>& metrics, const Checkpoint& c,
                               const std::vector<ClientRow>& clients, int keep) {
  SPARROW_CHECK(r.round == c.round, "commit_round: round " << r.round << " with checkpoint of " << c.round);
  sqlite::Transaction t(impl_->db);
  {
    sqlite::Stmt s(
        impl_->db,
        "INSERT OR REPLACE INTO rounds(round, started, finished, selected, updates, rejected, stale, bytes_in, "
        "bytes_out, train_loss, eval_loss, eval_accuracy) VALUES(?,?,?,?,?,?,?,?,?,?,?,?)");
    s.bind(1, r.round)
        .bind_real(2, r.started)
        .bind_real(3, r.finished)
        .bind(4, r.selected)
        .bind(5, r.updates)
        .bind(6, r.rejected)
        .bind(7, r.stale)
        .bind(8, static_cast<int64_t>(r.bytes_in))
        .bind(9, static_cast<int64_t>(r.bytes_out))
        .bind_real(10, r.train_loss)
        .bind_real(11, r.eval_loss)
        .bind_real(12, r.eval_accuracy);
    s.step();
  }
  for (const auto& [name, value] : metrics) {
    sqlite::Stmt s(impl_->db, "INSERT OR REPLACE INTO metrics(round, name, value) VALUES(?,?,?)");
    s.bind(1, r.round).bind_text(2, name).bind_real(3, value);
    s.step();
  }
  {
    sqlite::Stmt s(impl_->db,
                   "INSERT OR REPLACE INTO checkpoints(round, weights, server_opt, control, broadcast, downlink_state, "
                   "downlink_last, acp, rng, aggregator, checksum) VALUES(?,?,?,?,?,?,?,?,?,?,?)");
    s.bind(1, c.round)
        .bind_blob(2, c.weights)
        .bind_blob(3, c.server_opt)
        .bind_blob(4, c.control)
        .bind_blob(5, c.broadcast)
        .bind_blob(6, c.downlink_state)
        .bind_blob(7, c.downlink_last)
        .bind_blob(8, c.acp)
        .bind_text(9, c.rng)
        .bind_blob(10, c.aggregator)
        .bind(11, checkpoint_checksum(c));
    s.step();
  }
  {
    sqlite::Stmt s(
        impl_->db,
        "DELETE FROM checkpoints WHERE round NOT IN (SELECT round FROM checkpoints ORDER BY round DESC LIMIT ?)");
    s.bind(1, std::max(1, keep));
    s.step();
  }
  {
    // Mode "async": the updates of this step's buffer are in the checkpoint now.
    // (Rows of step r written after this step's checkpoint, by a batch that
    // was taken before it, are dropped at the next resume and commit.)
    sqlite::Stmt s(impl_->db, "DELETE FROM async_updates WHERE step <= ?");
    s.bind(1, r.round);
    s.step();
  }
  write_clients(clients);
  t.commit();  // the destructor rolls back whatever failed before
}

void ServerStore::put_async_updates(const std::vector<const AsyncUpdateRow*>& rows) {
  sqlite::Transaction t(impl_->db);
  sqlite::Stmt s(impl_->db, "INSERT INTO async_updates(step, client_id, body) VALUES(?,?,?)");
  for (const AsyncUpdateRow* r : rows) {
    s.bind(1, r->step).bind_text(2, r->client_id).bind_blob(3, r->body);
    s.step("write an acknowledged update");
    s.reset();
  }
  t.commit();
}

std::vector<AsyncUpdateRow> ServerStore::async_updates() {
  std::vector<AsyncUpdateRow> out;
  if (!impl_->db.has_column("async_updates", "seq")) return out;  // a read-only open of an older file
  sqlite::Stmt s(impl_->db, "SELECT seq, step, client_id, body FROM async_updates ORDER BY seq");
  while (s.step()) out.push_back({s.i64(0), s.i64(1), s.blob(2), s.blob(3)});
  return out;
}

void ServerStore::put_clients(const std::vector<ClientRow>& clients) {
  sqlite::Transaction t(impl_->db);
  write_clients(clients);
  t.commit();
}

void ServerStore::write_clients(const std::vector<ClientRow>& clients) {
  // One statement prepared for all the rows (a checkpoint writes every client).
  sqlite::Stmt s(
      impl_->db,
      "INSERT OR REPLACE INTO clients(client_id, public_key, first_seen, last_seen, last_selected, selected, "
      "updates, rejects, num_samples, software, bytes_up, bytes_down) VALUES(?,?,?,?,?,?,?,?,?,?,?,?)");
  for (const ClientRow& c : clients) {
    s.bind_text(1, c.client_id)
        .bind_text(2, c.public_key)
        .bind(3, c.first_seen)
        .bind(4, c.last_seen)
        .bind(5, c.last_selected)
        .bind(6, c.selected)
        .bind(7, c.updates)
        .bind(8, c.rejects)
        .bind(9, static_cast<int64_t>(c.num_samples))
        .bind_text(10, c.software)
        .bind(11, static_cast<int64_t>(c.bytes_up))
        .bind(12, static_cast<int64_t>(c.bytes_down));
    s.step();
    s.reset();
  }
}

std::optional<Checkpoint> ServerStore::latest_checkpoint() {
  // Newest first; a checkpoint whose checksum does not match its blobs is
  // skipped (and reported), so the run resumes from the newest good one.
  sqlite::Stmt s(
      impl_->db,
      "SELECT round, weights, server_opt, control, broadcast, downlink_state, downlink_last, acp, rng, aggregator, "
      "checksum FROM checkpoints ORDER BY round DESC");
  impl_->damaged.clear();
  while (s.step()) {
    Checkpoint c;
    c.round = s.i64(0);
    c.weights = s.blob(1);
    c.server_opt = s.blob(2);
    c.control = s.blob(3);
    c.broadcast = s.blob(4);
    c.downlink_state = s.blob(5);
    c.downlink_last = s.blob(6);
    c.acp = s.blob(7);
    c.rng = s.blob(8);
    c.aggregator = s.blob(9);
    if (s.is_null(10) || s.i64(10) == checkpoint_checksum(c)) return c;  // NULL: written before checksums
    impl_->damaged.push_back(c.round);
  }
  SPARROW_CHECK_T(FormatError, impl_->damaged.empty(),
                  "server database '" << impl_->db.path() << "': every checkpoint fails its checksum (newest round "
                                      << impl_->damaged.front()
                                      << "); the database is damaged: restore it from a backup (docs/server.md)");
  return std::nullopt;
}

std::vector<int64_t> ServerStore::damaged_checkpoints() const { return impl_->damaged; }

int64_t ServerStore::completed_rounds() {
  sqlite::Stmt s(impl_->db, "SELECT COALESCE(MAX(round), 0) FROM rounds");
  s.step();
  return s.i64(0);
}

std::vector<RoundRow> ServerStore::rounds() {
  sqlite::Stmt s(
      impl_->db,
      "SELECT round, started, finished, selected, updates, rejected, stale, bytes_in, bytes_out, train_loss, "
      "eval_loss, eval_accuracy FROM rounds ORDER BY round");
  std::vector<RoundRow> out;
  while (s.step()) {
    RoundRow r;
    r.round = s.i64(0);
    r.started = s.real(1);
    r.finished = s.real(2);
    r.selected = s.i64(3);
    r.updates = s.i64(4);
    r.rejected = s.i64(5);
    r.stale = s.i64(6);
    r.bytes_in = static_cast<uint64_t>(s.i64(7));
    r.bytes_out = static_cast<uint64_t>(s.i64(8));
    r.train_loss = s.real(9);
    r.eval_loss = s.real(10);
    r.eval_accuracy = s.real(11);
    out.push_back(r);
  }
  return out;
}

std::vector<ClientRow> ServerStore::clients() {
  // A read-only open of an older database has no byte columns (0 then).
  const bool bytes = impl_->db.has_column("clients", "bytes_up") && impl_->db.has_column("clients", "bytes_down");
  const std::string sql =
      std::string(
          "SELECT client_id, public_key, first_seen, last_seen, last_selected, selected, updates, rejects, "
          "num_samples, software") +
      (bytes ? ", bytes_up, bytes_down" : "") + " FROM clients ORDER BY client_id";
  sqlite::Stmt s(impl_->db, sql);
  std::vector<ClientRow> out;
  while (s.step()) {
    ClientRow c;
    c.client_id = s.blob(0);
    c.public_key = s.blob(1);
    c.first_seen = s.i64(2);
    c.last_seen = s.i64(3);
    c.last_selected = s.i64(4);
    c.selected = s.i64(5);
    c.updates = s.i64(6);
    c.rejects = s.i64(7);
    c.num_samples = static_cast<uint64_t>(s.i64(8));
    c.software = s.blob(9);
    if (bytes) {
      c.bytes_up = static_cast<uint64_t>(s.i64(10));
      c.bytes_down = static_cast<uint64_t>(s.i64(11));
    }
    out.push_back(c);
  }
  return out;
}

std::map<std::string, double> ServerStore::metrics(int64_t round) {
  sqlite::Stmt s(impl_->db, "SELECT name, value FROM metrics WHERE round = ? ORDER BY name");
  s.bind(1, round);
  std::map<std::string, double> out;
  while (s.step()) out[s.blob(0)] = s.real(1);
  return out;
}

std::map<int64_t, double> ServerStore::metric_series(const std::string& name) {
  sqlite::Stmt s(impl_->db, "SELECT round, value FROM metrics WHERE name = ? ORDER BY round");
  s.bind_text(1, name);
  std::map<int64_t, double> out;
  while (s.step()) out[s.i64(0)] = s.real(1);
  return out;
}

}  // namespace sparrow::server
