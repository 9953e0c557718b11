#pragma once
// The lite client's state file: what must survive a restart, in one file of
// its own (no SQLite on the device). Written whole, atomically: to PATH.tmp,
// fsync'd, renamed over PATH, the folder fsync'd; a crash at any point leaves
// the old file or the new one, never a mix. Streamed: save_state() never
// holds the file's bytes whole in memory (on the CNN with DGC they are ~5x
// the model), only a small buffer: vectors go from where they lie.
// Binary, little-endian:
//
//   magic "SPRWLCST" | u32 version (1)
//   str client_id | u64 model digest | str run_id
//   u8 holds a model | u64 held round | u64 n, f32 x n  (the held model B_h)
//   u64 participations | u64 n, f32 x n (SCAFFOLD's c_i; 0 = none yet)
//   u32 codec states | per state: str tensor name, str bytes (compression
//     flat::State::serialize(), the same bytes sparrow-client keeps)
//   u64 committed round | u8 answered | u64 n, f32 x n | u32 codec states,
//     as above: the round of the last update committed, whether the server
//     answered it, and c_i and the codec states from before it
//     (ClientState::committed_round)
//   u64 FNV-1a 64 of every byte before it
//   (str = u32 length, bytes)
//
// A reader refuses, with a FormatError naming the file, another magic or
// version, a truncated file, trailing bytes and a checksum mismatch.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "compression/flat_codec.h"

namespace sparrow::liteclient {

// Per tensor: its codec state (error feedback, DGC's u and v), kept
// deserialized: the file holds each as flat::State::serialize()'s bytes.
using CodecStates = std::map<std::string, compression::flat::State>;

struct ClientState {
  std::string client_id;  // the client the file belongs to
  uint64_t digest = 0;    // the model it belongs to (layout.h model_digest)
  std::string run_id;     // the run of the held model ("" before any Welcome)
  bool holds_model = false;
  uint64_t held_round = 0;     // B_h's round (valid when holds_model)
  std::vector<float> held;     // B_h, flat, model order
  uint64_t rounds = 0;         // updates sent (participations)
  std::vector<float> control;  // SCAFFOLD's c_i; empty = zeros
  CodecStates codec;           // per tensor: its codec state
  // The round of the last update committed (0: none), whether the server
  // answered it (Ack or Error), and control and codec states as they were
  // before it. The state is committed before the update is sent; a client
  // that died before its update left is asked for that round again, never
  // answered, and trains it again from these: the update it sends then is
  // the one that was lost, and no residual is applied twice.
  uint64_t committed_round = 0;
  bool answered = false;
  std::vector<float> prev_control;
  CodecStates prev_codec;
};

// The file's bytes (what save_state() streams), for tests and tools.
std::string encode_state(const ClientState& s);
// `what` (the path) names the bytes in every error, a bad codec state's too.
ClientState decode_state(const std::string& bytes, const std::string& what);

// Atomic replace (above). sparrow::Error naming the path when it cannot write.
void save_state(const std::string& path, const ClientState& s);
// nullopt when `path` does not exist; FormatError for a bad file, Error when
// it cannot be read.
std::optional<ClientState> load_state(const std::string& path);

}  // namespace sparrow::liteclient
