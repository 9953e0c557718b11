// sparrow-sim --resume refuses what would mix two experiments or lose history
// (issue 48, items 2 and 3): an edited config.toml, and a deleted, emptied or
// truncated run.db. Real sparrow-sim runs on the synthetic data set (seconds).
#include "tests/integration/fixtures.h"

using namespace sparrow::testing::integ;  // NOLINT(google-build-using-namespace)

namespace {

const std::string kSimBin = kBin + "/sparrow-sim";

// A 4-round run in DIR/run checkpointed every round, then stopped: what the
// resume cases below start from (rounds = 4, resumed with --set rounds=6).
std::string finished_run(const std::string& name) {
  const std::string dir = fresh_dir(name);
  write_file(dir + "/x.toml",
             "seed = 3\ndataset = \"synthetic:alpha=0.5,beta=0.5\"\nclients = 20\nclients_per_round = 4\n"
             "rounds = 4\nmodel = \"logreg\"\nlocal_epochs = 1\nbatch_size = 10\nlr = 0.05\neval_every = 2\n"
             "workers = 1\nout = \"" +
                 dir + "/run\"\n");
  REQUIRE(run_tool({kSimBin, "--config", dir + "/x.toml"}, dir + "/first.log") == 0);
  return dir;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// Replaces the line starting with `key = ` in the run's config.toml.
void edit_config(const std::string& run, const std::string& key, const std::string& value) {
  std::istringstream in(read_file(run + "/config.toml"));
  std::string out, line;
  bool found = false;
  while (std::getline(in, line)) {
    if (line.rfind(key + " = ", 0) == 0) {
      line = key + " = " + value;
      found = true;
    }
    out += line + "\n";
  }
  REQUIRE_MESSAGE(found, key);
  write_file(run + "/config.toml", out);
}

int64_t rounds_in(const std::string& db_path) {
  sqlite3* h = nullptr;
  REQUIRE(sqlite3_open_v2(db_path.c_str(), &h, SQLITE_OPEN_READONLY, nullptr) == SQLITE_OK);
  sqlite3_stmt* st = nullptr;
  int64_t n = -1;
  if (sqlite3_prepare_v2(h, "SELECT COUNT(*) FROM rounds", -1, &st, nullptr) == SQLITE_OK &&
      sqlite3_step(st) == SQLITE_ROW)
    n = sqlite3_column_int64(st, 0);
  sqlite3_finalize(st);
  sqlite3_close(h);
  return n;
}

}  // namespace

TEST_CASE("sim resume: an edited config.toml is refused, naming each changed key") {
  const std::string dir = finished_run("resume_edit");
  const std::string run = dir + "/run";
  const std::string before = read_file(run + "/metrics.csv");
  struct Edit {
    std::string key, value;
  };
  for (const Edit& e : {Edit{"lr", "0.1"}, Edit{"seed", "4"}, Edit{"clients", "25"}, Edit{"batch_size", "17"}}) {
    INFO(e.key);
    const std::string saved = read_file(run + "/config.toml");
    edit_config(run, e.key, e.value);
    const std::string log = dir + "/resume_" + e.key + ".log";
    CHECK(run_tool({kSimBin, "--resume", run, "--set", "rounds=6"}, log) == 2);
    const std::string text = read_file(log);
    CHECK_MESSAGE(text.find("differs from the one its checkpoint was taken under") != std::string::npos, text);
    CHECK_MESSAGE(text.find(e.key + " (") != std::string::npos, text);
    CHECK(read_file(run + "/metrics.csv") == before);  // nothing ran
    write_file(run + "/config.toml", saved);
  }
  // Keys documented as safe (rounds, threads) still resume, and the run goes on.
  edit_config(run, "threads", "1");
  CHECK(run_tool({kSimBin, "--resume", run, "--set", "rounds=5"}, dir + "/resume_ok.log") == 0);
  CHECK(read_file(run + "/metrics.csv").size() > before.size());
}

TEST_CASE("sim resume: a deleted, empty or truncated run.db is refused instead of losing the history") {
  const std::string dir = finished_run("resume_db");
  const std::string run = dir + "/run";
  REQUIRE(rounds_in(run + "/run.db") == 4);
  const fs::path db = run + "/run.db", keep = dir + "/run.db.keep";
  fs::copy_file(db, keep);
  auto resume = [&](const std::string& name) {
    const std::string log = dir + "/" + name + ".log";
    const int rc = run_tool({kSimBin, "--resume", run, "--set", "rounds=6"}, log);
    return std::make_pair(rc, read_file(log));
  };
  SUBCASE("deleted") {
    fs::remove(db);
    fs::remove(db.string() + "-wal");
    fs::remove(db.string() + "-shm");
    const auto [rc, text] = resume("deleted");
    CHECK(rc == 2);
    const std::string log = text;  // (a structured binding cannot be captured before C++20: clang)
    CHECK_MESSAGE(log.find(db.string() + " is missing") != std::string::npos, log);
    CHECK(!fs::exists(db));
  }
  SUBCASE("empty") {
    fs::remove(db.string() + "-wal");
    fs::remove(db.string() + "-shm");
    write_file(db.string(), "");
    const auto [rc, text] = resume("empty");
    CHECK(rc == 2);
    const std::string log = text;
    CHECK_MESSAGE(log.find(db.string() + " is empty") != std::string::npos, log);
    CHECK(fs::file_size(db) == 0);
  }
  SUBCASE("rounds deleted") {
    {
      sqlite3* h = nullptr;
      REQUIRE(sqlite3_open(db.c_str(), &h) == SQLITE_OK);
      REQUIRE(sqlite3_exec(h, "DELETE FROM rounds WHERE round <= 2", nullptr, nullptr, nullptr) == SQLITE_OK);
      sqlite3_close(h);
    }
    const auto [rc, text] = resume("rounds_deleted");
    CHECK(rc != 0);
    const std::string log = text;
    CHECK_MESSAGE(log.find("holds 2 of the 4 rounds its checkpoint covers") != std::string::npos, log);
  }
}
