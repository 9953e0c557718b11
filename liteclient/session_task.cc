// Session::Impl's Tasks and state file: the broadcast model B_{r-1} (Full, or
// a Delta against what the client holds, decoded with flat::decode_add), the
// Task's settings checked, training through the SessionTrainer, the update
// encoded tensor by tensor with the task's codec (compression/flat_codec.h,
// the same bytes as sparrow-client's federation::make_update), and the state
// committed with it.
#include <spdlog/spdlog.h>

#include <algorithm>

#include "core/error.h"
#include "compression/codec_bits.h"
#include "core/peer_text.h"
#include "liteclient/session_impl.h"

namespace sparrow::liteclient {

// ---- the state file ---------------------------------------------------------

void Session::Impl::open_state() {
  if (auto s = load_state(cfg.state_file)) {
    SPARROW_CHECK_T(ConfigError, s->client_id == cfg.client_id,
                    "state_file: '" << cfg.state_file << "' belongs to client '" << core::printable(s->client_id)
                                    << "', not '" << cfg.client_id << "'");
    SPARROW_CHECK_T(
        ConfigError, s->digest == digest,
        "state_file: '" << cfg.state_file << "' was written for another model than '" << cfg.model_file << "'");
    st = std::move(*s);
    if (st.holds_model && static_cast<int64_t>(st.held.size()) != layout.total) {
      spdlog::warn("state_file: the held model does not match the model; holding none");
      st.holds_model = false;
      st.held.clear();
    }
    if (!st.control.empty() && static_cast<int64_t>(st.control.size()) != layout.total) st.control.clear();
    if (!st.prev_control.empty() && static_cast<int64_t>(st.prev_control.size()) != layout.total)
      st.prev_control.clear();
    if (st.holds_model)
      spdlog::info("state: holding the broadcast model of round {} (run '{}')", st.held_round,
                   core::printable(st.run_id));
  } else {
    st.client_id = cfg.client_id;
    st.digest = digest;
    save();
  }
}

void Session::Impl::save() { save_state(cfg.state_file, st); }

void Session::Impl::answered(uint64_t round) {
  if (st.committed_round != round || st.answered) return;
  st.answered = true;
  save();
}

void Session::Impl::reset_state(const std::string& run_id) {
  st = ClientState{};
  st.client_id = cfg.client_id;
  st.digest = digest;
  st.run_id = run_id;
  save();
}

void Session::Impl::persist_held(uint64_t round, std::vector<float> w) {
  st.holds_model = true;
  st.held_round = round;
  st.held = std::move(w);
  st.run_id = welcome.run_id;
  save();
}

// ---- tasks ------------------------------------------------------------------

void Session::Impl::check_tensors(const std::vector<wire::NamedTensor>& ts, const char* what, bool exact,
                                  bool same_shape) const {
  std::map<std::string, int> seen;
  for (const auto& t : ts) {
    const int64_t k = layout.find(t.name);
    SPARROW_CHECK_T(Error, k >= 0, what << ": '" << t.name << "' is not a parameter of " << cfg.model);
    SPARROW_CHECK_T(Error, ++seen[t.name] == 1, what << ": '" << t.name << "' appears twice");
    const auto& shape = layout.shapes[static_cast<size_t>(k)];
    SPARROW_CHECK_T(
        Error, !same_shape || t.tensor.shape == shape,
        what << ": '" << t.name << "' has shape " << shape_text(t.tensor.shape) << ", the model " << shape_text(shape));
  }
  SPARROW_CHECK_T(Error, !exact || seen.size() == layout.names.size(),
                  what << ": " << seen.size() << " of the model's " << layout.names.size() << " parameters");
}

void Session::Impl::decode_into(const std::vector<wire::NamedTensor>& ts, std::vector<float>& out) const {
  for (const auto& t : ts) {
    const auto k = static_cast<size_t>(layout.find(t.name));
    flat::decode_add(t.tensor, out.data() + layout.offsets[k], layout.sizes[k], 1.0f);
  }
}

void Session::Impl::on_task(wire::Task& task) {
  const uint64_t r = task.round;
  spdlog::info("round {}: task received", r);
  try {
    std::optional<std::vector<float>> base = broadcast_model(task);
    if (!base) return;  // answered with a re-Hello
    // Decoded into `base`: the weights (views into the received frame) are
    // let go before training, not held through it.
    task.weights.clear();
    if (task.secagg)
      start_secagg(task, std::move(*base));
    else
      train_and_send(task, std::move(*base));
  } catch (const std::exception& e) {
    ++n.tasks_refused;
    spdlog::warn("round {}: task refused: {}", r, core::printable(e.what()));
    wire::Message reply;
    reply.body = wire::error_for(e, r);
    send(reply);
  }
}

std::optional<std::vector<float>> Session::Impl::broadcast_model(const wire::Task& task) {
  const uint64_t r = task.round;
  SPARROW_CHECK_T(Error, r >= 1, "task: round must be >= 1");
  if (task.model_encoding == wire::ModelEncoding::kFull) {
    check_tensors(task.weights, "task weights", /*exact=*/true);
    std::vector<float> w(static_cast<size_t>(layout.total), 0.0f);
    decode_into(task.weights, w);
    return w;
  }
  // Delta, and the catch-up encodings of protocol 1.9 (wire::parse checked
  // their shape: a Chain's step count, a Patch's tensor kind).
  const bool chain = task.model_encoding == wire::ModelEncoding::kChain;
  const bool patch = task.model_encoding == wire::ModelEncoding::kPatch;
  check_tensors(task.weights, patch ? "task patch" : "task delta", /*exact=*/false);
  for (const auto& step : task.chain) check_tensors(step, "task chain", /*exact=*/false);
  const uint64_t b = task.base_round;
  if (chain || patch)
    SPARROW_CHECK_T(Error, b + 2 <= r, "task: a catch-up of round " << r << " needs base_round <= " << r - 2);
  else if (task.weights.empty())
    SPARROW_CHECK_T(Error, b + 1 == r, "task: an empty Delta of round " << r << " needs base_round " << r - 1);
  else
    SPARROW_CHECK_T(Error, b + 2 == r, "task: a Delta with tensors in round " << r << " needs base_round " << r - 2);
  if (!st.holds_model || st.held_round != b) {
    SPARROW_CHECK_T(Error, rehello_round != r,
                    "task: cannot apply a Delta against round "
                        << b << ": this client holds "
                        << (st.holds_model ? "round " + std::to_string(st.held_round) : std::string("no model")));
    rehello_round = r;
    ++n.tasks_refused;
    spdlog::warn("round {}: Delta against round {} but holding {}: sending Hello again", r, b,
                 st.holds_model ? "round " + std::to_string(st.held_round) : std::string("no model"));
    send_hello();
    return std::nullopt;
  }
  // Into a copy: a step or a patch that fails leaves st.held as it was.
  std::vector<float> w = st.held;
  if (patch) {
    for (const auto& t : task.weights) {
      const auto k = static_cast<size_t>(layout.find(t.name));
      wire::apply_patch(t.tensor, w.data() + layout.offsets[k], layout.sizes[k]);
    }
  } else if (chain) {
    for (const auto& step : task.chain) decode_into(step, w);
  } else {
    decode_into(task.weights, w);
  }
  return w;
}

Session::Impl::Prepared Session::Impl::prepare(const wire::Task& task, std::vector<float> base) {
  Prepared p;
  trainer->check(task.train);
  const bool stateful = trainer->stateful(task.train.algorithm);
  p.codec = flat::make_codec(task.compression);  // ConfigError for an unknown codec
  if (p.codec->mask_ratio() > 0) {
    // tcs: each entry is the server's mask of a parameter, a sparse tensor of
    // its shape whose positions are the mask (compression::mask_positions).
    check_tensors(task.shared, "task shared", /*exact=*/false);
    for (const auto& nt : task.shared) {
      SPARROW_CHECK_T(
          Error,
          nt.tensor.format == compression::Format::kSparse && nt.tensor.index_coding != compression::IndexCoding::kMask,
          "task: the mask of '" << nt.name << "' is not a sparse tensor with its own positions");
      compression::validate(nt.tensor);
      p.masks[nt.name] = compression::detail::decode_indices(nt.tensor);
    }
  } else {
    // acp: each entry is the round's shared factor of a parameter, {k, r}, as
    // sparrow-client reads it: a factor as sparrow-server sends it
    // (compression::acp_factor_encoded, its values the factor itself), or any
    // other tensor, decoded, of shape {k, r}. The codec checks the shape.
    check_tensors(task.shared, "task shared", /*exact=*/false, /*same_shape=*/false);
    for (const auto& nt : task.shared) p.shared[nt.name] = flat::shared_factor_of(nt.tensor);
  }
  SPARROW_CHECK_T(Error, task.control.empty() || stateful,
                  "task: control variates with algorithm '" << task.train.algorithm << "'");
  check_tensors(task.control, "task control", /*exact=*/!task.control.empty());
  if (!task.control.empty()) {
    p.server_control.assign(static_cast<size_t>(layout.total), 0.0f);
    decode_into(task.control, p.server_control);
  }
  if (task.secagg) secagg::check_compatible(task.compression, "mean", "none", task.train.algorithm);
  // The Task is acceptable: we now hold B_{r-1}.
  persist_held(task.round - 1, std::move(base));
  rehello_round.reset();
  return p;
}

Session::Impl::Trained Session::Impl::train(const wire::Task& task, const std::vector<float>& base, Prepared& p) {
  const bool stateful = trainer->stateful(task.train.algorithm);
  Trained t;
  // Work on copies: a failure below leaves the persisted state as it was.
  // The round whose update was committed last and never answered, asked
  // again (the update never reached the server: the client died, or the
  // connection closed, right after committing it): trained again from the
  // state before it, so the same update goes out. (An asynchronous server
  // may give an answered client a new task of the same round: that one is
  // trained from the current state.)
  t.replay = st.committed_round == task.round && st.committed_round > 0 && !st.answered;
  if (t.replay)
    spdlog::info("round {}: asked again for the round last committed: training it from the state before it",
                 task.round);
  t.next_control = t.replay ? st.prev_control : st.control;
  const auto t0 = Clock::now();
  t.update = trainer->train(task.train, base, task.seed, stateful ? &t.next_control : nullptr,
                            stateful ? &p.server_control : nullptr);
  SPARROW_CHECK_T(Error, t.update.num_samples > 0 && static_cast<int64_t>(t.update.delta.size()) == layout.total,
                  "task: the trainer returned no samples or an update of the wrong size");
  t.secs = std::chrono::duration<double>(Clock::now() - t0).count();
  t.metrics = {{"train_loss", t.update.mean_loss}, {"train_seconds", t.secs}};
  if (ldp.on) {
    // The noise must be unknown to the server: drawn from this device's own
    // entropy, never from the task's seed (as sparrow-client).
    const uint64_t key = (static_cast<uint64_t>(entropy()) << 32) ^ entropy();
    const double norm = local_dp_update(layout, t.update.delta, ldp.clip, ldp.noise, key);
    spdlog::info("event=local_dp round={} norm={:.4g} clip={} noise={} participations={} delta={}", task.round, norm,
                 ldp.clip, ldp.noise, st.rounds + (t.replay ? 0 : 1), ldp.delta);
  }
  // Copied once training is over, not before: training's own buffers and
  // three sets of codec states (now, before, next) are then never resident
  // at once.
  t.next_codec = t.replay ? st.prev_codec : st.codec;
  return t;
}

void Session::Impl::commit_and_send(uint64_t r, Trained& t, std::string bytes) {
  const uint64_t limit = welcome.max_message_bytes > 0 ? std::min(welcome.max_message_bytes, max_bytes) : max_bytes;
  SPARROW_CHECK_T(Error, bytes.size() <= limit,
                  "update of " << bytes.size() << " bytes exceeds max_message_bytes " << limit);
  // Error feedback is committed with the update it produced, before sending
  // (as sparrow-client): a crash after this point does not replay the residual.
  // The state before it is kept for a Task of this round asked again (train()).
  if (!t.replay) {
    st.prev_control = std::move(st.control);
    st.prev_codec = std::move(st.codec);
    st.rounds += 1;
  }
  st.control = std::move(t.next_control);
  st.codec = std::move(t.next_codec);
  st.committed_round = r;
  st.answered = false;
  save();
  ++n.tasks_done;
  pending_round = r;
  spdlog::info("round {}: trained {} samples in {:.2f} s (loss {:.4f}), sending {} bytes", r, t.update.num_samples,
               t.secs, t.update.mean_loss, bytes.size());
  if (!link.send(bytes)) spdlog::warn("round {}: the update could not be queued", r);
  std::string().swap(bytes);  // sent (ZeroMQ holds its own copy): not kept while idle
}

void Session::Impl::train_and_send(const wire::Task& task, std::vector<float> base) {
  const uint64_t r = task.round;
  Prepared p = prepare(task, std::move(base));
  Trained t = train(task, st.held, p);  // B_{r-1}: prepare() made it the held model
  // federation::make_update's encoding: tensor by tensor in model order, each
  // with its own state and the context client_context() gives it.
  wire::ModelUpdate u;
  u.round = r;
  u.client_id = cfg.client_id;
  u.num_samples = static_cast<uint64_t>(t.update.num_samples);
  u.metrics = t.metrics;
  for (size_t k = 0; k < layout.names.size(); ++k) {
    flat::Context ctx;
    ctx.name = layout.names[k];
    ctx.round = static_cast<int64_t>(r);
    ctx.seed = task.seed;
    ctx.num_workers = static_cast<int>(std::max<uint32_t>(task.clients, 1));
    if (auto it = p.masks.find(layout.names[k]); it != p.masks.end()) {
      ctx.has_mask = true;
      ctx.mask = it->second;
    }
    if (auto it = p.shared.find(layout.names[k]); it != p.shared.end()) {  // used once: moved
      ctx.has_shared_factor = true;
      ctx.shared_factor = std::move(it->second);
    }
    u.tensors.push_back({layout.names[k], p.codec->encode(t.update.delta.data() + layout.offsets[k], layout.shapes[k],
                                                          t.next_codec[layout.names[k]], ctx)});
  }
  if (!t.update.control_delta.empty()) {
    const auto dense = flat::make_codec("none");
    for (size_t k = 0; k < layout.names.size(); ++k) {
      flat::State scratch;
      u.control_delta.push_back({layout.names[k], dense->encode(t.update.control_delta.data() + layout.offsets[k],
                                                                layout.shapes[k], scratch, {})});
    }
  }
  // Encoded: the delta and the update's tensors are let go before the state
  // file is written, only the serialised message is kept until it is sent.
  std::vector<float>().swap(t.update.delta);
  std::vector<float>().swap(t.update.control_delta);
  u.packed = wire::packs_well(u, server_minor);
  std::string bytes = wire::serialize(message(std::move(u)));
  commit_and_send(r, t, std::move(bytes));
}

}  // namespace sparrow::liteclient
