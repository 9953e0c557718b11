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

// CTest runs test cases in parallel in one directory: every case uses its own
// file names (prefix) and its own stderr file.
Run run(const std::string& prefix, const std::string& args) {
  const std::string cmd = std::string(SPARROW_BIN_DIR) + "/sparrow-codec " + args + " 2>" + prefix + "stderr.txt";
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
  write_input("cli_json_x.npy", {64, 50});
  std::remove("cli_json_last.npy");
  std::remove("cli_json_mean.npy");
  Run r = run("cli_json_",
              "--method topk:ratio=0.1,ef=1 --in cli_json_x.npy --steps 4 --seed 3 --out cli_json_last.npy --out-mean "
              "cli_json_mean.npy");
  REQUIRE(r.status == 0);
  for (const char* key : {"elements", "dense_bytes", "wire_bytes", "ratio", "encode_ms", "decode_ms", "rel_error"})
    CHECK(r.out.find(std::string("\"") + key + "\":") != std::string::npos);
  CHECK(r.out.find("\"method\":\"topk:ratio=0.1,ef=1\"") != std::string::npos);
  CHECK(field(r.out, "elements") == 3200);
  CHECK(field(r.out, "dense_bytes") == 12800);
  CHECK(field(r.out, "ratio") > 3.0);
  auto last = sparrow::npy::read("cli_json_last.npy");
  auto mean = sparrow::npy::read("cli_json_mean.npy");
  CHECK(last.shape == std::vector<int64_t>{64, 50});
  CHECK(mean.shape == std::vector<int64_t>{64, 50});
}

TEST_CASE("sparrow-codec: none is lossless") {
  write_input("cli_none_x.npy", {7, 3, 5});
  Run r = run("cli_none_", "--method none --in cli_none_x.npy --out cli_none_last.npy");
  REQUIRE(r.status == 0);
  CHECK(field(r.out, "rel_error") == 0.0);
  CHECK(sparrow::npy::read("cli_none_last.npy").data == sparrow::npy::read("cli_none_x.npy").data);
}

TEST_CASE("sparrow-codec: bad input exits 2 and writes nothing") {
  write_input("cli_bad_x.npy", {10, 10});
  const std::string good = read_file("cli_bad_x.npy");
  { std::ofstream("cli_bad_trunc.npy", std::ios::binary) << good.substr(0, good.size() - 5); }
  std::string f8 = good;
  f8.replace(f8.find("<f4"), 3, "<f8");
  { std::ofstream("cli_bad_f8.npy", std::ios::binary) << f8; }
  struct Bad {
    const char* args;
    const char* says;
  };
  for (Bad b : {Bad{"--method bogus --in cli_bad_x.npy", "unknown compression method"},
                Bad{"--method topk:ratio=0.1,speed=9 --in cli_bad_x.npy", "unknown key"},
                Bad{"--method topk:ratio=abc --in cli_bad_x.npy", "not a finite number"},
                Bad{"--method none --in cli_bad_trunc.npy", "truncated"},
                Bad{"--method none --in cli_bad_f8.npy", "dtype"}, Bad{"--method none --in cli_bad_missing.npy", ""},
                Bad{"--method none --in cli_bad_x.npy --steps 0", ""}, Bad{"--in cli_bad_x.npy", "--method"}}) {
    CAPTURE(b.args);
    std::remove("cli_bad_out.npy");
    Run r = run("cli_bad_", std::string(b.args) + " --out cli_bad_out.npy");
    CHECK(r.status == 2);
    CHECK(r.out.empty());
    CHECK_FALSE(exists("cli_bad_out.npy"));
    CHECK(read_file("cli_bad_stderr.txt").find(b.says) != std::string::npos);
  }
}

TEST_CASE("sparrow-codec: every registered method through the wire") {
  write_input("cli_all_x.npy", {96, 40});
  // Bounds on the error of the mean of 30 decodes, measured values in comments:
  // error feedback and unbiasedness make it small; plain top-k and dgc (which
  // sends momentum) make no such promise. randomk's unbiased n/k estimate has
  // variance (n/k - 1)/30 per element: about 0.78.
  struct Case {
    std::string spec;
    double mean_err;
  };
  for (const Case& c :
       {Case{"fp16", 0.01}, Case{"bf16", 0.01}, Case{"topk:ratio=0.05", 10}, Case{"topk:ratio=0.05,ef=1", 0.4},
        Case{"randomk:ratio=0.05", 1.0}, Case{"randomk:ratio=0.05,ef=1", 0.8} /* 0.60 */,
        Case{"threshold:tau=1.5", 0.35} /* 0.21 */, Case{"dgc:ratio=0.01,warmup=4", 100},
        Case{"qsgd:levels=16", 0.2} /* 0.10 */, Case{"terngrad", 0.4} /* 0.28 */, Case{"sign", 0.25} /* 0.15 */,
        Case{"powersgd:rank=4", 0.3} /* 0.20 */, Case{"powersgd:rank=4,values=int8,sparse=0.02", 0.3},
        Case{"acp:rank=4", 0.6} /* 0.43 */}) {
    const std::string spec = c.spec;
    CAPTURE(spec);
    Run r = run("cli_all_", "--method " + spec + " --in cli_all_x.npy --steps 30 --out-mean cli_all_mean.npy");
    REQUIRE(r.status == 0);
    CHECK(field(r.out, "wire_bytes") > 0);
    CHECK(field(r.out, "ratio") > 1.9);
    const double rel = field(r.out, "rel_error");
    CHECK(std::isfinite(rel));
    auto mean = sparrow::npy::read("cli_all_mean.npy");
    auto x = sparrow::npy::read("cli_all_x.npy");
    double e2 = 0, x2 = 0;
    for (size_t i = 0; i < x.data.size(); ++i) {
      e2 += (mean.data[i] - x.data[i]) * (mean.data[i] - x.data[i]);
      x2 += x.data[i] * x.data[i];
    }
    CHECK(std::sqrt(e2 / x2) < c.mean_err);
  }
}
