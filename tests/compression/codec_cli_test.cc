// sparrow-codec as a user runs it: real process, real files.
#include "tests/sparrow_test.h"

#include <array>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <sys/stat.h>
#include <sys/wait.h>

#include "core/npy.h"
#include "core/rng.h"

namespace {

struct Run {
  int status;
  std::string out;
};

Run run(const std::string& args) {
  const std::string cmd = std::string(SPARROW_BIN_DIR) + "/sparrow-codec " + args + " 2>codec_cli_stderr.txt";
  FILE* p = popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  std::string out;
  std::array<char, 4096> buf;
  size_t got;
  while ((got = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), got);
  const int st = pclose(p);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, out};
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

bool exists(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0;
}

double field(const std::string& json, const std::string& key) {
  const size_t p = json.find("\"" + key + "\":");
  REQUIRE_MESSAGE(p != std::string::npos, "missing field " << key << " in " << json);
  return std::stod(json.substr(p + key.size() + 3));
}

void write_input(const std::string& path, std::vector<int64_t> shape) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = sparrow::rng::normal(5, static_cast<uint64_t>(i));
  sparrow::npy::write(path, shape, v.data());
}

}  // namespace

TEST_CASE("sparrow-codec: JSON line and outputs") {
  write_input("cli_x.npy", {64, 50});
  std::remove("cli_last.npy");
  std::remove("cli_mean.npy");
  Run r = run("--method topk:ratio=0.1,ef=1 --in cli_x.npy --steps 4 --seed 3 --out cli_last.npy --out-mean cli_mean.npy");
  REQUIRE(r.status == 0);
  for (const char* key : {"elements", "dense_bytes", "wire_bytes", "ratio", "encode_ms", "decode_ms", "rel_error"})
    CHECK(r.out.find(std::string("\"") + key + "\":") != std::string::npos);
  CHECK(r.out.find("\"method\":\"topk:ratio=0.1,ef=1\"") != std::string::npos);
  CHECK(field(r.out, "elements") == 3200);
  CHECK(field(r.out, "dense_bytes") == 12800);
  CHECK(field(r.out, "ratio") > 3.0);
  auto last = sparrow::npy::read("cli_last.npy");
  auto mean = sparrow::npy::read("cli_mean.npy");
  CHECK(last.shape == std::vector<int64_t>{64, 50});
  CHECK(mean.shape == std::vector<int64_t>{64, 50});
}

TEST_CASE("sparrow-codec: none is lossless") {
  write_input("cli_x.npy", {7, 3, 5});
  Run r = run("--method none --in cli_x.npy --out cli_last.npy");
  REQUIRE(r.status == 0);
  CHECK(field(r.out, "rel_error") == 0.0);
  CHECK(sparrow::npy::read("cli_last.npy").data == sparrow::npy::read("cli_x.npy").data);
}

TEST_CASE("sparrow-codec: bad input exits 2 and writes nothing") {
  write_input("cli_x.npy", {10, 10});
  const std::string good = read_file("cli_x.npy");
  {
    std::ofstream("cli_trunc.npy", std::ios::binary) << good.substr(0, good.size() - 5);
  }
  std::string f8 = good;
  f8.replace(f8.find("<f4"), 3, "<f8");
  {
    std::ofstream("cli_f8.npy", std::ios::binary) << f8;
  }
  struct Bad {
    const char* args;
    const char* says;
  };
  for (Bad b : {Bad{"--method bogus --in cli_x.npy", "unknown compression method"},
                Bad{"--method topk:ratio=0.1,speed=9 --in cli_x.npy", "unknown key"},
                Bad{"--method topk:ratio=abc --in cli_x.npy", "not a finite number"},
                Bad{"--method none --in cli_trunc.npy", "truncated"},
                Bad{"--method none --in cli_f8.npy", "dtype"},
                Bad{"--method none --in cli_missing.npy", ""},
                Bad{"--method none --in cli_x.npy --steps 0", ""},
                Bad{"--in cli_x.npy", "--method"}}) {
    CAPTURE(b.args);
    std::remove("cli_out.npy");
    Run r = run(std::string(b.args) + " --out cli_out.npy");
    CHECK(r.status == 2);
    CHECK(r.out.empty());
    CHECK_FALSE(exists("cli_out.npy"));
    CHECK(read_file("codec_cli_stderr.txt").find(b.says) != std::string::npos);
  }
}
