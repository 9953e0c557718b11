#include "liteclient/state_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <utility>

#include "core/bytes.h"
#include "core/error.h"

namespace sparrow::liteclient {
namespace {

constexpr char kMagic[8] = {'S', 'P', 'R', 'W', 'L', 'C', 'S', 'T'};
constexpr uint32_t kVersion = 1;
constexpr uint64_t kFnvOffset = 0xcbf29ce484222325ull, kFnvPrime = 0x100000001b3ull;

uint64_t fnv1a(uint64_t h, const char* p, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    h ^= static_cast<unsigned char>(p[i]);
    h *= kFnvPrime;
  }
  return h;
}

[[noreturn]] void fail_io(const std::string& what, const std::string& path) {
  throw Error("state_file: cannot " + what + " '" + path + "': " + std::strerror(errno));
}

// Where the file's bytes go as they are produced: appended to a string
// (encode_state), or through a small buffer to a file descriptor
// (save_state), so the file is never held whole in memory. The FNV-1a of
// every byte is kept on the way, for the trailing checksum.
class Writer {
 public:
  explicit Writer(std::string& out) : out_(&out) {}
  Writer(int fd, const std::string& path) : fd_(fd), path_(&path) { buf_.reserve(kBuffer); }

  void bytes(const void* p, size_t n) {
    hash_ = fnv1a(hash_, static_cast<const char*>(p), n);
    raw(static_cast<const char*>(p), n);
  }
  template <typename T>
  void put(T v) {
    char b[sizeof(T)];
    std::memcpy(b, &v, sizeof(T));  // little-endian hosts only (x86-64, arm64)
    bytes(b, sizeof(T));
  }
  void str(const std::string& s) {
    put<uint32_t>(static_cast<uint32_t>(s.size()));
    bytes(s.data(), s.size());
  }
  void floats(const std::vector<float>& v) {
    put<uint64_t>(v.size());
    bytes(v.data(), v.size() * sizeof(float));
  }
  void codec(const CodecStates& codec) {
    put<uint32_t>(static_cast<uint32_t>(codec.size()));
    for (const auto& [name, state] : codec) {
      str(name);
      codec_state(state);
    }
  }
  // A str holding flat::State::serialize()'s bytes, streamed from the state's
  // own vectors: DGC's state is twice its tensor, too much to copy just to
  // write it.
  void codec_state(const compression::flat::State& st) {
    const uint64_t n = st.serialized_size();
    SPARROW_CHECK(n <= UINT32_MAX, "a compressor state of " << n << " bytes does not fit the state file");
    put<uint32_t>(static_cast<uint32_t>(n));
    st.serialize_to([this](const char* p, size_t k) { bytes(p, k); });
  }
  // The checksum of every byte so far, then whatever is still buffered.
  void finish() {
    const uint64_t sum = hash_;
    char b[sizeof(sum)];
    std::memcpy(b, &sum, sizeof(sum));
    raw(b, sizeof(sum));
    flush();
  }

 private:
  static constexpr size_t kBuffer = size_t{1} << 16;

  void raw(const char* p, size_t n) {
    if (out_) {
      out_->append(p, n);
      return;
    }
    if (buf_.size() + n > kBuffer) {
      flush();
      if (n >= kBuffer) {  // a model vector: straight from where it lies
        write_all(p, n);
        return;
      }
    }
    buf_.append(p, n);
  }
  void flush() {
    if (fd_ >= 0) write_all(buf_.data(), buf_.size());
    buf_.clear();
  }
  void write_all(const char* p, size_t n) {
    size_t done = 0;
    while (done < n) {
      const ssize_t w = ::write(fd_, p + done, n - done);
      if (w < 0 && errno == EINTR) continue;
      if (w < 0) fail_io("write", *path_);
      done += static_cast<size_t>(w);
    }
  }

  std::string* out_ = nullptr;
  int fd_ = -1;
  const std::string* path_ = nullptr;
  std::string buf_;
  uint64_t hash_ = kFnvOffset;
};

void write_state(Writer& w, const ClientState& s) {
  w.bytes(kMagic, sizeof(kMagic));
  w.put<uint32_t>(kVersion);
  w.str(s.client_id);
  w.put<uint64_t>(s.digest);
  w.str(s.run_id);
  w.put<uint8_t>(s.holds_model ? 1 : 0);
  w.put<uint64_t>(s.held_round);
  w.floats(s.held);
  w.put<uint64_t>(s.rounds);
  w.floats(s.control);
  w.codec(s.codec);
  w.put<uint64_t>(s.committed_round);
  w.put<uint8_t>(s.answered ? 1 : 0);
  w.floats(s.prev_control);
  w.codec(s.prev_codec);
  w.finish();
}

// Closes the descriptor on every path out of save_state (a failed write
// included) unless release()d first.
class FdGuard {
 public:
  explicit FdGuard(int fd) : fd_(fd) {}
  ~FdGuard() {
    if (fd_ >= 0) {
      const int e = errno;  // the error being reported, not close()'s
      ::close(fd_);
      errno = e;
    }
  }
  FdGuard(const FdGuard&) = delete;
  FdGuard& operator=(const FdGuard&) = delete;
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

// The fields after the magic, bounds-checked by core::ByteReader ("<what>:
// truncated at byte N of M").
std::string get_str(core::ByteReader& r) {
  const auto n = r.get<uint32_t>();
  return std::string(r.take(n), n);
}

std::vector<float> get_floats(core::ByteReader& r, const std::string& what) {
  const auto n = r.get<uint64_t>();
  SPARROW_CHECK_T(FormatError, n <= r.left() / sizeof(float), what << ": truncated state file");
  std::vector<float> v(static_cast<size_t>(n));
  r.read(v.data(), n * sizeof(float));
  return v;
}

CodecStates get_codec(core::ByteReader& r, const std::string& what) {
  CodecStates codec;
  const auto n = r.get<uint32_t>();
  for (uint32_t i = 0; i < n; ++i) {
    std::string name = get_str(r);
    SPARROW_CHECK_T(FormatError, !codec.count(name), what << ": codec state of '" << name << "' appears twice");
    const auto len = r.get<uint32_t>();
    const char* bytes = r.take(len);  // parsed where it lies
    try {
      codec.emplace(name, compression::flat::State::deserialize(bytes, len));
    } catch (const FormatError& e) {
      throw FormatError(what + ": codec state of '" + name + "': " + e.what());
    }
  }
  return codec;
}

}  // namespace

std::string encode_state(const ClientState& s) {
  std::string out;
  Writer w(out);
  write_state(w, s);
  return out;
}

ClientState decode_state(const std::string& b, const std::string& what) {
  SPARROW_CHECK_T(FormatError, b.size() >= sizeof(kMagic) + 4 + 8, what << ": truncated state file");
  SPARROW_CHECK_T(FormatError, std::memcmp(b.data(), kMagic, sizeof(kMagic)) == 0,
                  what << ": not a sparrow-client-lite state file (another magic)");
  const size_t end = b.size() - 8;
  uint64_t sum = 0;
  std::memcpy(&sum, b.data() + end, 8);
  core::ByteReader r(b.data(), end, what.c_str());
  r.take(sizeof(kMagic));
  const auto version = r.get<uint32_t>();
  SPARROW_CHECK_T(FormatError, version == kVersion,
                  what << ": state file version " << version << ", this build reads " << kVersion);
  SPARROW_CHECK_T(FormatError, sum == fnv1a(kFnvOffset, b.data(), end),
                  what << ": checksum mismatch (the file is damaged)");
  ClientState s;
  s.client_id = get_str(r);
  s.digest = r.get<uint64_t>();
  s.run_id = get_str(r);
  const auto holds = r.get<uint8_t>();
  SPARROW_CHECK_T(FormatError, holds <= 1, what << ": bad held-model flag");
  s.holds_model = holds == 1;
  s.held_round = r.get<uint64_t>();
  s.held = get_floats(r, what);
  s.rounds = r.get<uint64_t>();
  s.control = get_floats(r, what);
  s.codec = get_codec(r, what);
  s.committed_round = r.get<uint64_t>();
  const auto answered = r.get<uint8_t>();
  SPARROW_CHECK_T(FormatError, answered <= 1, what << ": bad answered flag");
  s.answered = answered == 1;
  s.prev_control = get_floats(r, what);
  s.prev_codec = get_codec(r, what);
  SPARROW_CHECK_T(FormatError, r.done(), what << ": trailing bytes after the state");
  return s;
}

void save_state(const std::string& path, const ClientState& s) {
  const std::string tmp = path + ".tmp";
  FdGuard fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
  if (fd.get() < 0) fail_io("write", tmp);
  Writer w(fd.get(), tmp);
  write_state(w, s);
  // The bytes reach the disk before the name points at them.
  if (::fsync(fd.get()) != 0) fail_io("sync", tmp);
  if (::close(fd.release()) != 0) fail_io("close", tmp);
  if (::rename(tmp.c_str(), path.c_str()) != 0) fail_io("rename to", path);
  // The rename itself reaches the disk with the folder's entry.
  std::string dir = std::filesystem::path(path).parent_path().string();
  if (dir.empty()) dir = ".";
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

std::optional<ClientState> load_state(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return std::nullopt;
  std::ifstream in(path, std::ios::binary);
  if (!in) fail_io("read", path);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  SPARROW_CHECK(!in.bad(), "state_file: cannot read '" << path << "'");
  return decode_state(bytes, "state_file '" + path + "'");
}

}  // namespace sparrow::liteclient
