#include "server/store.h"

#include <fcntl.h>
#include <sqlite3.h>
#include <sys/file.h>
#include <unistd.h>
#include <zlib.h>

#include <cmath>
#include <filesystem>
#include <limits>

#include "core/error.h"
#include "core/sqlite_db.h"

namespace sparrow::server {
namespace {

constexpr int kSchemaVersion = 4;  // 2: checkpoints.aggregator; 3: checkpoints.checksum; 4: clients.bytes_up/down

[[noreturn]] void throw_sqlite(sqlite3* db, const std::string& path, const std::string& what, int rc) {
  const std::string detail = db ? sqlite3_errmsg(db) : sqlite3_errstr(rc);
  if ((rc & 0xff) == SQLITE_NOTADB || (rc & 0xff) == SQLITE_CORRUPT)
    throw FormatError("server database '" + path + "': " + what + ": " + detail);
  throw Error("server database '" + path + "': " + what + ": " + detail + " (sqlite code " + std::to_string(rc) + ")");
}

class Stmt {
 public:
  Stmt(sqlite3* db, const std::string& path, const char* sql) : db_(db), path_(path) {
    const int rc = sqlite3_prepare_v2(db, sql, -1, &st_, nullptr);
    if (rc != SQLITE_OK) throw_sqlite(db, path, std::string("prepare '") + sql + "'", rc);
  }
  ~Stmt() { sqlite3_finalize(st_); }
  Stmt(const Stmt&) = delete;
  Stmt& operator=(const Stmt&) = delete;

  Stmt& bind(int i, int64_t v) {
    sqlite3_bind_int64(st_, i, v);
    return *this;
  }
  Stmt& bind_real(int i, double v) {
    if (std::isnan(v))
      sqlite3_bind_null(st_, i);
    else
      sqlite3_bind_double(st_, i, v);
    return *this;
  }
  Stmt& bind_text(int i, const std::string& v) {
    sqlite3_bind_text(st_, i, v.data(), static_cast<int>(v.size()), SQLITE_TRANSIENT);
    return *this;
  }
  Stmt& bind_blob(int i, const std::string& v) {
    if (v.empty())
      sqlite3_bind_zeroblob(st_, i, 0);
    else
      sqlite3_bind_blob64(st_, i, v.data(), v.size(), SQLITE_STATIC);
    return *this;
  }
  bool step() {
    const int rc = sqlite3_step(st_);
    if (rc == SQLITE_ROW) return true;
    if (rc == SQLITE_DONE) return false;
    throw_sqlite(db_, path_, "step", rc);
  }
  int64_t i64(int c) const { return sqlite3_column_int64(st_, c); }
  bool is_null(int c) const { return sqlite3_column_type(st_, c) == SQLITE_NULL; }
  double real(int c) const {
    return sqlite3_column_type(st_, c) == SQLITE_NULL ? std::numeric_limits<double>::quiet_NaN()
                                                      : sqlite3_column_double(st_, c);
  }
  std::string text(int c) const {
    const void* p = sqlite3_column_blob(st_, c);
    const int n = sqlite3_column_bytes(st_, c);
    return p ? std::string(static_cast<const char*>(p), static_cast<size_t>(n)) : std::string();
  }

 private:
  sqlite3* db_;
  std::string path_;
  sqlite3_stmt* st_ = nullptr;
};

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
    "checksum INTEGER);";

// CRC-32 (zlib) over the checkpoint's round and every blob, each preceded by
// its length, so that a flipped bit or a moved boundary changes it.
int64_t checkpoint_checksum(const Checkpoint& c) {
  uLong crc = crc32_z(0L, Z_NULL, 0);
  auto add = [&crc](const void* p, size_t n) { crc = crc32_z(crc, static_cast<const Bytef*>(p), n); };
  const int64_t round = c.round;
  add(&round, sizeof round);
  for (const std::string* f : {&c.weights, &c.server_opt, &c.control, &c.broadcast, &c.downlink_state, &c.downlink_last,
                               &c.acp, &c.rng, &c.aggregator}) {
    const uint64_t n = f->size();
    add(&n, sizeof n);
    add(f->data(), f->size());
  }
  return static_cast<int64_t>(crc);
}

}  // namespace

struct ServerStore::Impl {
  std::string path;
  sqlite3* db = nullptr;
  int lock_fd = -1;              // flock: one server per database
  std::vector<int64_t> damaged;  // latest_checkpoint's skipped rounds
  ~Impl() {
    if (db) sqlite3_close_v2(db);
    if (lock_fd >= 0) ::close(lock_fd);
  }
  void exec(const char* sql) {
    char* err = nullptr;
    const int rc = sqlite3_exec(db, sql, nullptr, nullptr, &err);
    if (err) sqlite3_free(err);
    if (rc != SQLITE_OK) throw_sqlite(db, path, std::string("'") + sql + "'", rc);
  }
};

namespace {
bool has_column(ServerStore::Impl& impl, const std::string& table, const std::string& column) {
  Stmt cols(impl.db, impl.path,
            ("SELECT COUNT(*) FROM pragma_table_info('" + table + "') WHERE name = '" + column + "'").c_str());
  cols.step();
  return cols.i64(0) > 0;
}
}  // namespace

ServerStore::ServerStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ServerStore::~ServerStore() = default;
const std::string& ServerStore::path() const { return impl_->path; }

std::unique_ptr<ServerStore> ServerStore::open(const std::string& path) {
  // Before SQLite touches the file: a folder, a file of 0 bytes (a lost
  // database is not a new run), a file that is not SQLite (SQLite would take
  // a short one as a new database and write over it), a damaged -wal file.
  const bool existed = std::filesystem::exists(path);
  sqlite::check_before_open(path, "server database");
  auto impl = std::make_unique<Impl>();
  impl->path = path;
  const int rc = sqlite3_open_v2(path.c_str(), &impl->db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE, nullptr);
  if (rc != SQLITE_OK) throw_sqlite(impl->db, path, "open", rc);
  // One server per database, held until the store closes. flock() locks are
  // apart from SQLite's fcntl() locks: `sparrow-server status` and
  // `sqlite3 DB .backup` still read the file while a server holds it.
  impl->lock_fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  SPARROW_CHECK_T(Error, impl->lock_fd >= 0, "server database '" << path << "': cannot open it to lock it");
  SPARROW_CHECK_T(ConfigError, ::flock(impl->lock_fd, LOCK_EX | LOCK_NB) == 0,
                  "server database '" << path
                                      << "' is in use by another sparrow-server (locked); stop that server or use "
                                         "another db");
  sqlite3_extended_result_codes(impl->db, 1);
  sqlite3_busy_timeout(impl->db, 5000);
  {
    Stmt v(impl->db, path, "PRAGMA user_version");  // reads the header: a non-SQLite file fails here
    v.step();
    const int64_t version = v.i64(0);
    SPARROW_CHECK_T(FormatError, version <= kSchemaVersion,
                    "server database '" << path << "': schema version " << version << " is newer than this build ("
                                        << kSchemaVersion << ")");
  }
  {
    // The whole file's structure (pages, b-trees, indexes), before anything
    // is read from it or written to it.
    Stmt q(impl->db, path, "PRAGMA quick_check");
    std::string result = q.step() ? q.text(0) : std::string("no result");
    SPARROW_CHECK_T(FormatError, result == "ok",
                    "server database '" << path << "' is damaged (SQLite quick_check: " << result
                                        << "); restore it from a backup (docs/server.md)");
  }
  {
    // A database of something else: tables, none of them this server's.
    Stmt t(impl->db, path,
           "SELECT (SELECT COUNT(*) FROM sqlite_master WHERE type = 'table'), "
           "(SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name IN "
           "('runs', 'rounds', 'metrics', 'clients', 'checkpoints'))");
    t.step();
    SPARROW_CHECK_T(ConfigError, t.i64(0) == 0 || t.i64(1) > 0,
                    "server database '" << path << "' is an SQLite database of something else (" << t.i64(0)
                                        << " tables, none of a sparrow-server run): use another path");
    // An existing file is written to only when it is a server database: an
    // SQLite file without tables is someone's too.
    SPARROW_CHECK_T(ConfigError, !existed || t.i64(0) > 0,
                    "server database '" << path
                                        << "' exists but is not a sparrow-server database (no tables); nothing was "
                                           "written to it: use another path, or remove the file to start a new run");
  }
  impl->exec("PRAGMA journal_mode=WAL");
  // FULL: a committed round survives power loss too, not only a process crash.
  impl->exec("PRAGMA synchronous=FULL");
  impl->exec(kSchema);
  // Older databases: columns their tables lack (version 2: checkpoints.aggregator;
  // 3: checkpoints.checksum, NULL for their rows, which are then loaded
  // unverified; 4: the clients' byte counts, 0 for what came before).
  for (const auto& [table, column] :
       std::vector<std::pair<std::string, std::string>>{{"checkpoints", "aggregator BLOB"},
                                                        {"checkpoints", "checksum INTEGER"},
                                                        {"clients", "bytes_up INTEGER DEFAULT 0"},
                                                        {"clients", "bytes_down INTEGER DEFAULT 0"}}) {
    if (!has_column(*impl, table, column.substr(0, column.find(' '))))
      impl->exec(("ALTER TABLE " + table + " ADD COLUMN " + column).c_str());
  }
  impl->exec(("PRAGMA user_version=" + std::to_string(kSchemaVersion)).c_str());
  return std::unique_ptr<ServerStore>(new ServerStore(std::move(impl)));
}

std::unique_ptr<ServerStore> ServerStore::open_readonly(const std::string& path) {
  SPARROW_CHECK_T(ConfigError, !std::filesystem::is_directory(path),
                  "server database '" << path << "' is a folder, not a file");
  SPARROW_CHECK_T(ConfigError, std::filesystem::exists(path), "server database '" << path << "' does not exist");
  {
    // The -wal check only when no server holds the file: a running server
    // checked it at its start and may be rewriting the log while it is read.
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    const bool idle = fd >= 0 && ::flock(fd, LOCK_SH | LOCK_NB) == 0;
    if (fd >= 0) ::close(fd);
    if (idle) sqlite::check_before_open(path, "server database");
  }
  auto impl = std::make_unique<Impl>();
  impl->path = path;
  const int rc = sqlite3_open_v2(path.c_str(), &impl->db, SQLITE_OPEN_READONLY, nullptr);
  if (rc != SQLITE_OK) throw_sqlite(impl->db, path, "open", rc);
  sqlite3_extended_result_codes(impl->db, 1);
  sqlite3_busy_timeout(impl->db, 5000);
  Stmt v(impl->db, path, "SELECT count(*) FROM sqlite_master WHERE name='runs'");
  v.step();
  SPARROW_CHECK_T(FormatError, v.i64(0) == 1, "server database '" << path << "' has no runs table");
  return std::unique_ptr<ServerStore>(new ServerStore(std::move(impl)));
}

std::optional<RunRow> ServerStore::run() {
  Stmt s(impl_->db, impl_->path, "SELECT run_id, config_hash, config, created FROM runs ORDER BY created LIMIT 1");
  if (!s.step()) return std::nullopt;
  return RunRow{s.text(0), s.text(1), s.text(2), s.i64(3)};
}

void ServerStore::create_run(const RunRow& run) {
  Stmt s(impl_->db, impl_->path, "INSERT INTO runs(run_id, config_hash, config, created) VALUES(?,?,?,?)");
  s.bind_text(1, run.run_id).bind_text(2, run.config_hash).bind_text(3, run.config).bind(4, run.created);
  s.step();
}

void ServerStore::commit_round(const RoundRow& r, const std::map<std::string, double>& metrics, const Checkpoint& c,
                               const std::vector<ClientRow>& clients, int keep) {
  SPARROW_CHECK(r.round == c.round, "commit_round: round " << r.round << " with checkpoint of " << c.round);
  impl_->exec("BEGIN IMMEDIATE");
  try {
    {
      Stmt s(impl_->db, impl_->path,
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
      Stmt s(impl_->db, impl_->path, "INSERT OR REPLACE INTO metrics(round, name, value) VALUES(?,?,?)");
      s.bind(1, r.round).bind_text(2, name).bind_real(3, value);
      s.step();
    }
    {
      Stmt s(impl_->db, impl_->path,
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
      Stmt s(impl_->db, impl_->path,
             "DELETE FROM checkpoints WHERE round NOT IN (SELECT round FROM checkpoints ORDER BY round DESC LIMIT ?)");
      s.bind(1, std::max(1, keep));
      s.step();
    }
    write_clients(clients);
    impl_->exec("COMMIT");
  } catch (...) {
    sqlite3_exec(impl_->db, "ROLLBACK", nullptr, nullptr, nullptr);
    throw;
  }
}

void ServerStore::put_clients(const std::vector<ClientRow>& clients) {
  impl_->exec("BEGIN IMMEDIATE");
  try {
    write_clients(clients);
    impl_->exec("COMMIT");
  } catch (...) {
    sqlite3_exec(impl_->db, "ROLLBACK", nullptr, nullptr, nullptr);
    throw;
  }
}

void ServerStore::write_clients(const std::vector<ClientRow>& clients) {
  for (const ClientRow& c : clients) {
    Stmt s(impl_->db, impl_->path,
           "INSERT OR REPLACE INTO clients(client_id, public_key, first_seen, last_seen, last_selected, selected, "
           "updates, rejects, num_samples, software, bytes_up, bytes_down) VALUES(?,?,?,?,?,?,?,?,?,?,?,?)");
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
  }
}

std::optional<Checkpoint> ServerStore::latest_checkpoint() {
  // Newest first; a checkpoint whose checksum does not match its blobs is
  // skipped (and reported), so the run resumes from the newest good one.
  Stmt s(impl_->db, impl_->path,
         "SELECT round, weights, server_opt, control, broadcast, downlink_state, downlink_last, acp, rng, aggregator, "
         "checksum FROM checkpoints ORDER BY round DESC");
  impl_->damaged.clear();
  while (s.step()) {
    Checkpoint c;
    c.round = s.i64(0);
    c.weights = s.text(1);
    c.server_opt = s.text(2);
    c.control = s.text(3);
    c.broadcast = s.text(4);
    c.downlink_state = s.text(5);
    c.downlink_last = s.text(6);
    c.acp = s.text(7);
    c.rng = s.text(8);
    c.aggregator = s.text(9);
    if (s.is_null(10) || s.i64(10) == checkpoint_checksum(c)) return c;  // NULL: written before checksums
    impl_->damaged.push_back(c.round);
  }
  SPARROW_CHECK_T(FormatError, impl_->damaged.empty(),
                  "server database '" << impl_->path << "': every checkpoint fails its checksum (newest round "
                                      << impl_->damaged.front()
                                      << "); the database is damaged: restore it from a backup (docs/server.md)");
  return std::nullopt;
}

std::vector<int64_t> ServerStore::damaged_checkpoints() const { return impl_->damaged; }

int64_t ServerStore::completed_rounds() {
  Stmt s(impl_->db, impl_->path, "SELECT COALESCE(MAX(round), 0) FROM rounds");
  s.step();
  return s.i64(0);
}

std::vector<RoundRow> ServerStore::rounds() {
  Stmt s(impl_->db, impl_->path,
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
  const bool bytes = has_column(*impl_, "clients", "bytes_up") && has_column(*impl_, "clients", "bytes_down");
  const std::string sql =
      std::string(
          "SELECT client_id, public_key, first_seen, last_seen, last_selected, selected, updates, rejects, "
          "num_samples, software") +
      (bytes ? ", bytes_up, bytes_down" : "") + " FROM clients ORDER BY client_id";
  Stmt s(impl_->db, impl_->path, sql.c_str());
  std::vector<ClientRow> out;
  while (s.step()) {
    ClientRow c;
    c.client_id = s.text(0);
    c.public_key = s.text(1);
    c.first_seen = s.i64(2);
    c.last_seen = s.i64(3);
    c.last_selected = s.i64(4);
    c.selected = s.i64(5);
    c.updates = s.i64(6);
    c.rejects = s.i64(7);
    c.num_samples = static_cast<uint64_t>(s.i64(8));
    c.software = s.text(9);
    if (bytes) {
      c.bytes_up = static_cast<uint64_t>(s.i64(10));
      c.bytes_down = static_cast<uint64_t>(s.i64(11));
    }
    out.push_back(c);
  }
  return out;
}

std::map<std::string, double> ServerStore::metrics(int64_t round) {
  Stmt s(impl_->db, impl_->path, "SELECT name, value FROM metrics WHERE round = ? ORDER BY name");
  s.bind(1, round);
  std::map<std::string, double> out;
  while (s.step()) out[s.text(0)] = s.real(1);
  return out;
}

std::map<int64_t, double> ServerStore::metric_series(const std::string& name) {
  Stmt s(impl_->db, impl_->path, "SELECT round, value FROM metrics WHERE name = ? ORDER BY round");
  s.bind_text(1, name);
  std::map<int64_t, double> out;
  while (s.step()) out[s.i64(0)] = s.real(1);
  return out;
}

}  // namespace sparrow::server
