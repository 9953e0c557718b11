#include "tests/sparrow_test.h"

#include <ATen/ATen.h>
#include <sqlite3.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/sqlite_db.h"
#include "state/client_state.h"
#include "state/store.h"
#include "tests/core/full_disk_vfs.h"
#include "tests/state/temp_db.h"

using sparrow::state::ClientState;
using sparrow::state::ClientStateStore;

namespace {

using sparrow::state::testing::TempDb;

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

ClientState rich_state(uint64_t seed) {
  at::manual_seed(seed);
  ClientState s;
  s.rng = 0x1234567890abcdefULL + seed;
  s.rounds = 17 + seed;
  sparrow::compression::State w;
  w.step = 3;
  w.last_round = 40 + static_cast<int64_t>(seed);  // the stale-residual policy's clock
  w.tensors["residual"] = at::randn({4, 5});
  w.tensors["u"] = at::randn({4, 5});
  sparrow::compression::State b;
  b.step = 1;
  b.tensors["v"] = at::randn({5});
  s.compressor["fc1.weight"] = w;
  s.compressor["fc1.bias"] = b;
  s.compressor["empty"] = sparrow::compression::State{};
  s.control["fc1.weight"] = at::randn({4, 5});
  s.control["fc1.bias"] = at::arange(5, at::TensorOptions().dtype(at::kDouble)) * 0.5;
  s.control["counts"] = at::arange(3, at::TensorOptions().dtype(at::kLong)) + static_cast<int64_t>(seed);
  s.control["half"] = at::randn({2, 2}).to(at::kHalf);
  s.control["scalar"] = at::scalar_tensor(2.5);
  return s;
}

// Small state whose values identify the client.
ClientState small_state(int64_t client) {
  ClientState s;
  s.rng = static_cast<uint64_t>(client) * 1000003ULL;
  s.rounds = static_cast<uint64_t>(client % 7);
  s.control["c"] = at::full({8}, static_cast<double>(client), at::TensorOptions().dtype(at::kFloat));
  sparrow::compression::State e;
  e.step = static_cast<uint64_t>(client);
  e.tensors["residual"] = at::full({4}, -static_cast<double>(client), at::TensorOptions().dtype(at::kFloat));
  s.compressor["w"] = e;
  return s;
}

void check_equal(const ClientState& a, const ClientState& b) {
  CHECK(a.rng == b.rng);
  CHECK(a.rounds == b.rounds);
  REQUIRE(a.compressor.size() == b.compressor.size());
  for (const auto& [name, s] : a.compressor) {
    REQUIRE(b.compressor.count(name) == 1);
    const auto& o = b.compressor.at(name);
    CHECK(s.step == o.step);
    CHECK(s.last_round == o.last_round);
    REQUIRE(s.tensors.size() == o.tensors.size());
    for (const auto& [slot, t] : s.tensors) {
      REQUIRE(o.tensors.count(slot) == 1);
      CHECK(at::equal(t, o.tensors.at(slot)));
    }
  }
  REQUIRE(a.control.size() == b.control.size());
  for (const auto& [name, t] : a.control) {
    REQUIRE(b.control.count(name) == 1);
    const at::Tensor& u = b.control.at(name);
    CHECK((t.scalar_type() == u.scalar_type()));
    CHECK(t.sizes().equals(u.sizes()));
    CHECK(at::equal(t, u));
  }
}

void check_small(const std::optional<ClientState>& s, int64_t client) {
  REQUIRE(s.has_value());
  check_equal(*s, small_state(client));
}

}  // namespace

TEST_CASE("client state round trips through bytes") {
  SUBCASE("rich state") {
    const ClientState s = rich_state(1);
    const ClientState back = ClientState::deserialize(s.serialize());
    check_equal(s, back);
    CHECK((back.control.at("half").scalar_type() == at::kHalf));
    CHECK(back.control.at("scalar").dim() == 0);
  }
  SUBCASE("empty state") {
    ClientState s;
    const ClientState back = ClientState::deserialize(s.serialize());
    CHECK(back.compressor.empty());
    CHECK(back.control.empty());
    CHECK(back.rng == 0);
  }
  SUBCASE("non-contiguous control tensor") {
    ClientState s;
    s.control["t"] = at::randn({3, 4}).t();
    check_equal(s, ClientState::deserialize(s.serialize()));
  }
}

TEST_CASE("client state rejects truncated and malformed bytes") {
  const std::string bytes = rich_state(2).serialize();
  SUBCASE("every truncation") {
    for (size_t n = 0; n < bytes.size(); ++n) {
      CHECK_THROWS_AS(ClientState::deserialize(bytes.substr(0, n)), sparrow::FormatError);
    }
  }
  SUBCASE("trailing bytes") { CHECK_THROWS_AS(ClientState::deserialize(bytes + "x"), sparrow::FormatError); }
  SUBCASE("bad magic") {
    std::string b = bytes;
    b[0] = 'X';
    CHECK_THROWS_WITH_AS(ClientState::deserialize(b), doctest::Contains("magic"), sparrow::FormatError);
  }
  SUBCASE("newer version") {
    std::string b = bytes;
    b[4] = 9;
    CHECK_THROWS_WITH_AS(ClientState::deserialize(b), doctest::Contains("version"), sparrow::FormatError);
  }
  SUBCASE("corrupt compressor entry names the entry") {
    std::string b = bytes;
    const size_t at = b.find("SPST");  // first embedded compressor::State
    REQUIRE(at != std::string::npos);
    b[at] = 'Q';
    CHECK_THROWS_WITH_AS(ClientState::deserialize(b), doctest::Contains("compressor 'empty'"), sparrow::FormatError);
  }
  SUBCASE("unknown dtype code") {
    ClientState s;
    s.control["x"] = at::ones({2});
    std::string b = s.serialize();
    const size_t at = b.find('x');
    REQUIRE(at != std::string::npos);
    b[at + 1] = 99;  // the dtype byte follows the name
    CHECK_THROWS_WITH_AS(ClientState::deserialize(b), doctest::Contains("dtype"), sparrow::FormatError);
  }
  SUBCASE("huge dimension") {
    ClientState s;
    s.control["x"] = at::ones({2});
    std::string b = s.serialize();
    const size_t dim_at = b.find('x') + 1 + 1 + 4;
    const int64_t huge = int64_t{1} << 50;
    std::memcpy(&b[dim_at], &huge, 8);
    CHECK_THROWS_AS(ClientState::deserialize(b), sparrow::FormatError);
  }
}

TEST_CASE("client state refuses tensors it cannot store") {
  ClientState s;
  s.control["z"] = at::ones({2}, at::TensorOptions().dtype(at::kComplexFloat));
  CHECK_THROWS_AS(s.serialize(), sparrow::Error);
  CHECK_THROWS_AS(s.deep_copy(), sparrow::Error);
  ClientState c;
  c.compressor["w"].tensors["r"] = at::ones({2}, at::TensorOptions().dtype(at::kDouble));
  CHECK_THROWS_AS(c.serialize(), sparrow::Error);

  TempDb db("refuse");
  auto store = ClientStateStore::open(db.path(), {});
  CHECK_THROWS_AS(store->put(1, s), sparrow::Error);
  CHECK_THROWS_AS(store->put(2, c), sparrow::Error);
  CHECK(store->cached_entries() == 0);
  CHECK_FALSE(store->get(1).has_value());
}

TEST_CASE("deep copy shares no storage") {
  ClientState s = rich_state(3);
  ClientState c = s.deep_copy();
  check_equal(s, c);
  c.control["fc1.weight"].add_(1.0);
  c.compressor["fc1.weight"].tensors["residual"].zero_();
  CHECK_FALSE(at::equal(s.control["fc1.weight"], c.control["fc1.weight"]));
  CHECK_FALSE(
      at::equal(s.compressor["fc1.weight"].tensors["residual"], c.compressor["fc1.weight"].tensors["residual"]));
  CHECK(s.approx_bytes() >= (4 * 5 * 4) * 4);
}

TEST_CASE("store get put and cache") {
  TempDb db("getput");
  auto store = ClientStateStore::open(db.path(), {});
  SUBCASE("missing client is empty") {
    CHECK_FALSE(store->get(42).has_value());
    CHECK(store->stats().misses == 1);
  }
  SUBCASE("put then get hits the cache with value semantics") {
    ClientState s = rich_state(4);
    store->put(7, s);
    s.control["fc1.weight"].zero_();  // the caller's copy; the store must not see this
    auto got = store->get(7);
    REQUIRE(got.has_value());
    check_equal(*got, rich_state(4));
    got->compressor["fc1.weight"].tensors["u"].zero_();
    check_equal(*store->get(7), rich_state(4));
    CHECK(store->stats().hits == 2);
    CHECK(store->stats().misses == 0);
    CHECK(store->stats().writes == 0);  // below write_batch: nothing written yet
    CHECK(store->cached_bytes() == rich_state(4).approx_bytes());
    store->put(7, small_state(7));  // replace
    check_small(store->get(7), 7);
    CHECK(store->cached_entries() == 1);
  }
}

TEST_CASE("store evicts by bytes and writes dirty entries back") {
  TempDb db("evict");
  const size_t one = small_state(0).approx_bytes();
  ClientStateStore::Options opt;
  opt.cache_bytes = 3 * one + one / 2;  // room for three entries
  opt.write_batch = 1000;               // only eviction writes
  auto store = ClientStateStore::open(db.path(), opt);
  for (int64_t c = 0; c < 10; ++c) store->put(c, small_state(c));
  CHECK(store->cached_entries() == 3);
  CHECK(store->cached_bytes() <= opt.cache_bytes);
  CHECK(store->stats().evictions == 7);
  CHECK(store->stats().writes >= 7);
  for (int64_t c = 0; c < 10; ++c) check_small(store->get(c), c);
  CHECK(store->stats().misses >= 7);
  CHECK(store->cached_bytes() <= opt.cache_bytes);
}

TEST_CASE("store survives close and reopen") {
  TempDb db("reopen");
  {
    auto store = ClientStateStore::open(db.path(), {});
    store->put(1, rich_state(5));
    store->put(2, small_state(2));
    // no flush: the destructor writes back
  }
  auto store = ClientStateStore::open(db.path(), {});
  auto got = store->get(1);
  REQUIRE(got.has_value());
  check_equal(*got, rich_state(5));
  check_small(store->get(2), 2);
  CHECK_FALSE(store->get(3).has_value());
  CHECK(store->stats().misses == 3);
}

TEST_CASE("store writes back in batches") {
  TempDb db("batch");
  ClientStateStore::Options wopt;
  wopt.write_batch = 4;
  auto writer = ClientStateStore::open(db.path(), wopt);
  ClientStateStore::Options ropt;
  ropt.cache_bytes = 0;  // every get reads the database
  auto reader = ClientStateStore::open(db.path(), ropt);

  for (int64_t c = 0; c < 3; ++c) writer->put(c, small_state(c));
  writer->put(1, small_state(1));  // a dirty entry counts once
  CHECK_FALSE(reader->get(0).has_value());
  CHECK(writer->stats().transactions == 0);
  writer->put(3, small_state(3));  // fourth dirty entry fills the batch
  CHECK(writer->stats().transactions == 1);
  CHECK(writer->stats().writes == 4);
  for (int64_t c = 0; c < 4; ++c) check_small(reader->get(c), c);
  CHECK(reader->cached_entries() == 0);

  writer->put(4, small_state(4));
  CHECK_FALSE(reader->get(4).has_value());
  writer->flush();
  CHECK(writer->stats().transactions == 2);
  check_small(reader->get(4), 4);
  writer->flush();  // nothing dirty: no empty transaction
  CHECK(writer->stats().transactions == 2);
}

TEST_CASE("store round trips 2000 clients") {
  TempDb db("many");
  ClientStateStore::Options opt;
  opt.cache_bytes = 500 * small_state(0).approx_bytes();
  opt.write_batch = 64;
  {
    auto store = ClientStateStore::open(db.path(), opt);
    for (int64_t c = 0; c < 2000; ++c) store->put(c, small_state(c));
    CHECK(store->cached_entries() <= 500);
    for (int64_t c = 0; c < 2000; c += 3) check_small(store->get(c), c);
  }
  auto store = ClientStateStore::open(db.path(), opt);
  for (int64_t c = 0; c < 2000; ++c) check_small(store->get(c), c);
  CHECK(store->stats().misses == 2000);
}

TEST_CASE("store is safe to share between threads") {
  TempDb db("threads");
  ClientStateStore::Options opt;
  opt.cache_bytes = 40 * small_state(0).approx_bytes();  // forces evictions and write-backs
  opt.write_batch = 16;
  auto store = ClientStateStore::open(db.path(), opt);
  std::vector<std::thread> threads;
  std::vector<int> bad(4, 0);
  for (int w = 0; w < 4; ++w) {
    threads.emplace_back([&, w] {
      for (int64_t c = w; c < 400; c += 4) store->put(c, small_state(c));
      for (int64_t c = w; c < 400; c += 4) {
        auto s = store->get(c);
        if (!s || s->rng != small_state(c).rng || !at::equal(s->control.at("c"), small_state(c).control.at("c")))
          ++bad[w];
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int w = 0; w < 4; ++w) CHECK(bad[w] == 0);
  CHECK(store->cached_bytes() <= opt.cache_bytes);
}

TEST_CASE("store reports a corrupt row and stays usable") {
  TempDb db("corrupt");
  ClientState victim = small_state(1);
  victim.rng = 0x5eed5eed5eed5eedULL;
  {
    auto store = ClientStateStore::open(db.path(), {});
    store->put(1, victim);
    store->put(2, small_state(2));
  }
  // Damage client 1's row on disk: its blob starts "SPCL", version, rng.
  std::string file = read_file(db.path());
  std::string pattern("SPCL", 4);
  const uint32_t version = 1;
  pattern.append(reinterpret_cast<const char*>(&version), 4);
  pattern.append(reinterpret_cast<const char*>(&victim.rng), 8);
  const size_t at = file.find(pattern);
  REQUIRE(at != std::string::npos);
  file[at + 4] = 77;  // unsupported version
  write_file(db.path(), file);

  auto store = ClientStateStore::open(db.path(), {});
  CHECK_THROWS_WITH_AS(store->get(1), doctest::Contains("client 1"), sparrow::FormatError);
  check_small(store->get(2), 2);
  store->put(1, small_state(1));  // overwriting repairs it
  store->flush();
  check_small(store->get(1), 1);
}

TEST_CASE("store refuses files that are not its database") {
  SUBCASE("not SQLite") {
    TempDb db("notsqlite");
    std::string junk;
    for (int i = 0; i < 100; ++i) junk += "this is not an SQLite database, just text\n";
    write_file(db.path(), junk);
    CHECK_THROWS_WITH_AS(ClientStateStore::open(db.path(), {}), doctest::Contains("not an SQLite database"),
                         sparrow::FormatError);
    CHECK(read_file(db.path()) == junk);  // left untouched
  }
  SUBCASE("newer schema") {
    TempDb db("newer");
    { ClientStateStore::open(db.path(), {})->put(1, small_state(1)); }
    std::string file = read_file(db.path());
    REQUIRE(file.size() >= 100);
    file[60] = 0, file[61] = 0, file[62] = 0, file[63] = 9;  // PRAGMA user_version, big-endian
    write_file(db.path(), file);
    CHECK_THROWS_WITH_AS(ClientStateStore::open(db.path(), {}), doctest::Contains("newer"), sparrow::FormatError);
  }
  SUBCASE("bad options") {
    TempDb db("options");
    ClientStateStore::Options opt;
    opt.write_batch = 0;
    CHECK_THROWS_AS(ClientStateStore::open(db.path(), opt), sparrow::ConfigError);
    CHECK_THROWS_AS(ClientStateStore::open("", {}), sparrow::ConfigError);
  }
}

TEST_CASE("store background write-back keeps get consistent and flush waits") {
  TempDb db("bg");
  ClientStateStore::Options opt;
  opt.background = true;
  opt.write_batch = 2;  // hand-offs while the test keeps putting
  opt.cache_bytes = 2 * small_state(0).approx_bytes();
  auto store = ClientStateStore::open(db.path(), opt);
  for (int64_t c = 0; c < 40; ++c) {
    store->put(c, small_state(c));
    // Whether still cached, handed off or written: the put value.
    check_small(store->get(c), c);
  }
  for (int64_t c = 0; c < 40; ++c) check_small(store->get(c), c);
  store->flush();
  CHECK(store->stats().writes >= 40);
  // flush() returned: every row is in the database for another reader.
  ClientStateStore::Options ropt;
  ropt.cache_bytes = 0;
  auto reader = ClientStateStore::open(db.path(), ropt);
  for (int64_t c = 0; c < 40; ++c) check_small(reader->get(c), c);
}

TEST_CASE("store background prefetch loads clients into the cache") {
  TempDb db("prefetch");
  {
    auto w = ClientStateStore::open(db.path(), {});
    for (int64_t c = 0; c < 5; ++c) w->put(c, small_state(c));
  }
  ClientStateStore::Options opt;
  opt.background = true;
  auto store = ClientStateStore::open(db.path(), opt);
  store->prefetch({0, 1, 2, 3, 4, 99});
  for (int i = 0; i < 2000 && store->stats().prefetched < 5; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  CHECK(store->stats().prefetched == 5);  // 99 has no row
  for (int64_t c = 0; c < 5; ++c) check_small(store->get(c), c);
  CHECK(store->stats().misses == 0);
  // A put after the prefetch wins.
  store->put(2, small_state(20));
  store->prefetch({2});
  store->flush();
  check_small(store->get(2), 20);
}

TEST_CASE("store checkpoint mode writes only what flush hands off with its meta") {
  for (const bool background : {false, true}) {
    CAPTURE(background);
    TempDb db(background ? "ckpt_bg" : "ckpt_fg");
    ClientStateStore::Options opt;
    opt.background = background;
    opt.explicit_flush = true;
    opt.write_batch = 1;                              // ignored in checkpoint mode
    opt.cache_bytes = small_state(0).approx_bytes();  // eviction would write, if allowed
    {
      auto store = ClientStateStore::open(db.path(), opt);
      for (int64_t c = 0; c < 3; ++c) store->put(c, small_state(c));
      store->set_meta("round", "1");
      CHECK(store->get_meta("round") == std::optional<std::string>("1"));
      store->flush();
      CHECK(store->stats().transactions == 1);
      // After the checkpoint: new values and a new client, never flushed.
      store->put(0, small_state(10));
      store->put(7, small_state(7));
      store->set_meta("round", "2");
      check_small(store->get(0), 10);
      check_small(store->get(7), 7);
      CHECK(store->dirty_bytes() > 0);
      CHECK(store->stats().transactions == 1);
    }  // closing drops what was not flushed
    auto store = ClientStateStore::open(db.path(), {});
    check_small(store->get(0), 0);
    check_small(store->get(1), 1);
    check_small(store->get(2), 2);
    CHECK_FALSE(store->get(7).has_value());
    CHECK(store->get_meta("round") == std::optional<std::string>("1"));
    CHECK_FALSE(store->get_meta("nothing").has_value());
  }
}

TEST_CASE("store flush_async then flush makes the state durable") {
  TempDb db("async");
  ClientStateStore::Options opt;
  opt.background = true;
  opt.explicit_flush = true;
  auto store = ClientStateStore::open(db.path(), opt);
  store->put(1, rich_state(3));
  store->set_meta("k", "v");
  store->flush_async();
  store->put(2, small_state(2));  // after the hand-off: not part of it
  store->wait_written();
  ClientStateStore::Options ropt;
  ropt.cache_bytes = 0;
  auto reader = ClientStateStore::open(db.path(), ropt);
  auto got = reader->get(1);
  REQUIRE(got.has_value());
  check_equal(*got, rich_state(3));
  CHECK_FALSE(reader->get(2).has_value());
  CHECK(reader->get_meta("k") == std::optional<std::string>("v"));
}

TEST_CASE("into_owned keeps sole owners and copies shared tensors") {
  ClientState s = rich_state(6);
  void* own = s.compressor["fc1.weight"].tensors["u"].data_ptr();
  at::Tensor shared = s.control["fc1.weight"];  // the caller keeps a handle
  ClientState o = ClientState::into_owned(std::move(s));
  CHECK(o.compressor["fc1.weight"].tensors["u"].data_ptr() == own);
  CHECK(o.control["fc1.weight"].data_ptr() != shared.data_ptr());
  check_equal(o, rich_state(6));
}

namespace {
// SQL on the file behind the store's back, as a damaged disk or another
// program would change it.
void raw_sql(const std::string& path, const std::string& sql) {
  sqlite3* db = nullptr;
  REQUIRE(sqlite3_open(path.c_str(), &db) == SQLITE_OK);
  char* err = nullptr;
  const int rc = sqlite3_exec(db, sql.c_str(), nullptr, nullptr, &err);
  if (err) sqlite3_free(err);
  sqlite3_close(db);
  REQUIRE(rc == SQLITE_OK);
}
}  // namespace

TEST_CASE("store checksums every state and meta value") {
  TempDb db("crc");
  {
    auto store = ClientStateStore::open(db.path(), {});
    store->put(1, small_state(1));
    store->put(2, small_state(2));
    store->set_meta("checkpoint.global", std::string(300, 'g'));
    store->flush();
  }
  // One byte inside client 1's tensor values (past the header, which
  // deserialize checks itself) and one of the meta value changed.
  raw_sql(db.path(),
          "UPDATE client_state SET blob = CAST(substr(blob, 1, length(blob) - 3) || X'7F' || "
          "substr(blob, length(blob) - 1) AS BLOB) WHERE client_id = 1;"
          "UPDATE meta SET value = CAST(substr(value, 1, 100) || 'h' || substr(value, 102) AS BLOB);");
  auto store = ClientStateStore::open(db.path(), {});
  CHECK_THROWS_WITH_AS(store->get(1), doctest::Contains("client 1 fails its checksum"), sparrow::FormatError);
  CHECK_THROWS_WITH_AS(store->get_meta("checkpoint.global"), doctest::Contains("fails its checksum"),
                       sparrow::FormatError);
  check_small(store->get(2), 2);
}

TEST_CASE("store reads and migrates a version 2 database (no checksums)") {
  TempDb db("v2");
  const std::string blob = small_state(3).serialize();
  {
    sqlite3* raw = nullptr;
    REQUIRE(sqlite3_open(db.path().c_str(), &raw) == SQLITE_OK);
    REQUIRE(
        sqlite3_exec(raw,
                     "CREATE TABLE client_state(client_id INTEGER PRIMARY KEY, blob BLOB NOT NULL, updated INTEGER);"
                     "CREATE TABLE meta(key TEXT PRIMARY KEY, value BLOB NOT NULL);"
                     "INSERT INTO meta VALUES('k', X'0102');"
                     "PRAGMA user_version=2;",
                     nullptr, nullptr, nullptr) == SQLITE_OK);
    sqlite3_stmt* st = nullptr;
    REQUIRE(sqlite3_prepare_v2(raw, "INSERT INTO client_state VALUES(3, ?1, 0)", -1, &st, nullptr) == SQLITE_OK);
    sqlite3_bind_blob(st, 1, blob.data(), static_cast<int>(blob.size()), SQLITE_STATIC);
    REQUIRE(sqlite3_step(st) == SQLITE_DONE);
    sqlite3_finalize(st);
    sqlite3_close(raw);
  }
  {
    auto store = ClientStateStore::open(db.path(), {});
    check_small(store->get(3), 3);  // unverified: written before checksums
    CHECK(store->get_meta("k") == std::string("\x01\x02", 2));
    store->put(4, small_state(4));
  }
  auto store = ClientStateStore::open(db.path(), {});
  check_small(store->get(4), 4);
}

TEST_CASE("store refuses an empty file, another program's database and a damaged page") {
  SUBCASE("empty") {
    TempDb db("empty0");
    write_file(db.path(), "");
    CHECK_THROWS_WITH_AS(ClientStateStore::open(db.path(), {}), doctest::Contains("exists but is empty"),
                         sparrow::ConfigError);
  }
  SUBCASE("foreign") {
    TempDb db("foreign");
    raw_sql(db.path(), "CREATE TABLE songs(title TEXT); INSERT INTO songs VALUES('x');");
    CHECK_THROWS_WITH_AS(ClientStateStore::open(db.path(), {}), doctest::Contains("something else"),
                         sparrow::ConfigError);
  }
  SUBCASE("zeroed page") {
    TempDb db("zeroedpage");
    {
      auto store = ClientStateStore::open(db.path(), {});
      for (int64_t c = 0; c < 12; ++c) {
        ClientState big = small_state(c);
        big.control["big"] = at::randn({20000});  // 80 KB: the file spans many pages
        store->put(c, big);
      }
      store->flush();
    }
    std::string file = read_file(db.path());
    const size_t page = 65536;  // the store's page size
    REQUIRE(file.size() >= 3 * page);
    std::fill(file.begin() + static_cast<std::ptrdiff_t>(page), file.begin() + static_cast<std::ptrdiff_t>(2 * page),
              '\0');
    write_file(db.path(), file);
    CHECK_THROWS_AS(ClientStateStore::open(db.path(), {}), sparrow::FormatError);
  }
}

TEST_CASE("store rollback_to_mark forgets the puts after the mark, written or not") {
  TempDb db("mark");
  ClientStateStore::Options opt;
  opt.background = true;
  opt.explicit_flush = true;
  {
    auto store = ClientStateStore::open(db.path(), opt);
    CHECK_THROWS_AS(store->rollback_to_mark(), sparrow::Error);  // no mark
    store->put(1, small_state(1));
    store->put(2, small_state(2));
    store->set_meta("round", "1");
    store->flush();                  // the checkpoint of "round 1"
    store->put(1, small_state(11));  // "round 2", not checkpointed yet
    store->mark();                   // "round 3" starts
    store->put(1, small_state(21));
    store->put(3, small_state(23));
    store->put(2, small_state(22));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the writer has written some of them
    (void)store->get(2);                                          // and the cache holds the new value
    store->rollback_to_mark();
    check_equal(*store->get(1), small_state(11));  // round 2's value stays
    check_equal(*store->get(2), small_state(2));   // the checkpoint's value
    CHECK_FALSE(store->get(3).has_value());
    store->set_meta("round", "2");
    store->flush();                                              // the checkpoint of round 2
    CHECK_THROWS_AS(store->rollback_to_mark(), sparrow::Error);  // the mark is gone
  }
  ClientStateStore::Options ropt;
  ropt.cache_bytes = 0;
  auto reader = ClientStateStore::open(db.path(), ropt);
  check_equal(*reader->get(1), small_state(11));
  check_equal(*reader->get(2), small_state(2));
  CHECK_FALSE(reader->get(3).has_value());
  CHECK(reader->get_meta("round") == std::optional<std::string>("2"));
}

TEST_CASE(
    "store on a full disk: a clear error, nothing half-written, the states kept and written once there is space") {
  sparrow::testing::FullDisk disk;  // before the stores: they open through it
  ClientStateStore::Options ropt;
  ropt.cache_bytes = 0;  // a second store as a read-only observer of the file
  SUBCASE("write-back on the caller's thread") {
    TempDb db("full_fg");
    auto store = ClientStateStore::open(db.path(), {});
    store->put(1, small_state(1));
    store->flush();
    disk.full(true);
    store->put(2, small_state(2));
    store->put(1, small_state(11));
    store->set_meta("round", "2");
    std::string msg;
    try {
      store->flush();
    } catch (const sparrow::Error& e) {
      msg = e.what();
    }
    CHECK(disk.refused() > 0);
    CHECK(msg.find("client state store '" + db.path() + "'") != std::string::npos);
    CHECK(msg.find("the disk is full; nothing of this transaction was written") != std::string::npos);
    check_small(store->get(2), 2);  // still readable
    check_equal(*store->get(1), small_state(11));
    disk.full(false);
    {
      auto observer = ClientStateStore::open(db.path(), ropt);
      check_small(observer->get(1), 1);  // the file holds the last flush, nothing of the failed one
      CHECK_FALSE(observer->get(2).has_value());
      CHECK_FALSE(observer->get_meta("round").has_value());
    }
    store->flush();  // retried
    store.reset();
    auto reader = ClientStateStore::open(db.path(), ropt);
    check_small(reader->get(2), 2);
    check_equal(*reader->get(1), small_state(11));
    CHECK(reader->get_meta("round") == std::optional<std::string>("2"));
  }
  SUBCASE("checkpoint mode (the simulator's): the flush fails whole and is retried whole") {
    TempDb db("full_bg");
    ClientStateStore::Options opt;
    opt.background = true;
    opt.explicit_flush = true;
    {
      auto store = ClientStateStore::open(db.path(), opt);
      store->put(1, small_state(1));
      store->set_meta("round", "1");
      store->flush();
      store->put(2, small_state(2));
      store->put(3, small_state(3));
      store->set_meta("round", "2");
      disk.full(true);
      CHECK_THROWS_WITH_AS(store->flush(), doctest::Contains("the disk is full"), sparrow::Error);
      {
        // The writer retries at once (and fails again while the disk is full):
        // the file holds the last checkpoint whole, nothing of this one.
        auto observer = ClientStateStore::open(db.path(), ropt);
        CHECK(observer->get_meta("round") == std::optional<std::string>("1"));
        CHECK_FALSE(observer->get(2).has_value());
        check_small(store->get(3), 3);  // still readable
      }
      disk.full(false);
      // A retry that failed meanwhile is reported once; the flush after it writes.
      bool written = false;
      for (int attempt = 0; attempt < 2 && !written; ++attempt) {
        try {
          store->flush();
          written = true;
        } catch (const sparrow::Error& e) {
          CHECK(std::string(e.what()).find("the disk is full") != std::string::npos);
        }
      }
      CHECK(written);
    }
    auto reader = ClientStateStore::open(db.path(), ropt);
    CHECK(reader->get_meta("round") == std::optional<std::string>("2"));
    check_small(reader->get(2), 2);
    check_small(reader->get(3), 3);
  }
  SUBCASE("a new store on a full disk leaves no file to refuse at the next start") {
    TempDb db("full_new");
    disk.full(true);
    CHECK_THROWS_WITH_AS(ClientStateStore::open(db.path(), {}), doctest::Contains("the disk is full"), sparrow::Error);
    disk.full(false);
    CHECK_FALSE(std::ifstream(db.path()).good());
    { ClientStateStore::open(db.path(), {})->put(1, small_state(1)); }
    check_small(ClientStateStore::open(db.path(), ropt)->get(1), 1);
  }
}

TEST_CASE("store refuses an SQLite file without tables and a damaged -wal file, leaving them as they were") {
  SUBCASE("no tables") {
    TempDb db("notables");
    raw_sql(db.path(), "CREATE TABLE t(x); DROP TABLE t");
    const std::string before = read_file(db.path());
    CHECK_THROWS_WITH_AS(ClientStateStore::open(db.path(), {}),
                         doctest::Contains("exists but is not a client state store (no tables)"), sparrow::ConfigError);
    CHECK(read_file(db.path()) == before);
  }
  SUBCASE("a flipped byte in the -wal file after a crash") {
    TempDb db("walsrc"), copy("walcopy");
    {
      auto store = ClientStateStore::open(db.path(), {});
      for (int64_t c = 0; c < 8; ++c) {
        store->put(c, small_state(c));
        store->flush();  // one commit each
      }
      // As a crash leaves them: the database and its log while the store is open.
      write_file(copy.path(), read_file(db.path()));
      write_file(copy.path() + "-wal", read_file(db.path() + "-wal"));
    }
    const auto scan = sparrow::sqlite::scan_wal(copy.path() + "-wal");
    REQUIRE(scan.commits >= 8);
    std::string wal = read_file(copy.path() + "-wal");
    wal[32 + static_cast<size_t>(24 + scan.page_size) + 24 + 7] ^= 0x01;  // frame 2's page
    write_file(copy.path() + "-wal", wal);
    CHECK_THROWS_WITH_AS(ClientStateStore::open(copy.path(), {}), doctest::Contains("-wal' is damaged"),
                         sparrow::FormatError);
    CHECK(read_file(copy.path() + "-wal") == wal);
  }
}

TEST_CASE("store take hands a sole cached state over without a copy and otherwise copies") {
  TempDb db("take");
  ClientStateStore::Options opt;
  opt.background = true;
  opt.explicit_flush = true;  // the simulator's checkpoint mode
  auto store = ClientStateStore::open(db.path(), opt);
  for (int64_t c = 0; c < 3; ++c) store->put(c, small_state(c));
  SUBCASE("in the open checkpoint: copied, and what the store keeps is unchanged") {
    std::optional<ClientState> t = store->take(1);
    check_small(t, 1);
    CHECK(store->stats().taken == 0);
    t->compressor["w"].tensors["residual"].fill_(99.0f);  // the caller's copy, as an encoder changes it
    check_small(store->get(1), 1);
  }
  SUBCASE("after the checkpoint: the cached tensors change hands, the database still answers") {
    store->flush();
    check_small(store->get(2), 2);  // the cache holds 2 alone now
    check_small(store->take(2), 2);
    CHECK(store->stats().taken == 1);
    check_small(store->take(2), 2);  // from the database: equal values
    CHECK(store->stats().misses >= 1);
    // A taken state put back and taken again keeps its storage: no copy.
    std::optional<ClientState> t = store->take(0);
    REQUIRE(t.has_value());
    t->compressor["w"].tensors["residual"].fill_(5.0f);
    const void* p = t->compressor["w"].tensors["residual"].data_ptr();
    store->put(0, std::move(*t));
    store->flush();
    std::optional<ClientState> again = store->take(0);
    REQUIRE(again.has_value());
    CHECK(again->compressor["w"].tensors["residual"].data_ptr() == p);
    CHECK(again->compressor["w"].tensors["residual"].eq(5.0f).all().item<bool>());
  }
  SUBCASE("after a mark: copied, so that a rollback still has the marked value") {
    store->flush();
    store->put(1, small_state(11));
    store->mark();
    std::optional<ClientState> t = store->take(1);
    check_equal(*t, small_state(11));
    store->put(1, small_state(21));
    store->rollback_to_mark();
    check_equal(*store->get(1), small_state(11));
  }
  CHECK_FALSE(store->take(42).has_value());
}

TEST_CASE("store prefetched states stay cached until asked for") {
  TempDb db("prefetch_pin");
  {
    auto w = ClientStateStore::open(db.path(), {});
    for (int64_t c = 0; c < 8; ++c) w->put(c, small_state(c));
  }
  const size_t one = small_state(0).approx_bytes();
  ClientStateStore::Options opt;
  opt.background = true;
  opt.explicit_flush = true;
  opt.cache_bytes = 4 * one;  // pinned states may fill half: 2 at a time
  auto store = ClientStateStore::open(db.path(), opt);
  store->prefetch({0, 1, 2, 3});
  for (int i = 0; i < 2000 && store->stats().prefetched < 2; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK(store->stats().prefetched == 2);  // paused: half the cache is pinned
  // Puts of other clients (as the round's trained clients) do not evict them.
  for (int64_t c = 4; c < 8; ++c) store->put(c, small_state(c));
  check_small(store->take(0), 0);
  check_small(store->take(1), 1);
  CHECK(store->stats().misses == 0);
  for (int i = 0; i < 2000 && store->stats().prefetched < 4; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  CHECK(store->stats().prefetched == 4);  // taking made room: the rest came in
  check_small(store->take(2), 2);
  check_small(store->take(3), 3);
  CHECK(store->stats().misses == 0);
}
