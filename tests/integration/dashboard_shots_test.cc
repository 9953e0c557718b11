// The dashboard in a real browser at the moments an operator looks at it: the
// server waiting for clients, a round in training, the run done; and the
// report page of two simulations. Checks what the page says in each (the
// progress line names what the round needs, the deadline shows only while a
// round trains, a finished run says done, the headline figures and the runs
// table's columns) and takes a screenshot of each: into docs/images/ when
// SPARROW_DOC_SCREENSHOTS=1 (docs/monitoring.md shows them), else next to the
// test binaries. Needs Chromium (scripts/setup.sh --browser): slow suite.
#include "tests/sparrow_test.h"

#include <signal.h>

#include <array>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "tests/http_client.h"
#include "tests/integration/fixtures.h"
#include "tests/integration/process.h"

using namespace sparrow::testing::integ;
namespace fs = std::filesystem;
using namespace std::chrono_literals;

namespace {

// Where a screenshot goes: the docs' images when asked for, else the build folder.
std::string shot_path(const std::string& name) {
  const char* docs = std::getenv("SPARROW_DOC_SCREENSHOTS");
  if (docs != nullptr && std::string(docs) == "1") return std::string(SPARROW_SOURCE_DIR) + "/docs/images/" + name;
  return (fs::path(kBin).parent_path() / name).string();
}

// The DOM of `url` after its scripts ran for 6 s of virtual time, and a
// screenshot of `height` pixels.
std::string page_dom(const std::string& dir, const std::string& url, const std::string& shot, int height) {
  std::string chromium;
  for (const char* c : {"/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome"})
    if (fs::exists(c)) chromium = c;
  REQUIRE_MESSAGE(!chromium.empty(), "no Chromium: install it with scripts/setup.sh --browser");
  const std::string flags = " --headless --no-sandbox --disable-gpu --hide-scrollbars --virtual-time-budget=6000 ";
  const std::string dom = dir + "/shot-dom.html";
  REQUIRE(run_tool({"/bin/sh", "-c",
                    chromium + flags + "--dump-dom '" + url + "' > '" + dom + "' 2>> '" + dir + "/chromium.err'"},
                   dir + "/chromium.log") == 0);
  CHECK(run_tool({"/bin/sh", "-c",
                  chromium + flags + "--window-size=1400," + std::to_string(height) + " --screenshot='" + shot + "' '" +
                      url + "' 2>> '" + dir + "/chromium.err'"},
                 dir + "/chromium-shot.log") == 0);
  CHECK(fs::exists(shot));
  std::ifstream in(dom);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// The text of the element with id `id` (no markup inside it).
std::string text_of(const std::string& dom, const std::string& id) {
  std::smatch m;
  if (!std::regex_search(dom, m, std::regex("id=\"" + id + "\"[^>]*>([^<]*)<"))) return "<no #" + id + ">";
  return m[1];
}

// Its data-value attribute.
std::string value_of(const std::string& dom, const std::string& id) {
  std::smatch m;
  if (!std::regex_search(dom, m, std::regex("id=\"" + id + "\"[^>]*data-value=\"([^\"]*)\""))) return "";
  return m[1];
}

// Polls /api/progress until `pred` holds (or 60 s pass); the last body.
template <class Pred>
std::string wait_progress(int port, Pred pred) {
  std::string body;
  for (int i = 0; i < 600; ++i) {
    body = sparrow::testing::http_body(sparrow::testing::http_get(port, "/api/progress"));
    if (pred(body)) return body;
    std::this_thread::sleep_for(100ms);
  }
  return body;
}

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST_SUITE("slow") {
  TEST_CASE("dashboard screenshots: waiting, training and done say what the round needs") {
    const std::string dir = fresh_dir("dash_shots");
    keygen(dir, 2);
    server_toml(dir,
                "rounds = 3\nclients_per_round = 2\nmin_clients = 2\nquorum = 2\nround_deadline_s = 60\nlr = 0.05\n"
                "eval_every = 1\nheartbeat_ms = 500\n");
    Process server({kServerBin, "--config", dir + "/server.toml", "--http", "127.0.0.1:0", "--http-linger", "120"},
                   dir + "/server.log");
    const std::string ep = server_endpoint(server);
    std::smatch m;
    const std::string log = server.log();
    REQUIRE(std::regex_search(log, m, std::regex("event=http url=(http://127.0.0.1:(\\d+)/)")));
    const std::string url = m[1];
    const int port = std::stoi(m[2]);

    // Waiting: one of the two clients the round needs is connected.
    std::vector<std::unique_ptr<Process>> clients;
    clients.push_back(start_client(dir, 1, ep, 100, 0, "", {"--update-delay-ms", "0"}));
    CHECK(has(wait_progress(port, [](const std::string& b) { return has(b, "\"clients_connected\":1,"); }),
              "\"phase\":\"waiting\""));
    {
      const std::string dom = page_dom(dir, url, shot_path("dashboard-waiting.png"), 1000);
      INFO(dir << "/shot-dom.html");
      CHECK(text_of(dom, "progress-text") ==
            "Round 1 of 3 \u2014 waiting for clients: 1 connected, 2 needed to start (min_clients)");
      CHECK(text_of(dom, "progress-deadline").empty());
      CHECK(text_of(dom, "headline-accuracy") == "\u2014");
    }

    // Training: the second client holds its update back, so round 2 waits with 1 of 2.
    clients.push_back(start_client(dir, 2, ep, 100, 1, "", {"--update-delay-ms", "6000"}));
    const std::string training = wait_progress(port, [](const std::string& b) {
      return has(b, "\"round\":2,") && has(b, "\"phase\":\"training\"") && has(b, "\"received\":1,");
    });
    REQUIRE(has(training, "\"received\":1,"));
    {
      const std::string dom = page_dom(dir, url, shot_path("dashboard-training.png"), 1900);
      INFO(dir << "/shot-dom.html");
      CHECK(text_of(dom, "progress-text") == "Round 2 of 3 \u2014 training: 1 of 2 updates received");
      CHECK(has(text_of(dom, "progress-deadline"), " s left in this round"));
      CHECK(has(text_of(dom, "headline-accuracy"), "%"));  // round 1 was evaluated
      CHECK(text_of(dom, "headline-accuracy-round") == "after round 1");
      CHECK(text_of(dom, "headline-eta") != "\u2014");
    }

    // Done: the run's end, no deadline left over, and the totals.
    {
      INFO(log_tail(server));
      REQUIRE(server.wait_for_log("event=http_linger", 120s));
    }
    for (auto& c : clients) CHECK(c->wait(30s) == std::optional<int>(0));
    const std::vector<RoundInfo> rounds = Db(dir + "/server.db").rounds();
    REQUIRE(rounds.size() == 3);
    uint64_t up = 0, down = 0;
    for (const RoundInfo& r : rounds) up += r.bytes_in, down += r.bytes_out;
    {
      const std::string dom = page_dom(dir, url, shot_path("dashboard-server.png"), 1900);
      INFO(dir << "/shot-dom.html");
      CHECK(text_of(dom, "progress-text") == "Run complete: 3 of 3 rounds");
      CHECK(text_of(dom, "progress-deadline") == "done");
      CHECK(text_of(dom, "headline-eta") == "done");
      CHECK(value_of(dom, "headline-up") == std::to_string(up));
      CHECK(value_of(dom, "headline-down") == std::to_string(down));
      CHECK(std::stod(value_of(dom, "headline-accuracy")) == doctest::Approx(rounds[2].eval_accuracy).epsilon(1e-7));
    }
    server.signal(SIGTERM);
    CHECK(server.wait(30s) == std::optional<int>(0));
    fs::remove_all(dir);
  }

  TEST_CASE("dashboard screenshots: a report of two simulations with their bytes and the settings that differ") {
    const std::string dir = fresh_dir("report_shots");
    const std::string sim = kBin + "/sparrow-sim";
    // Dense FedAvg, and DGC with a larger learning rate.
    const std::vector<std::array<std::string, 3>> runs = {{"dense", "none", "0.05"},
                                                          {"dgc", "dgc:ratio=0.05,momentum=0.9,warmup=0", "0.08"}};
    for (const auto& run : runs) {
      write_file(dir + "/" + run[0] + ".toml",
                 "seed = 3\ndataset = \"synthetic:alpha=0.5,beta=0.5\"\nclients = 30\nclients_per_round = 5\n"
                 "rounds = 12\nmodel = \"logreg\"\nbatch_size = 10\nlr = " +
                     run[2] + "\neval_every = 2\nworkers = 1\ncompression = \"" + run[1] + "\"\nout = \"" + dir + "/" +
                     run[0] + "\"\n");
      REQUIRE(run_tool({sim, "--config", dir + "/" + run[0] + ".toml"}, dir + "/" + run[0] + ".log") == 0);
    }
    REQUIRE(run_tool({sim, "report", dir + "/dense", "--compare", dir + "/dgc"}, dir + "/report.log") == 0);
    const std::string dom =
        page_dom(dir, "file://" + dir + "/dense/dashboard.html", shot_path("dashboard-report.png"), 1700);
    INFO(dir << "/shot-dom.html");
    // The runs table: compression and downlink per run, the bytes each way, and
    // the settings that differ (compression has its own column).
    const size_t row = dom.find("<tr data-run=\"dgc\"");
    REQUIRE(row != std::string::npos);
    const std::string tr = dom.substr(row, dom.find("</tr>", row) - row);
    CHECK(has(tr, ">dgc:ratio=0.05,momentum=0.9,warmup=0<"));
    CHECK(has(tr, ">none<"));
    CHECK(has(tr, ">lr = 0.08<"));  // the one other key in which the runs differ
    CHECK(has(tr, " KB<"));         // byte totals of 12 rounds x 5 clients of a 2.4 KB model
    // Simulations never reject an update: no always-zero chart.
    CHECK(has(dom, "id=\"card-rejected\" hidden"));
    CHECK(has(dom, "\"bytes_round\":{\"datasets\":["));
    fs::remove_all(dir);
  }
}
