#include "edge/cloud.h"

#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <random>
#include <sstream>

#include "aggregation/aggregator.h"
#include "compression/compressor.h"
#include "compression/state.h"
#include "core/error.h"
#include "core/flat_config.h"
#include "core/error_text.h"
#include "core/model_digest.h"
#include "core/peer_text.h"
#include "core/refusal_log.h"
#include "core/spec.h"
#include "edge/act_codec.h"
#include "edge/cloud_store.h"
#include "edge/split.h"
#include "wire/net.h"
#include "wire/wire.h"

namespace sparrow::edge {

// ---- the server ----------------------------------------------------------------------

namespace {

using wire::ErrorCode;

struct Session {
  std::string key;         // the CURVE key the client_id is bound to ("" when insecure)
  std::string routing_id;  // the connection that said Hello last
  std::unique_ptr<CloudHalf> half;
  uint64_t last_step = 0;  // last applied training step
  std::string last_reply;  // serialized SplitGradient of last_step ("" before any step in this process)
  StepGuard guard{1, 0};   // set from the config by new_session
};

// A training step computed but not applied: the top's .grad holds its gradient
// and the session's CloudHalf its new basis; commit_step applies it,
// discard_step puts both back.
struct PreparedStep {
  CloudHalf::Result result;
  CodecState peer_before;                  // the session's codec state before the step
  std::vector<at::Tensor> buffers_before;  // the model's buffers (BatchNorm statistics) before the forward
  double grad_norm = 0;
};

wire::Message message(wire::Body body) {
  wire::Message m;
  m.body = std::move(body);
  return m;
}

std::string random_run_id() {
  std::random_device rd;
  std::ostringstream os;
  os << std::hex << rd() << rd();
  return "edge-" + os.str();
}

}  // namespace

struct CloudServer::Impl {
  CloudServer& self;
  CloudConfig cfg;
  std::shared_ptr<core::Model> model;
  std::unique_ptr<Split> split;
  std::unique_ptr<Sgd> sgd;
  uint64_t digest = 0;
  std::string label, run_id;
  wire::ParseLimits limits;
  std::vector<int64_t> act_sample_shape;  // per-sample activation shape; empty when unknown (TorchScript)

  zmq::context_t ctx{1};
  core::RefusalLog refused_log;  // before zap: its thread notes here
  std::unique_ptr<net::ZapHandler> zap;
  zmq::socket_t router;
  std::string endpoint;

  std::map<std::string, Session> sessions;      // client id -> session
  std::map<std::string, std::string> by_route;  // routing id -> client id
  // One key, one device (as sparrow-server binds client ids): a CURVE key that
  // opened a session cannot open others under other ids, which would count it
  // several times in SplitFed rounds and multiply its steps on the top.
  std::map<std::string, std::string> id_of_key;  // CURVE key -> the device id it bound first

  // SplitFed: the round being collected is fed_round + 1.
  uint64_t fed_round = 0;
  std::unique_ptr<aggregation::StreamingAggregator> agg;
  std::set<std::string> fed_members;  // sessions whose update of fed_round + 1 is in agg
  std::string fed_task;               // serialized Task of fed_round
  std::unique_ptr<compression::Compressor> dense;

  std::unique_ptr<CloudStore> store;              // null: in memory only
  const zmq::message_t* current_frame = nullptr;  // the message being handled (its bytes go to the log)
  bool replaying = false;                         // applying the log at start-up: nothing is sent or logged

  struct {
    std::atomic<uint64_t> hellos{0}, steps_applied{0}, duplicates{0}, evals{0}, errors_sent{0}, out_of_order{0},
        bytes_in{0}, bytes_out{0}, fed_rounds{0}, replayed{0}, snapshots{0};
  } n;

  Impl(CloudServer& s, CloudConfig c) : self(s), cfg(std::move(c)) {
    model = core::make_model(cfg.model, cfg.seed);
    if (!cfg.weights.empty()) load_weights(*model, cfg.weights);
    split = std::make_unique<Split>(split_model(model, cfg.cut));
    CloudHalf probe(split->top, cfg.grad_codec);  // ConfigError for a bad codec, before binding
    sgd = std::make_unique<Sgd>(split->top.parameters(), cfg.lr, cfg.momentum);
    digest = bottom_digest(split->bottom.parameter_names(), split->bottom.parameters());
    label = split_model_label(cfg.model, cfg.cut);
    if (cfg.model.rfind("torchscript:", 0) != 0) {
      std::vector<int64_t> in{1};
      for (int64_t d : core::model_input_shape(cfg.model)) in.push_back(d);
      torch::NoGradGuard no_grad;
      split->bottom.train(false);
      act_sample_shape = split->bottom.forward(torch::zeros(in)).sizes().slice(1).vec();
      split->bottom.train(true);
    }
    run_id = random_run_id();
    if (cfg.fedavg_devices > 0) {
      aggregation::TensorShapes shapes;
      const auto names = split->bottom.parameter_names();
      const auto params = split->bottom.parameters();
      for (size_t i = 0; i < names.size(); ++i) shapes.emplace_back(names[i], params[i].sizes().vec());
      agg = std::make_unique<aggregation::StreamingAggregator>(shapes);
      compression::register_builtins();
      dense = compression::make_compressor("none");
    }
    limits.max_bytes = cfg.max_message_mb << 20;

    router = zmq::socket_t(ctx, zmq::socket_type::router);
    if (cfg.insecure) {
      spdlog::warn("event=insecure msg=\"plain TCP without CurveZMQ: traffic is neither encrypted nor authenticated\"");
    } else {
      net::KeyPair keys = net::load_keypair(cfg.key);
      std::set<std::string> allowed = net::load_allow_list(cfg.allow);
      spdlog::info("event=allow_list path={} keys={}", cfg.allow, allowed.size());
      // One warning per source address and minute (docs/security.md), the
      // counts held back written by run().
      zap = std::make_unique<net::ZapHandler>(ctx, std::move(allowed),
                                              [this](const std::string& key, const std::string& addr, bool ok) {
                                                if (ok) return;
                                                if (const auto line = refused_log.note(addr, key))
                                                  spdlog::warn("{}", core::RefusalLog::text(*line));
                                              });
      net::make_curve_server(router, keys);
    }
    net::set_limits(router, limits.max_bytes, static_cast<int>(cfg.heartbeat_ms));
    try {
      net::check_endpoint("listen", cfg.listen, /*for_bind=*/true);
      router.bind(cfg.listen);
    } catch (const zmq::error_t& e) {
      throw ConfigError("listen: cannot bind '" + cfg.listen + "': " + e.what());
    }
    endpoint = router.get(zmq::sockopt::last_endpoint);
    if (!cfg.state.empty()) restore();
    spdlog::info("event=listening endpoint={} curve={} model={} digest={} run_id={}", endpoint, cfg.insecure ? 0 : 1,
                 label, digest, run_id);
  }

  // ---- state file ----

  // What the log's entries depend on besides the messages themselves: applied
  // again with other settings they would not give the same top.
  std::string replay_config() const {
    std::ostringstream os;
    os << "grad_codec=" << cfg.grad_codec << ";lr=" << cfg.lr << ";momentum=" << cfg.momentum
       << ";fedavg_devices=" << cfg.fedavg_devices;
    return os.str();
  }

  CloudSnapshot make_snapshot() const {
    CloudSnapshot c;
    c.seq = store->last_seq();
    std::map<std::string, at::Tensor> top;
    const auto names = split->top.parameter_names();
    const auto params = split->top.parameters();
    for (size_t i = 0; i < names.size(); ++i) {
      top["w/" + names[i]] = params[i];
      top["m/" + names[i]] = sgd->buffers()[i];
    }
    // Each device's step-guard history (doubles as fp64 tensors: exact).
    for (const auto& [id, session] : sessions)
      if (!session.guard.history().empty()) top["g/" + id] = torch::tensor(session.guard.history(), torch::kDouble);
    c.top = compression::serialize_weights(top);
    c.fed_round = fed_round;
    c.fed_task = fed_task;
    for (const auto& [id, session] : sessions)
      c.sessions.push_back(
          {id, session.key, session.last_step, session.last_reply, serialize_codec_state(session.half->peer_state())});
    return c;
  }

  void write_snapshot() {
    store->write_snapshot(make_snapshot());
    ++n.snapshots;
  }

  // A snapshot every checkpoint_every log entries; a failure (a full disk) is
  // logged and retried later: the log still holds every step.
  void maybe_snapshot() {
    if (!store || store->entries_since_snapshot() < static_cast<int64_t>(cfg.checkpoint_every)) return;
    try {
      write_snapshot();
    } catch (const std::exception& e) {
      spdlog::warn("event=snapshot_failed state={} error=\"{}\"", store->path(), e.what());
    }
  }

  void restore() {
    store = std::make_unique<CloudStore>(cfg.state, label, digest, cfg.fsync);
    run_id = store->run_id(run_id);
    std::optional<CloudSnapshot> snap = store->snapshot();
    if (!snap) {  // a new state file: the initial top is the first snapshot
      store->set_replay_config(replay_config());
      write_snapshot();
      spdlog::info("event=state_created state={}", cfg.state);
      return;
    }
    const std::vector<LogEntry> log = store->replay_log(*snap);
    const std::string recorded = store->replay_config();
    SPARROW_CHECK_T(ConfigError, log.empty() || recorded == replay_config(),
                    "state '" << cfg.state << "' holds " << log.size() << " steps applied with " << recorded << ", not "
                              << replay_config()
                              << ": start once with those settings (the steps are applied again and a snapshot is "
                                 "written), then change them");
    // The snapshot: the top, its momentum, the SplitFed round, the sessions.
    const auto top = compression::deserialize_weights(snap->top);
    const auto names = split->top.parameter_names();
    auto params = split->top.parameters();
    for (size_t i = 0; i < names.size(); ++i)
      for (const char* prefix : {"w/", "m/"}) {
        auto it = top.find(prefix + names[i]);
        SPARROW_CHECK_T(FormatError, it != top.end() && it->second.sizes() == params[i].sizes(),
                        "state '" << cfg.state << "': the snapshot has no fitting '" << prefix << names[i] << "'");
      }
    {
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < names.size(); ++i) {
        params[i].copy_(top.at("w/" + names[i]));
        sgd->buffers()[i].copy_(top.at("m/" + names[i]));
      }
    }
    fed_round = snap->fed_round;
    fed_task = snap->fed_task;
    for (const auto& row : snap->sessions) {
      Session& session = new_session(row.client_id, row.key, row.last_step);
      session.last_reply = row.last_reply;
      if (auto g = top.find("g/" + row.client_id); g != top.end() && g->second.dim() == 1) {
        const at::Tensor h = g->second.to(at::kDouble).contiguous();
        session.guard.restore(std::vector<double>(h.data_ptr<double>(), h.data_ptr<double>() + h.numel()));
      }
      if (!row.codec.empty()) session.half->restore_peer_state(deserialize_codec_state(row.codec));
    }
    // The log, with the code that applied it the first time.
    replaying = true;
    for (const LogEntry& e : log) {
      try {
        replay(e);
      } catch (const std::exception& ex) {  // refused the first time too
        spdlog::debug("event=replay_refused seq={} error=\"{}\"", e.seq, ex.what());
      }
      ++n.replayed;
    }
    replaying = false;
    store->set_replay_config(replay_config());
    if (!log.empty()) write_snapshot();
    spdlog::info("event=state_restored state={} sessions={} replayed={} fed_round={}", cfg.state, sessions.size(),
                 log.size(), fed_round);
  }

  void replay(const LogEntry& e) {
    if (e.kind == LogKind::kHello) {
      if (!sessions.count(e.client_id)) new_session(e.client_id, e.key, e.number);
      return;
    }
    wire::Message m = wire::parse(e.body.data(), e.body.size(), limits);
    if (auto* a = std::get_if<wire::SplitActivation>(&m.body)) {
      Session& session = sessions.at(a->session);
      if (a->step == session.last_step + 1) {
        PreparedStep p = prepare_step(session, *a);  // admitted when logged: only finiteness is checked again
        commit_step(session, *a, p);
      }
    } else if (auto* u = std::get_if<wire::ModelUpdate>(&m.body)) {
      if (u->round == fed_round + 1 && !fed_members.count(u->client_id)) apply_update(*u);
    }
  }

  // Commits the message being handled to the log before it is applied; its seq, or 0 in memory.
  int64_t log_message(LogKind kind, const std::string& client_id, const std::string& key, uint64_t number) {
    if (!store || replaying) return 0;
    LogEntry e;
    e.kind = kind;
    e.client_id = client_id;
    e.key = key;
    e.number = number;
    if (current_frame && kind != LogKind::kHello)
      e.body.assign(static_cast<const char*>(current_frame->data()), current_frame->size());
    return store->append(std::move(e));
  }
  // Applies `apply` after logging; a refusal afterwards takes the entry out again.
  template <typename F>
  void logged(int64_t seq, F&& apply) {
    try {
      apply();
    } catch (...) {
      if (seq > 0) {
        try {
          store->drop(seq);
        } catch (const std::exception& e) {  // applying it again at a restart is refused the same way
          spdlog::warn("event=log_drop_failed seq={} error=\"{}\"", seq, e.what());
        }
      }
      throw;
    }
  }

  Session& new_session(const std::string& client_id, const std::string& key, uint64_t last_step) {
    Session s;
    s.key = key;
    s.half = std::make_unique<CloudHalf>(split->top, cfg.grad_codec);
    s.last_step = last_step;
    s.guard = StepGuard(cfg.max_grad_norm, cfg.grad_norm_factor);
    if (!key.empty()) id_of_key.emplace(key, client_id);  // the first binding stands
    return sessions.emplace(client_id, std::move(s)).first->second;
  }

  ~Impl() {
    router.close();
    zap.reset();
  }

  void send(const std::string& rid, const std::string& bytes) {
    n.bytes_out += bytes.size();
    try {
      if (!net::send_bytes_to(router, rid, bytes, /*dont_wait=*/true))
        spdlog::debug("event=send_dropped reason=peer_gone_or_full");
    } catch (const zmq::error_t& e) {
      spdlog::warn("event=send_failed error=\"{}\"", e.what());
    }
  }
  // The peer gets `text` without its internal detail (core::peer_text); the
  // log line has the full text (`detail`, when the reply is made from an exception).
  void reply_error(const std::string& rid, ErrorCode code, const std::string& text, const std::string& detail = "") {
    ++n.errors_sent;
    spdlog::info("event=error_reply code={} msg=\"{}\"", wire::error_code_name(code),
                 core::printable(detail.empty() ? text : detail));
    send(rid, wire::serialize(net::error_message(code, text)));
  }

  void run() {
    while (!self.stop_.load()) {
      zmq::pollitem_t item{static_cast<void*>(router), 0, ZMQ_POLLIN, 0};
      try {
        zmq::poll(&item, 1, std::chrono::milliseconds(100));
        for (const auto& l : refused_log.due()) spdlog::warn("{}", core::RefusalLog::text(l));
        if (!(item.revents & ZMQ_POLLIN)) continue;
        for (int i = 0; i < 64 && receive_one(); ++i) maybe_snapshot();
      } catch (const zmq::error_t& e) {
        if (e.num() == ETERM) break;
        if (e.num() != EINTR) spdlog::error("event=io_error error=\"{}\"", e.what());
      }
    }
    for (const auto& l : refused_log.drain()) spdlog::warn("{}", core::RefusalLog::text(l));
    if (store && store->entries_since_snapshot() > 0) {
      try {
        write_snapshot();
        spdlog::info("event=snapshot state={} seq={}", store->path(), store->last_seq());
      } catch (const std::exception& e) {  // the log still holds every step
        spdlog::warn("event=snapshot_failed state={} error=\"{}\"", store->path(), e.what());
      }
    }
  }

  bool receive_one() {
    std::optional<net::RoutedFrame> in = net::receive_routed(router);
    if (!in) return false;
    if (!in->payload) return true;
    const std::string& rid = in->routing_id;
    zmq::message_t& frame = in->frame;
    n.bytes_in += frame.size();
    if (in->extra_frames) {
      reply_error(rid, ErrorCode::kMalformed, "one frame per message expected");
      return true;
    }
    const std::string key = net::peer_key(frame);
    current_frame = &frame;
    try {
      wire::Message m = wire::parse(frame.data(), frame.size(), limits);
      handle(rid, key, m);
      current_frame = nullptr;
    } catch (const std::exception& e) {
      current_frame = nullptr;
      // Every check runs before any change, so the state is as it was.
      const wire::ErrorBody eb = wire::error_for(e);
      reply_error(rid, eb.code, eb.message, core::error_text(e));
    }
    return true;
  }

  void handle(const std::string& rid, const std::string& key, wire::Message& m) {
    if (auto* h = std::get_if<wire::Hello>(&m.body)) return on_hello(rid, key, *h);
    if (auto* a = std::get_if<wire::SplitActivation>(&m.body)) return on_activation(rid, *a);
    if (auto* hb = std::get_if<wire::Heartbeat>(&m.body)) {
      send(rid, wire::serialize(message(*hb)));
      return;
    }
    if (std::get_if<wire::Bye>(&m.body)) {
      by_route.erase(rid);
      return;
    }
    if (auto* u = std::get_if<wire::ModelUpdate>(&m.body)) return on_update(rid, *u);
    if (std::get_if<wire::ErrorBody>(&m.body)) return;  // never answer an Error with an Error
    reply_error(rid, ErrorCode::kUnsupported, std::string("unexpected ") + wire::body_name(m.body));
  }

  void on_hello(const std::string& rid, const std::string& key, const wire::Hello& h) {
    ++n.hellos;
    // Device ids are logged and stored: the server's character set (docs/security.md).
    if (const std::string why = core::client_id_problem(h.client_id); !why.empty()) {
      reply_error(rid, ErrorCode::kRejected, why);
      return;
    }
    if (h.model != label || h.model_digest != digest) {
      reply_error(rid, ErrorCode::kRejected,
                  "model mismatch: this cloud serves '" + label + "' (bottom digest " + std::to_string(digest) + ")");
      return;
    }
    auto it = sessions.find(h.client_id);
    if (it != sessions.end() && it->second.key != key) {
      reply_error(rid, ErrorCode::kRejected, "client_id '" + h.client_id + "' is bound to another key");
      return;
    }
    if (!key.empty()) {
      auto kit = id_of_key.find(key);
      if (kit != id_of_key.end() && kit->second != h.client_id) {
        spdlog::warn("event=key_bound key={} device={} bound_to={}", key, core::printable(h.client_id),
                     core::printable(kit->second));
        reply_error(rid, ErrorCode::kRejected,
                    "this key is bound to device id '" + kit->second + "': one key is one device");
        return;
      }
    }
    if (it == sessions.end()) {
      // A session this cloud has not seen (a new device, or a cloud without a
      // state file that restarted): the device's completed step is where the
      // sequence goes on. Logged: the id is bound to this key from now on.
      log_message(LogKind::kHello, h.client_id, key, h.last_round.value_or(0));
      new_session(h.client_id, key, h.last_round.value_or(0));
      it = sessions.find(h.client_id);
    }
    Session& s = it->second;
    if (!s.routing_id.empty() && s.routing_id != rid) by_route.erase(s.routing_id);
    s.routing_id = rid;
    by_route[rid] = h.client_id;
    wire::Welcome w;
    w.run_id = run_id;
    w.heartbeat_ms = static_cast<uint32_t>(cfg.heartbeat_ms);
    w.round = s.last_step;
    w.max_message_bytes = limits.max_bytes;
    w.model_seed = cfg.seed;
    spdlog::info("event=hello client={} last_step={} device_step={}", h.client_id, s.last_step,
                 h.last_round.value_or(0));
    send(rid, wire::serialize(message(w)));
  }

  // Labels as a tensor, checked against the activation's batch.
  at::Tensor labels_tensor(const wire::SplitActivation& a, const ActPacket& p) const {
    SPARROW_CHECK_T(FormatError, a.shape == p.shape, "activation: frame shape and payload shape differ");
    SPARROW_CHECK_T(
        FormatError,
        act_sample_shape.empty() || std::vector<int64_t>(p.shape.begin() + 1, p.shape.end()) == act_sample_shape,
        "activation: shape does not match the cut of '" << label << "'");
    SPARROW_CHECK_T(FormatError, static_cast<int64_t>(a.labels.size()) == p.shape.at(0),
                    "activation: " << a.labels.size() << " labels for a batch of " << p.shape.at(0));
    return torch::tensor(a.labels, torch::kLong);
  }

  // The codec a device names must be a valid spec whose method produces the
  // payload's format (FormatError otherwise, before anything changes).
  static void check_codec(const wire::SplitActivation& a, const ActPacket& p) {
    std::string method;
    try {
      ActCodec codec(a.codec);
      method = Spec::parse(a.codec).method();
    } catch (const ConfigError& e) {
      throw FormatError("activation: codec '" + a.codec + "' is not a valid codec: " + e.what());
    }
    const std::string f = act_format_name(p.format);
    const bool ok = (method == "none" && f == "dense") || (method == "topk" && f == "topk") ||
                    ((method == "q8" || method == "q4") && f == "quant") ||
                    (method == "lowrank" && (f.rfind("lowrank", 0) == 0 || f == "projected"));
    SPARROW_CHECK_T(FormatError, ok,
                    "activation: codec '" << a.codec << "' does not produce the payload's format '" << f << "'");
  }

  void on_activation(const std::string& rid, const wire::SplitActivation& a) {
    auto r = by_route.find(rid);
    if (r == by_route.end() || r->second != a.session) {
      reply_error(rid, ErrorCode::kRejected, "unknown session '" + a.session + "': Hello first");
      return;
    }
    Session& s = sessions.at(a.session);
    if (!a.train) return on_eval(rid, s, a);
    if (a.step == s.last_step && !s.last_reply.empty()) {
      ++n.duplicates;
      spdlog::info("event=duplicate client={} step={}", a.session, a.step);
      send(rid, s.last_reply);
      return;
    }
    if (a.step != s.last_step + 1) {
      ++n.out_of_order;
      reply_error(rid, ErrorCode::kRejected, "expected step " + std::to_string(s.last_step + 1));
      return;
    }
    {
      // What can be checked before the step is logged.
      const ActPacket p = ActPacket::deserialize(a.payload.data(), a.payload.size());
      check_codec(a, p);
      labels_tensor(a, p);
    }
    // Computed and checked before it is logged: a refused step leaves the top,
    // its momentum, the session and the log as they were.
    PreparedStep p = prepare_step(s, a);
    int64_t seq = 0;
    try {
      seq = log_message(LogKind::kStep, a.session, s.key, a.step);
    } catch (...) {
      discard_step(s, p);
      throw;
    }
    logged(seq, [&] { commit_step(s, a, p); });
    ++n.steps_applied;
    spdlog::debug("event=step client={} step={}", a.session, a.step);
    send(rid, s.last_reply);
  }

  // The step's forward and backward on the top, checked by the session's step
  // guard (only finiteness while replaying the log: a logged step was admitted).
  // FormatError for what CloudHalf refuses, ProtocolError{Rejected} for what the
  // guard refuses; either way nothing is changed.
  PreparedStep prepare_step(Session& s, const wire::SplitActivation& a) {
    const ActPacket packet = ActPacket::deserialize(a.payload.data(), a.payload.size());
    check_codec(a, packet);
    const at::Tensor y = labels_tensor(a, packet);
    split->top.train(true);
    sgd->zero_grad();
    PreparedStep p;
    p.peer_before = s.half->peer_state();
    for (const at::Tensor& b : model->buffers(/*recurse=*/true)) p.buffers_before.push_back(b.detach().clone());
    try {
      p.result = s.half->step(packet, y);  // FormatError before any change
      p.grad_norm = top_grad_norm();
      const std::string why = replaying
                                  ? StepGuard(std::numeric_limits<double>::max(), 0).refusal(p.result.loss, p.grad_norm)
                                  : s.guard.refusal(p.result.loss, p.grad_norm);
      if (!why.empty()) {
        spdlog::warn("event=step_refused client={} key={} step={} loss={} grad_norm={} reason=\"{}\"",
                     core::printable(a.session), s.key, a.step, p.result.loss, p.grad_norm, why);
        throw wire::ProtocolError(ErrorCode::kRejected, "activation: step refused: " + why);
      }
    } catch (...) {
      discard_step(s, p);
      throw;
    }
    return p;
  }

  void discard_step(Session& s, PreparedStep& p) {
    sgd->zero_grad();
    s.half->restore_peer_state(std::move(p.peer_before));
    torch::NoGradGuard no_grad;
    size_t i = 0;
    for (at::Tensor b : model->buffers(/*recurse=*/true))
      if (i < p.buffers_before.size()) b.copy_(p.buffers_before[i++]);
  }

  // L2 norm of the top's accumulated gradient, summed in fp64 (fp32 squares of
  // a 1e20 gradient would overflow to inf and hide the size).
  double top_grad_norm() const {
    double sum = 0;
    for (const at::Tensor& param : split->top.parameters()) {
      const at::Tensor& g = param.grad();
      if (g.defined()) sum += g.to(at::kDouble).pow(2).sum().item<double>();
    }
    return std::sqrt(sum);
  }

  // The prepared step's change of state: optimiser step, the session's step
  // guard, step and reply.
  void commit_step(Session& s, const wire::SplitActivation& a, PreparedStep& p) {
    const CloudHalf::Result& res = p.result;
    sgd->step();
    sgd->zero_grad();
    s.guard.accepted(p.grad_norm);
    wire::SplitGradient g;
    g.session = a.session;
    g.step = a.step;
    g.loss = res.loss;
    g.correct = static_cast<uint64_t>(res.correct);
    if (res.gradient) {
      g.codec = act_format_name(res.gradient->format);
      g.shape = res.gradient->shape;
      g.payload = res.gradient->serialize();
    }
    s.last_step = a.step;
    s.last_reply = wire::serialize(message(g));
  }

  void on_update(const std::string& rid, const wire::ModelUpdate& u) {
    if (!agg) {
      reply_error(rid, ErrorCode::kUnsupported, "SplitFed is off on this cloud (fedavg_devices = 0)");
      return;
    }
    auto r = by_route.find(rid);
    if (r == by_route.end() || r->second != u.client_id) {
      reply_error(rid, ErrorCode::kRejected, "unknown session '" + u.client_id + "': Hello first");
      return;
    }
    wire::Message ack = message(wire::Ack{u.round});
    if (u.round == fed_round && !fed_task.empty()) {  // the Task of a completed round was lost
      send(rid, fed_task);
      return;
    }
    if (u.round != fed_round + 1) {
      reply_error(rid, ErrorCode::kRejected, "expected averaging round " + std::to_string(fed_round + 1));
      return;
    }
    if (fed_members.count(u.client_id)) {  // a retry while the round is still open
      send(rid, wire::serialize(ack));
      return;
    }
    const int64_t seq = log_message(LogKind::kUpdate, u.client_id, sessions.at(u.client_id).key, u.round);
    std::set<std::string> done_members;
    logged(seq, [&] { done_members = apply_update(u); });
    spdlog::info("event=fedavg_update client={} round={} have={} of={}", u.client_id, u.round,
                 done_members.empty() ? fed_members.size() : cfg.fedavg_devices, cfg.fedavg_devices);
    send(rid, wire::serialize(ack));
    for (const auto& member : done_members) send(sessions.at(member).routing_id, fed_task);
  }

  // Folds the update (FormatError: nothing changed); when it completes the
  // round, makes the round's Task and returns the members to send it to.
  std::set<std::string> apply_update(const wire::ModelUpdate& u) {
    aggregation::EncodedUpdate update;
    for (const auto& t : u.tensors) update.emplace_back(t.name, t.tensor);
    agg->add(update, static_cast<double>(std::max<uint64_t>(1, u.num_samples)));  // FormatError: nothing changed
    fed_members.insert(u.client_id);
    if (fed_members.size() < cfg.fedavg_devices) return {};
    wire::Task task;
    task.round = u.round;
    task.model_encoding = wire::ModelEncoding::kFull;
    for (const auto& [name, mean] : agg->mean()) {
      compression::State scratch;
      task.weights.push_back({name, dense->encode(mean.contiguous(), scratch, {})});
    }
    fed_task = wire::serialize(message(task));
    fed_round = u.round;
    ++n.fed_rounds;
    std::set<std::string> members;
    members.swap(fed_members);
    agg->reset();
    spdlog::info("event=fedavg_round round={} devices={}", fed_round, cfg.fedavg_devices);
    return members;
  }

  void on_eval(const std::string& rid, Session& s, const wire::SplitActivation& a) {
    const ActPacket p = ActPacket::deserialize(a.payload.data(), a.payload.size());
    check_codec(a, p);
    const at::Tensor y = labels_tensor(a, p);
    torch::NoGradGuard no_grad;
    split->top.train(false);
    at::Tensor logits;
    try {
      logits = s.half->predict(p);
    } catch (...) {
      split->top.train(true);
      throw;
    }
    split->top.train(true);
    SPARROW_CHECK_T(FormatError,
                    y.numel() == 0 || (y.min().item<int64_t>() >= 0 && y.max().item<int64_t>() < logits.size(1)),
                    "activation: labels out of range [0, " << logits.size(1) << ")");
    wire::SplitGradient g;
    g.session = a.session;
    g.step = a.step;
    g.loss = torch::nn::functional::cross_entropy(logits, y).item<double>();
    g.correct = static_cast<uint64_t>(logits.argmax(1).eq(y).sum().item<int64_t>());
    SPARROW_CHECK_T(FormatError, std::isfinite(g.loss), "activation: the loss is not finite");
    ++n.evals;
    send(rid, wire::serialize(message(g)));
  }
};

CloudServer::CloudServer(CloudConfig cfg) : impl_(std::make_unique<Impl>(*this, std::move(cfg))) {}
CloudServer::~CloudServer() = default;

std::string CloudServer::endpoint() const { return impl_->endpoint; }
void CloudServer::run() { impl_->run(); }
uint64_t CloudServer::refused() const { return impl_->zap ? impl_->zap->refused() : 0; }

CloudServer::Counters CloudServer::counters() const {
  const auto& n = impl_->n;
  Counters c;
  c.hellos = n.hellos.load();
  c.steps_applied = n.steps_applied.load();
  c.duplicates = n.duplicates.load();
  c.evals = n.evals.load();
  c.errors_sent = n.errors_sent.load();
  c.out_of_order = n.out_of_order.load();
  c.bytes_in = n.bytes_in.load();
  c.bytes_out = n.bytes_out.load();
  c.fed_rounds = n.fed_rounds.load();
  c.replayed = n.replayed.load();
  c.snapshots = n.snapshots.load();
  return c;
}

std::map<std::string, at::Tensor> CloudServer::top_weights() const {
  return copy_weights(impl_->split->top.parameter_names(), impl_->split->top.parameters());
}

}  // namespace sparrow::edge
