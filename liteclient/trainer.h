#pragma once
// The seam between the client protocol (session.h) and the training runtime.
// The session speaks the protocol (handshake, tasks, codecs, client state,
// SecAgg+, reconnects) over flat float vectors in model order (layout.h); a
// SessionTrainer turns a Task's training settings and the global model into an
// update. LiteTrainer (lite_trainer.h) implements it on the lite runtime; a
// LibTorch trainer flattening its named_parameters() the same way could
// implement it too, and sparrow-client would then run this same session
// (docs/architecture.md).
//
// Threads: the session's thread only.

#include <cstdint>
#include <string>
#include <vector>

#include "liteclient/layout.h"
#include "wire/wire.h"

namespace sparrow::liteclient {

struct LocalUpdate {
  std::vector<float> delta;          // local - global, flat, model order
  std::vector<float> control_delta;  // SCAFFOLD: c_i+ - c_i; empty otherwise
  int64_t num_samples = 0;           // the update's FedAvg weight (> 0)
  double mean_loss = 0;
};

class SessionTrainer {
 public:
  virtual ~SessionTrainer() = default;
  // The model's parameters (fixed for the trainer's life).
  virtual const Layout& layout() const = 0;
  // Samples this client trains on (Hello's num_samples; >= 1).
  virtual uint64_t num_samples() const = 0;
  // Whether the trainer keeps a client control (c_i) for `algorithm`: the
  // session then persists it between rounds and passes it in.
  virtual bool stateful(const std::string& algorithm) const = 0;
  // Checks the settings without training: ConfigError naming what it cannot
  // run (an unknown algorithm, a bad value).
  virtual void check(const wire::TrainSettings& settings) = 0;
  // Local training from `global` (layout().total floats) with the task's
  // seed. client_control (c_i, in/out) and server_control (c) only for a
  // stateful algorithm; empty vectors mean zeros. sparrow::Error, changing
  // nothing the caller owns, when training fails (divergence, bad lengths).
  virtual LocalUpdate train(const wire::TrainSettings& settings, const std::vector<float>& global, uint64_t seed,
                            std::vector<float>* client_control, const std::vector<float>* server_control) = 0;
};

}  // namespace sparrow::liteclient
