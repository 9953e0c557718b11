#include "edge/cloud_store.h"

#include "core/error.h"
#include "core/sqlite_db.h"

namespace sparrow::edge {
namespace {

constexpr int kSchemaVersion = 1;

const char* kSchema =
    "CREATE TABLE IF NOT EXISTS cloud_meta(key TEXT PRIMARY KEY, value BLOB NOT NULL);"
    "CREATE TABLE IF NOT EXISTS cloud_snapshot(id INTEGER PRIMARY KEY CHECK(id = 1), seq INTEGER NOT NULL, "
    "top BLOB NOT NULL, fed_round INTEGER NOT NULL, fed_task BLOB, checksum INTEGER NOT NULL);"
    "CREATE TABLE IF NOT EXISTS cloud_sessions(client_id TEXT PRIMARY KEY, key TEXT NOT NULL, "
    "last_step INTEGER NOT NULL, last_reply BLOB, codec BLOB, checksum INTEGER NOT NULL);"
    "CREATE TABLE IF NOT EXISTS cloud_log(seq INTEGER PRIMARY KEY, kind INTEGER NOT NULL, client_id TEXT NOT NULL, "
    "key TEXT NOT NULL, number INTEGER NOT NULL, body BLOB, checksum INTEGER NOT NULL);";

std::string num(int64_t v) { return std::to_string(v); }

int64_t snapshot_sum(const CloudSnapshot& s) {
  const std::string seq = num(s.seq), round = num(static_cast<int64_t>(s.fed_round));
  return sqlite::checksum({&seq, &s.top, &round, &s.fed_task});
}
int64_t session_sum(const CloudSessionRow& r, int64_t seq) {
  const std::string step = num(static_cast<int64_t>(r.last_step));
  return sqlite::checksum({&r.client_id, &r.key, &step, &r.last_reply, &r.codec}, seq);
}
int64_t entry_sum(const LogEntry& e) {
  const std::string kind = num(static_cast<int>(e.kind)), n = num(static_cast<int64_t>(e.number));
  return sqlite::checksum({&kind, &e.client_id, &e.key, &n, &e.body}, e.seq);
}

}  // namespace

struct CloudStore::Impl {
  sqlite::Db db;
  int64_t last = 0, snap = 0;
  Impl(const std::string& path, bool fsync)
      : db(path, sqlite::OpenOptions{"split cloud state",
                                     {"cloud_meta", "cloud_snapshot", "cloud_sessions", "cloud_log"},
                                     kSchemaVersion,
                                     fsync,
                                     /*exclusive=*/true}) {}

  std::optional<std::string> meta(const std::string& key) {
    sqlite::Stmt s(db, "SELECT value FROM cloud_meta WHERE key = ?");
    s.bind_text(1, key);
    if (!s.step()) return std::nullopt;
    return s.blob(0);
  }
  void set_meta(const std::string& key, const std::string& value) {
    sqlite::Stmt s(db, "INSERT OR REPLACE INTO cloud_meta(key, value) VALUES(?, ?)");
    s.bind_text(1, key).bind_blob(2, value);
    s.step();
  }
};

CloudStore::CloudStore(const std::string& path, const std::string& label, uint64_t digest, bool fsync)
    : impl_(std::make_unique<Impl>(path, fsync)) {
  auto& db = impl_->db;
  if (db.schema_version_found() < kSchemaVersion) {
    sqlite::Transaction t(db);
    db.exec(kSchema);
    db.exec("PRAGMA user_version=" + std::to_string(kSchemaVersion));
    t.commit();
  }
  const std::string model = label + ";bottom=" + std::to_string(digest);
  if (auto stored = impl_->meta("model")) {
    SPARROW_CHECK_T(ConfigError, *stored == model,
                    "split cloud state '" << path << "' belongs to a cloud of '" << *stored << "', not '" << model
                                          << "': use another state file, or the model it was made for");
  } else {
    impl_->set_meta("model", model);
  }
  {
    sqlite::Stmt s(db, "SELECT COALESCE(MAX(seq), 0) FROM cloud_log");
    s.step();
    impl_->last = s.i64(0);
  }
  {
    sqlite::Stmt s(db, "SELECT seq FROM cloud_snapshot WHERE id = 1");
    if (s.step()) impl_->snap = s.i64(0);
    impl_->last = std::max(impl_->last, impl_->snap);
  }
}

CloudStore::~CloudStore() = default;

const std::string& CloudStore::path() const { return impl_->db.path(); }

std::string CloudStore::run_id(const std::string& fresh) {
  if (auto id = impl_->meta("run_id")) return *id;
  impl_->set_meta("run_id", fresh);
  return fresh;
}

std::string CloudStore::replay_config() { return impl_->meta("replay_config").value_or(""); }
void CloudStore::set_replay_config(const std::string& config) { impl_->set_meta("replay_config", config); }

std::optional<CloudSnapshot> CloudStore::snapshot() {
  auto& db = impl_->db;
  sqlite::Stmt s(db, "SELECT seq, top, fed_round, fed_task, checksum FROM cloud_snapshot WHERE id = 1");
  if (!s.step()) return std::nullopt;
  CloudSnapshot c;
  c.seq = s.i64(0);
  c.top = s.blob(1);
  c.fed_round = static_cast<uint64_t>(s.i64(2));
  c.fed_task = s.blob(3);
  SPARROW_CHECK_T(FormatError, snapshot_sum(c) == s.i64(4),
                  "split cloud state '" << db.path()
                                        << "': the snapshot's checksum does not match (the file was damaged); "
                                           "restore it from a backup, or remove it to start the top afresh");
  sqlite::Stmt r(
      db, "SELECT client_id, key, last_step, last_reply, codec, checksum FROM cloud_sessions ORDER BY client_id");
  while (r.step()) {
    CloudSessionRow row{r.blob(0), r.blob(1), static_cast<uint64_t>(r.i64(2)), r.blob(3), r.blob(4)};
    SPARROW_CHECK_T(FormatError, session_sum(row, c.seq) == r.i64(5),
                    "split cloud state '" << db.path() << "': session '" << row.client_id
                                          << "' fails its checksum (the file was damaged); restore it from a backup");
    c.sessions.push_back(std::move(row));
  }
  return c;
}

std::vector<LogEntry> CloudStore::replay_log(const CloudSnapshot& snap) {
  auto& db = impl_->db;
  sqlite::Stmt s(db,
                 "SELECT seq, kind, client_id, key, number, body, checksum FROM cloud_log WHERE seq > ? OR "
                 "(kind = ? AND number > ?) ORDER BY seq");
  s.bind(1, snap.seq).bind(2, static_cast<int>(LogKind::kUpdate)).bind(3, static_cast<int64_t>(snap.fed_round));
  std::vector<LogEntry> out;
  while (s.step()) {
    LogEntry e;
    e.seq = s.i64(0);
    const int64_t kind = s.i64(1);
    SPARROW_CHECK_T(FormatError, kind >= 1 && kind <= 3,
                    "split cloud state '" << db.path() << "': log entry " << e.seq << " has an unknown kind");
    e.kind = static_cast<LogKind>(kind);
    e.client_id = s.blob(2);
    e.key = s.blob(3);
    e.number = static_cast<uint64_t>(s.i64(4));
    e.body = s.blob(5);
    SPARROW_CHECK_T(FormatError, entry_sum(e) == s.i64(6),
                    "split cloud state '" << db.path() << "': log entry " << e.seq
                                          << " fails its checksum (the file was damaged); restore it from a backup");
    out.push_back(std::move(e));
  }
  return out;
}

int64_t CloudStore::append(LogEntry e) {
  e.seq = impl_->last + 1;
  sqlite::Stmt s(impl_->db,
                 "INSERT INTO cloud_log(seq, kind, client_id, key, number, body, checksum) VALUES(?,?,?,?,?,?,?)");
  s.bind(1, e.seq)
      .bind(2, static_cast<int>(e.kind))
      .bind_text(3, e.client_id)
      .bind_text(4, e.key)
      .bind(5, static_cast<int64_t>(e.number))
      .bind_blob(6, e.body)
      .bind(7, entry_sum(e));
  s.step();  // autocommit: one transaction
  impl_->last = e.seq;
  return e.seq;
}

void CloudStore::drop(int64_t seq) {
  sqlite::Stmt s(impl_->db, "DELETE FROM cloud_log WHERE seq = ?");
  s.bind(1, seq);
  s.step();
}

void CloudStore::write_snapshot(const CloudSnapshot& c) {
  auto& db = impl_->db;
  sqlite::Transaction t(db);
  {
    sqlite::Stmt s(db,
                   "INSERT OR REPLACE INTO cloud_snapshot(id, seq, top, fed_round, fed_task, checksum) "
                   "VALUES(1,?,?,?,?,?)");
    s.bind(1, c.seq).bind_blob(2, c.top).bind(3, static_cast<int64_t>(c.fed_round)).bind_blob(4, c.fed_task);
    s.bind(5, snapshot_sum(c));
    s.step();
  }
  db.exec("DELETE FROM cloud_sessions");
  {
    sqlite::Stmt s(
        db, "INSERT INTO cloud_sessions(client_id, key, last_step, last_reply, codec, checksum) VALUES(?,?,?,?,?,?)");
    for (const auto& r : c.sessions) {
      s.reset();
      s.bind_text(1, r.client_id)
          .bind_text(2, r.key)
          .bind(3, static_cast<int64_t>(r.last_step))
          .bind_blob(4, r.last_reply)
          .bind_blob(5, r.codec)
          .bind(6, session_sum(r, c.seq));
      s.step();
    }
  }
  {
    sqlite::Stmt s(db, "DELETE FROM cloud_log WHERE seq <= ? AND NOT (kind = ? AND number > ?)");
    s.bind(1, c.seq).bind(2, static_cast<int>(LogKind::kUpdate)).bind(3, static_cast<int64_t>(c.fed_round));
    s.step();
  }
  t.commit();
  impl_->snap = c.seq;
  impl_->last = std::max(impl_->last, c.seq);
}

int64_t CloudStore::last_seq() const { return impl_->last; }
int64_t CloudStore::entries_since_snapshot() const { return impl_->last - impl_->snap; }

}  // namespace sparrow::edge
