#pragma once
// What the split device's protocol (protocol.h) needs of a device: the
// bottom of the model with its optimiser and activation codec, and the
// device's data, addressed by row. Two implementations: the LibTorch bottom
// of sparrow-edge (edge/device.cc, over EdgeHalf and Sgd) and the lite one of
// sparrow-edge-lite (liteedge/device.cc, over liteedge::Bottom).
//
// Not thread-safe: the protocol calls it from run()'s thread only, one step at
// a time (forward, then backward and step).

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "compression/flat_codec.h"
#include "edge/codec/act_codec_flat.h"
#include "edge/codec/act_packet.h"

namespace sparrow::edge::device {

class Bottom {
 public:
  // The optimiser's per-parameter tensors.
  enum class Slot { kWeights, kMomentum };

  virtual ~Bottom() = default;

  // ---- data ----
  virtual int64_t train_size() const = 0;
  virtual int64_t test_size() const = 0;
  virtual std::vector<int64_t> train_labels(const std::vector<int64_t>& rows) const = 0;
  virtual std::vector<int64_t> test_labels(int64_t begin, int64_t end) const = 0;

  // ---- the bottom ----
  // Hello's model digest (edge::bottom_digest of the bottom's shapes).
  virtual uint64_t digest() const = 0;
  virtual const std::string& codec_spec() const = 0;
  virtual bool lowrank() const = 0;
  // Training forward on training rows `rows` (zeroing the grads of any earlier
  // step), the activation encoded; want_gradient unless frozen. Keeps what
  // backward() needs until the next forward() or infer().
  virtual ActPacket forward(const std::vector<int64_t>& rows) = 0;
  // The cloud's gradient for the last forward(): FormatError (nothing changed)
  // for a packet that does not fit.
  virtual void backward(const ActPacket& gradient) = 0;
  // The optimiser step on the grads of the last backward().
  virtual void step() = 0;
  // Evaluation forward on test rows [begin, end), encoded with the current
  // basis (the training codec state is left as is).
  virtual ActPacket infer(int64_t begin, int64_t end) = 0;
  virtual flat::CodecState codec_state() const = 0;
  virtual void set_codec_state(const flat::CodecState& s) = 0;
  // The next forward() sends a fresh basis (the cloud lost its copy).
  virtual void force_basis_refresh() = 0;

  // ---- named float tensors: the progress file and SplitFed ----
  // The parameters' names, in the LibTorch bottom's order.
  virtual std::vector<std::string> names() const = 0;
  // Copies, in names()' order.
  virtual std::vector<compression::flat::Tensor> tensors(Slot slot) const = 0;
  // Loads `t` (names()' order, shapes already checked against tensors()).
  virtual void load(Slot slot, const std::vector<compression::flat::Tensor>& t) = 0;
  // Buffers such as BatchNorm running statistics, by name (none by default).
  virtual std::vector<std::pair<std::string, compression::flat::Tensor>> buffers() const { return {}; }
  // Loads buffer `name` (its shape already checked against buffers()).
  virtual void load_buffer(const std::string& name, const compression::flat::Tensor& t) {
    (void)name;
    (void)t;
  }
};

}  // namespace sparrow::edge::device
