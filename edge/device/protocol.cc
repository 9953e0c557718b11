#include "edge/device/protocol.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <numeric>
#include <optional>
#include <sstream>
#include <thread>

#include "core/peer_text.h"
#include "core/rng.h"
#include "wire/net.h"
#include "wire/wire.h"

namespace sparrow::edge::device {

namespace {

namespace cflat = compression::flat;

wire::Message message(wire::Body body) {
  wire::Message m;
  m.body = std::move(body);
  return m;
}

// An Error reply to a Split message.
struct ReplyError : Error {
  ReplyError(wire::ErrorCode c, const std::string& what) : Error(what), code(c) {}
  wire::ErrorCode code;
};

std::string num(double v) {
  if (!std::isfinite(v)) return "null";
  std::ostringstream os;
  os.precision(10);
  os << v;
  return os.str();
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  SPARROW_CHECK_T(ConfigError, in, "cannot read file '" << path << "'");
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// CRC-32 (the zlib / IEEE polynomial), continuing from `crc` as zlib's crc32 does.
uint32_t crc32_update(uint32_t crc, const char* p, size_t n) {
  static const auto table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1u) ? 0xedb88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = table[(crc ^ static_cast<unsigned char>(p[i])) & 0xffu] ^ (crc >> 8);
  return ~crc;
}
uint32_t crc32_update(uint32_t crc, const std::string& bytes) { return crc32_update(crc, bytes.data(), bytes.size()); }

const char* log_magic(StepLog format) { return format == StepLog::kPlain ? "SPLC" : "SPLG"; }

}  // namespace

// kFramed is sqlite::checksum({step text, payload}) with seed 0, which
// sparrow-edge's logs were written with.
uint32_t step_log_checksum(StepLog format, uint64_t step, const std::string& body) {
  const std::string text = std::to_string(step);
  if (format == StepLog::kPlain) return crc32_update(crc32_update(0, text), body);
  const int64_t seed = 0;
  uint32_t crc = crc32_update(0, reinterpret_cast<const char*>(&seed), sizeof seed);
  for (const std::string* s : {&text, &body}) {
    const uint64_t n = s->size();
    crc = crc32_update(crc, reinterpret_cast<const char*>(&n), sizeof n);
    crc = crc32_update(crc, *s);
  }
  return crc;
}

std::vector<int64_t> batch_indices(int64_t n, int64_t batch, uint64_t seed, uint64_t step) {
  SPARROW_CHECK(n >= 1 && batch >= 1 && step >= 1, "batch_indices: need n, batch, step >= 1");
  const int64_t b = std::min(batch, n);
  const uint64_t per_epoch = static_cast<uint64_t>(n / b);
  const uint64_t epoch = (step - 1) / per_epoch, j = (step - 1) % per_epoch;
  const uint64_t key = rng::derive(rng::derive(seed, 0x65646765 /* "edge" */), epoch);
  std::vector<uint64_t> keys(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) keys[i] = rng::at(key, static_cast<uint64_t>(i));
  std::vector<int64_t> perm(static_cast<size_t>(n));
  std::iota(perm.begin(), perm.end(), 0);
  std::sort(perm.begin(), perm.end(),
            [&](int64_t a, int64_t c) { return keys[a] < keys[c] || (keys[a] == keys[c] && a < c); });
  return std::vector<int64_t>(perm.begin() + static_cast<int64_t>(j) * b,
                              perm.begin() + static_cast<int64_t>(j + 1) * b);
}

std::string Summary::json() const {
  std::ostringstream os;
  os << "{\"steps\":" << steps << ",\"bytes_up\":" << bytes_up << ",\"bytes_down\":" << bytes_down
     << ",\"accuracy\":" << (accuracy < 0 ? std::string("null") : num(accuracy)) << ",\"eval_samples\":" << eval_samples
     << ",\"reconnects\":" << reconnects << ",\"resent\":" << resent << ",\"skipped\":" << skipped
     << ",\"fed_rounds\":" << fed_rounds << "}";
  return os.str();
}

void put_codec_state(const flat::CodecState& s, const std::string& prefix, cflat::State& out) {
  const std::pair<const char*, const flat::Matrix*> slots[] = {
      {"basis", &s.basis}, {"sketch", &s.sketch}, {"tracker", &s.tracker}};
  for (const auto& [name, m] : slots)
    if (!m->empty()) out.tensors[prefix + name] = cflat::Tensor{{m->rows, m->cols}, m->data};
  std::vector<float> meta{static_cast<float>(s.basis_id & 0xffffu), static_cast<float>(s.basis_id >> 16),
                          s.refresh_next ? 1.0f : 0.0f};
  for (int i = 0; i < 4; ++i) meta.push_back(static_cast<float>((s.steps >> (16 * i)) & 0xffffu));
  out.tensors[prefix + "meta"] = cflat::Tensor{{7}, meta};
}

flat::CodecState get_codec_state(const cflat::State& st, const std::string& prefix) {
  auto meta = st.tensors.find(prefix + "meta");
  SPARROW_CHECK_T(FormatError, meta != st.tensors.end() && meta->second.data.size() == 7,
                  "codec state: no '" << prefix << "meta'");
  const std::vector<float>& v = meta->second.data;
  auto piece = [&](int i) {
    SPARROW_CHECK_T(FormatError, v[i] >= 0 && v[i] < 65536 && v[i] == std::floor(v[i]),
                    "codec state: bad '" << prefix << "meta'");
    return static_cast<uint64_t>(v[i]);
  };
  flat::CodecState s;
  s.basis_id = static_cast<uint32_t>(piece(0) | (piece(1) << 16));
  s.refresh_next = piece(2) != 0;
  for (int i = 0; i < 4; ++i) s.steps |= piece(3 + i) << (16 * i);
  for (auto [name, slot] :
       {std::pair<const char*, flat::Matrix*>{"basis", &s.basis}, {"sketch", &s.sketch}, {"tracker", &s.tracker}}) {
    auto it = st.tensors.find(prefix + name);
    if (it == st.tensors.end()) continue;
    SPARROW_CHECK_T(FormatError, it->second.shape.size() == 2,
                    "codec state: '" << prefix << name << "' is not a matrix");
    *slot = flat::Matrix{it->second.shape[0], it->second.shape[1], it->second.data};
  }
  SPARROW_CHECK_T(FormatError, s.basis.empty() || s.basis_id != 0, "codec state: a basis without an id");
  return s;
}

struct Protocol::Impl {
  using Clock = std::chrono::steady_clock;
  using Slot = Bottom::Slot;

  Config cfg;
  Bottom& bottom;
  const std::atomic<bool>& stop;
  net::KeyPair keys;
  std::string cloud_key;
  wire::ParseLimits limits;

  zmq::context_t ctx{1};
  std::unique_ptr<zmq::socket_t> sock;
  uint64_t completed = 0;
  uint64_t fed_done = 0;        // last SplitFed round applied (saved with the progress)
  bool codec_restored = false;  // the progress file held the codec state
  std::unique_ptr<std::ofstream> step_log;
  uint64_t failures = 0;  // consecutive failed connection attempts
  Summary sum;
  std::function<bool(uint64_t)> drop_hook;

  Impl(Config c, Bottom& b, const std::atomic<bool>& s) : cfg(std::move(c)), bottom(b), stop(s) {
    SPARROW_CHECK_T(ConfigError, bottom.train_size() >= 1, "device: no training data");
    limits.max_bytes = cfg.max_message_mb << 20;
    if (cfg.insecure) {
      spdlog::warn("event=insecure msg=\"plain TCP without CurveZMQ: traffic is neither encrypted nor authenticated\"");
    } else {
      keys = net::load_keypair(cfg.key);
      cloud_key = net::load_public_key(cfg.cloud_key);
    }
    load_progress();
    replay_log();
  }

  ~Impl() {
    if (sock) sock->close();
  }

  std::vector<int64_t> batch(uint64_t step) const {
    return batch_indices(bottom.train_size(), static_cast<int64_t>(cfg.batch_size), cfg.seed, step);
  }

  // ---- progress file ----

  void load_progress() {
    if (cfg.progress.empty() || !std::ifstream(cfg.progress).good()) return;
    cflat::State st;
    try {
      st = cflat::State::deserialize(read_bytes(cfg.progress));
    } catch (const FormatError& e) {
      throw FormatError("progress '" + cfg.progress + "' is not a progress file (" + std::string(e.what()) +
                        "); restore it, or remove it to start afresh");
    }
    const auto names = bottom.names();
    const auto current = bottom.tensors(Slot::kWeights);
    std::vector<cflat::Tensor> w(names.size()), m(names.size());
    for (size_t i = 0; i < names.size(); ++i)
      for (const char* prefix : {"w/", "m/"}) {
        auto it = st.tensors.find(prefix + names[i]);
        SPARROW_CHECK_T(FormatError, it != st.tensors.end() && it->second.shape == current[i].shape,
                        "progress '" << cfg.progress << "' does not fit the bottom of '" << cfg.label << "' (" << prefix
                                     << names[i] << ")");
        (prefix[0] == 'w' ? w : m)[i] = it->second;
      }
    bottom.load(Slot::kWeights, w);
    bottom.load(Slot::kMomentum, m);
    // Buffers (BatchNorm running statistics): restored when the file has
    // them; a file of an earlier version has none and they start afresh.
    size_t restored = 0, buffers = 0;
    for (const auto& [name, b] : bottom.buffers()) {
      ++buffers;
      auto it = st.tensors.find("b/" + name);
      if (it == st.tensors.end()) continue;
      SPARROW_CHECK_T(
          FormatError, it->second.shape == b.shape,
          "progress '" << cfg.progress << "' does not fit the model of '" << cfg.label << "' (buffer " << name << ")");
      bottom.load_buffer(name, it->second);
      ++restored;
    }
    if (restored < buffers)
      spdlog::warn(
          "event=progress_without_buffers progress={} restored={} buffers={} msg=\"an older progress file: "
          "BatchNorm statistics start afresh\"",
          cfg.progress, restored, buffers);
    completed = st.step;
    if (auto it = st.tensors.find("fedavg_round"); it != st.tensors.end() && it->second.data.size() == 1)
      fed_done = static_cast<uint64_t>(it->second.data[0]);
    if (st.has("codec/meta")) {
      // The codec state as it was after the saved step: the next activation is
      // the one this device sent (or would have sent) next, byte for byte.
      bottom.set_codec_state(get_codec_state(st, "codec/"));
      codec_restored = true;
    } else {
      // An older progress file without it: the next packet carries a new basis.
      bottom.force_basis_refresh();
    }
    spdlog::info("event=resumed progress={} step={}", cfg.progress, completed);
  }

  void save_progress() {
    if (cfg.progress.empty()) return;
    cflat::State st;
    st.step = completed;
    st.tensors["fedavg_round"] = cflat::Tensor{{1}, {static_cast<float>(fed_done)}};
    const auto names = bottom.names();
    auto w = bottom.tensors(Slot::kWeights), m = bottom.tensors(Slot::kMomentum);
    for (size_t i = 0; i < names.size(); ++i) {
      st.tensors["w/" + names[i]] = std::move(w[i]);
      st.tensors["m/" + names[i]] = std::move(m[i]);
    }
    // Buffers (BatchNorm running statistics and counts; counts are exact as
    // fp32 up to 2^24 steps).
    for (auto& [name, b] : bottom.buffers()) st.tensors["b/" + name] = std::move(b);
    put_codec_state(bottom.codec_state(), "codec/", st);
    const std::string tmp = cfg.progress + ".tmp";
    {
      std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
      SPARROW_CHECK_T(Error, out, "cannot write '" << tmp << "'");
      const std::string bytes = st.serialize();
      out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
      SPARROW_CHECK_T(Error, out.good(), "cannot write '" << tmp << "'");
    }
    SPARROW_CHECK_T(Error, std::rename(tmp.c_str(), cfg.progress.c_str()) == 0,
                    "cannot replace '" << cfg.progress << "'");
    truncate_log();  // the progress holds every logged step now
  }

  // ---- step log ----
  // progress + ".log": one record per step completed since the progress was
  // saved, appended before the step's gradient is applied: magic (StepLog),
  // u64 step, u32 size, the SplitGradient payload, u32 checksum. A restart
  // applies them again on top of the saved progress (the same batch, forward
  // and codec state, the logged gradient), so a kill -9 loses no step the
  // cloud acknowledged; a torn last record is ignored.

  std::string log_path() const { return cfg.progress + ".log"; }

  void log_step(uint64_t step, const std::vector<uint8_t>& payload) {
    if (cfg.progress.empty()) return;
    if (!step_log) {
      step_log = std::make_unique<std::ofstream>(log_path(), std::ios::binary | std::ios::app);
      SPARROW_CHECK_T(Error, *step_log, "cannot write '" << log_path() << "'");
    }
    const std::string body(payload.begin(), payload.end());
    const uint32_t size = static_cast<uint32_t>(payload.size());
    const uint32_t crc = step_log_checksum(cfg.step_log, step, body);
    step_log->write(log_magic(cfg.step_log), 4);
    step_log->write(reinterpret_cast<const char*>(&step), sizeof step);
    step_log->write(reinterpret_cast<const char*>(&size), sizeof size);
    step_log->write(body.data(), static_cast<std::streamsize>(body.size()));
    step_log->write(reinterpret_cast<const char*>(&crc), sizeof crc);
    step_log->flush();  // in the kernel's hands: survives a kill -9 of this process
    SPARROW_CHECK_T(Error, step_log->good(), "cannot write '" << log_path() << "' (disk full?)");
  }

  // The logged steps after `completed`, in order, up to the first gap or torn record.
  std::vector<std::pair<uint64_t, std::string>> read_log() const {
    std::vector<std::pair<uint64_t, std::string>> out;
    std::ifstream in(log_path(), std::ios::binary);
    uint64_t expect = completed + 1;
    for (;;) {
      char magic[4];
      uint64_t step = 0;
      uint32_t size = 0, crc = 0;
      if (!in.read(magic, 4) || std::memcmp(magic, log_magic(cfg.step_log), 4) != 0) break;
      if (!in.read(reinterpret_cast<char*>(&step), sizeof step) ||
          !in.read(reinterpret_cast<char*>(&size), sizeof size))
        break;
      if (size > limits.max_bytes) break;
      std::string body(size, '\0');
      if (!in.read(body.data(), size) || !in.read(reinterpret_cast<char*>(&crc), sizeof crc)) break;
      if (crc != step_log_checksum(cfg.step_log, step, body)) break;
      if (step < expect) continue;  // already in the progress
      if (step != expect) break;
      out.emplace_back(step, std::move(body));
      ++expect;
    }
    return out;
  }

  void truncate_log() {
    step_log.reset();
    std::error_code ec;
    std::filesystem::remove(log_path(), ec);
  }

  // Applies the logged steps again (at start-up, before any connection).
  void replay_log() {
    if (cfg.progress.empty()) return;
    const auto entries = read_log();
    if (entries.empty()) return;
    uint64_t applied = 0;
    for (const auto& [step, payload] : entries) {
      if (step > cfg.steps) break;
      bottom.forward(batch(step));
      if (!payload.empty()) {
        try {
          bottom.backward(ActPacket::deserialize(reinterpret_cast<const uint8_t*>(payload.data()), payload.size()));
        } catch (const std::exception& e) {
          spdlog::warn("event=log_replay_stopped step={} error=\"{}\"", step, e.what());
          break;
        }
        bottom.step();
      }
      completed = step;
      ++applied;
    }
    spdlog::info("event=log_replayed steps={} step={}", applied, completed);
    save_progress();
  }

  // ---- transport ----

  void check_stop() {
    if (stop.load()) throw Stopped("device stopped");
  }

  void close_socket() {
    if (sock) sock->close();
    sock.reset();
  }

  void backoff() {
    const double base =
        std::min<double>(cfg.backoff_max_ms, cfg.backoff_initial_ms * std::pow(2.0, std::min<uint64_t>(failures, 30)));
    const uint64_t key = rng::derive(rng::hash_name(cfg.device_id), 0x626b6f66);
    const double ms = base * (0.5 + 0.5 * rng::uniform01(key, sum.reconnects));
    spdlog::info("event=backoff ms={:.0f} attempt={}", ms, failures);
    const auto until = Clock::now() + std::chrono::microseconds(static_cast<int64_t>(ms * 1000));
    while (Clock::now() < until) {
      check_stop();
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }

  // Counts a failed attempt; Error after max_reconnects in a row.
  void failed(const std::string& why) {
    close_socket();
    ++failures;
    ++sum.reconnects;
    spdlog::warn("event=link_failure reason=\"{}\" attempt={}", core::printable(why), failures);
    SPARROW_CHECK_T(Error, failures <= cfg.max_reconnects,
                    "the cloud at " << cfg.cloud << " did not answer after " << cfg.max_reconnects
                                    << " reconnects (last: " << why << ")");
    backoff();
  }

  bool send_bytes(const std::string& bytes) {
    try {
      if (!sock->send(zmq::buffer(bytes), zmq::send_flags::dontwait)) return false;
    } catch (const zmq::error_t& e) {
      spdlog::warn("event=send_failed error=\"{}\"", e.what());
      return false;
    }
    sum.bytes_up += bytes.size();
    return true;
  }

  // One message or nullopt at `deadline`. A frame that fails to parse is logged and skipped.
  std::optional<wire::Message> receive_until(Clock::time_point deadline) {
    for (;;) {
      check_stop();
      const auto now = Clock::now();
      if (now >= deadline) return std::nullopt;
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count();
      zmq::pollitem_t item{static_cast<void*>(*sock), 0, ZMQ_POLLIN, 0};
      try {
        zmq::poll(&item, 1, std::chrono::milliseconds(std::min<int64_t>(left + 1, 100)));
      } catch (const zmq::error_t& e) {
        if (e.num() == EINTR) continue;  // a signal (SIGTERM): check_stop() decides
        throw;
      }
      if (!(item.revents & ZMQ_POLLIN)) continue;
      zmq::message_t frame;
      if (!sock->recv(frame, zmq::recv_flags::dontwait)) continue;
      sum.bytes_down += frame.size();
      try {
        return wire::parse(frame.data(), frame.size(), limits);
      } catch (const wire::ProtocolError& e) {
        spdlog::warn("event=bad_frame error=\"{}\"", e.what());
      }
    }
  }

  // Opens a socket and says Hello until a Welcome comes; returns the cloud's
  // last applied step for this device. Error when the cloud refuses.
  uint64_t connect() {
    for (;;) {
      check_stop();
      sock = std::make_unique<zmq::socket_t>(ctx, zmq::socket_type::dealer);
      if (!cfg.insecure) net::make_curve_client(*sock, keys, cloud_key);
      net::set_limits(*sock, limits.max_bytes);
      sock->connect(cfg.cloud);
      wire::Hello h;
      h.client_id = cfg.device_id;
      h.num_samples = static_cast<uint64_t>(bottom.train_size());
      h.model = cfg.label;
      h.model_digest = bottom.digest();
      h.last_round = completed;
      h.software = cfg.software;
      // DEALER queues the Hello until the connection (and CURVE handshake) is up.
      const std::string bytes = wire::serialize(message(h));
      sock->send(zmq::buffer(bytes), zmq::send_flags::none);
      sum.bytes_up += bytes.size();
      const auto deadline = Clock::now() + std::chrono::milliseconds(cfg.reply_timeout_ms);
      while (auto m = receive_until(deadline)) {
        if (auto* w = std::get_if<wire::Welcome>(&m->body)) {
          failures = 0;
          spdlog::info("event=welcome cloud={} run_id={} cloud_step={} device_step={}", cfg.cloud,
                       core::printable(w->run_id), w->round, completed);
          return w->round;
        }
        if (auto* e = std::get_if<wire::ErrorBody>(&m->body))
          throw Error(std::string("the cloud refused the Hello (") + wire::error_code_name(e->code) +
                      "): " + e->message);
      }
      failed("no Welcome within reply_timeout_ms");
    }
  }

  // Sends `bytes` (a SplitActivation of `step`) until its SplitGradient comes,
  // reconnecting and resending after a timeout. ReplyError for an Error reply.
  wire::SplitGradient exchange(const std::string& bytes, uint64_t step, bool train) {
    bool first = true;
    for (;;) {
      if (!sock) {
        const uint64_t cloud = connect();
        // The cloud has applied this step (its reply was lost) or not yet.
        SPARROW_CHECK_T(Error, !train || cloud + 1 == step || cloud == step,
                        "after reconnecting: the cloud is at step " << cloud << ", this device at step " << step);
      }
      if (!first) ++sum.resent;
      first = false;
      if (!send_bytes(bytes)) {
        failed("send failed");
        continue;
      }
      if (train && drop_hook && drop_hook(step)) {
        failed("connection dropped (test hook)");
        continue;
      }
      const auto deadline = Clock::now() + std::chrono::milliseconds(cfg.reply_timeout_ms);
      while (auto m = receive_until(deadline)) {
        if (auto* g = std::get_if<wire::SplitGradient>(&m->body)) {
          if (g->step == step && g->session == cfg.device_id) return std::move(*g);
          continue;  // a stale reply
        }
        if (auto* e = std::get_if<wire::ErrorBody>(&m->body)) throw ReplyError(e->code, e->message);
      }
      failed("no reply to step " + std::to_string(step) + " within reply_timeout_ms");
    }
  }

  std::string activation_bytes(const ActPacket& act, uint64_t step, std::vector<int64_t> y, bool train) {
    wire::SplitActivation a;
    a.session = cfg.device_id;
    a.step = step;
    a.codec = bottom.codec_spec();
    a.shape = act.shape;
    a.payload = act.serialize();
    a.labels = std::move(y);
    a.train = train;
    return wire::serialize(message(a));
  }

  // ---- the run ----

  Summary run() {
    const uint64_t cloud = connect();
    if (cloud == completed + 1 && (codec_restored || !bottom.lowrank())) {
      // The device died after the cloud applied this step but before its own
      // progress held it: the step is done again from the saved state, and the
      // cloud answers its repeat with the reply it kept. Nothing is lost.
      spdlog::info("event=redo step={} msg=\"the cloud applied it; its reply comes from the cloud's cache\"", cloud);
    } else if (cloud > completed) {
      spdlog::warn(
          "event=behind_cloud device_step={} cloud_step={} msg=\"the bottom lost the updates of steps {}..{}\"",
          completed, cloud, completed + 1, cloud);
      sum.skipped += cloud - completed;
      completed = cloud;
    }
    SPARROW_CHECK_T(Error, cloud == completed || cloud == completed + 1,
                    "the cloud is at step " << cloud << " but this device completed step " << completed
                                            << " (the cloud lost the session's steps?)");
    // A restart after a step that ended an averaging round whose result we lack.
    if (cfg.fedavg_every > 0 && completed > 0 && completed % cfg.fedavg_every == 0 &&
        fed_done < completed / cfg.fedavg_every)
      average(completed / cfg.fedavg_every);
    double loss_sum = 0;
    uint64_t loss_steps = 0;
    try {
      while (completed < cfg.steps) {
        check_stop();
        const uint64_t step = completed + 1;
        const auto idx = batch(step);
        std::string bytes = activation_bytes(bottom.forward(idx), step, bottom.train_labels(idx), true);
        wire::SplitGradient g;
        for (int refreshed = 0;; ++refreshed) {
          try {
            g = exchange(bytes, step, true);
            break;
          } catch (const ReplyError& e) {
            // The cloud lost this device's basis (it restarted): send a fresh one.
            if (e.code == wire::ErrorCode::kMalformed && bottom.lowrank() && refreshed == 0) {
              spdlog::warn("event=basis_refresh step={} reason=\"{}\"", step, e.what());
              bottom.force_basis_refresh();
              bytes = activation_bytes(bottom.forward(idx), step, bottom.train_labels(idx), true);
              continue;
            }
            throw Error("step " + std::to_string(step) + " refused by the cloud (" + wire::error_code_name(e.code) +
                        "): " + e.what());
          }
        }
        // Parsed before it is logged: a malformed packet is never replayed.
        const ActPacket gradient =
            g.payload.empty() ? ActPacket{} : ActPacket::deserialize(g.payload.data(), g.payload.size());
        log_step(step, g.payload);
        if (!g.payload.empty()) {
          bottom.backward(gradient);
          bottom.step();
        }
        completed = step;
        loss_sum += g.loss;
        ++loss_steps;
        const bool averaged = cfg.fedavg_every > 0 && completed % cfg.fedavg_every == 0;
        if (averaged) average(completed / cfg.fedavg_every);
        // After an average too: the log never reaches across one.
        if (averaged || completed % cfg.save_every == 0) save_progress();
        if (completed % 10 == 0 || completed == cfg.steps)
          spdlog::info("event=step step={} loss={:.4f} bytes_up={} bytes_down={}", completed,
                       loss_sum / static_cast<double>(loss_steps), sum.bytes_up, sum.bytes_down);
      }
    } catch (...) {
      save_progress();
      throw;
    }
    save_progress();
    evaluate();
    close_socket();
    sum.steps = completed;
    return sum;
  }

  // SplitFed round r: sends the bottom, waits (with Heartbeats) for the Task
  // holding the average and loads it. Reconnects and resends like exchange().
  void average(uint64_t r) {
    const std::unique_ptr<cflat::Codec> dense = cflat::make_codec("none");
    wire::ModelUpdate u;
    u.round = r;
    u.client_id = cfg.device_id;
    u.num_samples = static_cast<uint64_t>(bottom.train_size());
    const auto names = bottom.names();
    const auto current = bottom.tensors(Slot::kWeights);
    for (size_t i = 0; i < names.size(); ++i) {
      cflat::State scratch;
      u.tensors.push_back({names[i], dense->encode(current[i].data.data(), current[i].shape, scratch, {})});
    }
    const std::string bytes = wire::serialize(message(u));
    const auto hb_every = std::chrono::milliseconds(std::max<uint64_t>(10, cfg.reply_timeout_ms / 3));
    for (;;) {
      if (!sock) connect();
      if (!send_bytes(bytes)) {
        failed("send failed");
        continue;
      }
      auto deadline = Clock::now() + std::chrono::milliseconds(cfg.reply_timeout_ms);
      auto next_hb = Clock::now() + hb_every;
      std::optional<wire::Task> task;
      for (;;) {
        auto m = receive_until(std::min(deadline, next_hb));
        if (!m) {
          if (Clock::now() >= deadline) break;
          send_bytes(wire::serialize(message(wire::Heartbeat{r})));
          next_hb = Clock::now() + hb_every;
          continue;
        }
        deadline = Clock::now() + std::chrono::milliseconds(cfg.reply_timeout_ms);  // the cloud is alive
        if (auto* t = std::get_if<wire::Task>(&m->body); t && t->round == r) {
          task = std::move(*t);
          break;
        }
        if (auto* e = std::get_if<wire::ErrorBody>(&m->body))
          throw Error(std::string("averaging round ") + std::to_string(r) + " refused by the cloud (" +
                      wire::error_code_name(e->code) + "): " + e->message);
      }
      if (!task) {
        failed("no average for round " + std::to_string(r) + " within reply_timeout_ms");
        continue;
      }
      // Decode everything before loading anything.
      SPARROW_CHECK_T(
          FormatError, task->weights.size() == names.size(),
          "averaging round " << r << ": " << task->weights.size() << " tensors for a bottom of " << names.size());
      std::map<std::string, const compression::Encoded*> by_name;
      for (const auto& t : task->weights) by_name[t.name] = &t.tensor;
      std::vector<cflat::Tensor> avg(names.size());
      for (size_t i = 0; i < names.size(); ++i) {
        auto it = by_name.find(names[i]);
        SPARROW_CHECK_T(FormatError, it != by_name.end() && it->second->shape == current[i].shape,
                        "averaging round " << r << ": no fitting '" << names[i] << "'");
        avg[i].shape = current[i].shape;
        avg[i].data.assign(current[i].data.size(), 0.0f);
        cflat::decode_add(*it->second, avg[i].data.data(), static_cast<int64_t>(avg[i].data.size()), 1.0f);
      }
      bottom.load(Slot::kWeights, avg);
      fed_done = r;
      ++sum.fed_rounds;
      spdlog::info("event=fedavg round={}", r);
      return;
    }
  }

  void evaluate() {
    const int64_t n = bottom.test_size();
    if (n == 0) return;
    const int64_t b = static_cast<int64_t>(cfg.batch_size);
    uint64_t correct = 0;
    for (int64_t i = 0, k = 1; i < n; i += b, ++k) {
      check_stop();
      const int64_t e = std::min(n, i + b);
      const ActPacket act = bottom.infer(i, e);
      const std::string bytes = activation_bytes(act, static_cast<uint64_t>(k), bottom.test_labels(i, e), false);
      try {
        correct += exchange(bytes, static_cast<uint64_t>(k), false).correct;
      } catch (const ReplyError& err) {
        throw Error(std::string("evaluation refused by the cloud (") + wire::error_code_name(err.code) +
                    "): " + err.what());
      }
    }
    sum.eval_samples = static_cast<uint64_t>(n);
    sum.accuracy = static_cast<double>(correct) / static_cast<double>(n);
    spdlog::info("event=eval samples={} accuracy={:.4f}", n, sum.accuracy);
  }
};

Protocol::Protocol(Config cfg, Bottom& bottom, const std::atomic<bool>& stop)
    : impl_(std::make_unique<Impl>(std::move(cfg), bottom, stop)) {}
Protocol::~Protocol() = default;

Summary Protocol::run() { return impl_->run(); }
void Protocol::set_drop_hook(std::function<bool(uint64_t)> hook) { impl_->drop_hook = std::move(hook); }
uint64_t Protocol::completed_steps() const { return impl_->completed; }

}  // namespace sparrow::edge::device
