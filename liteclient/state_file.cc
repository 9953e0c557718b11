#include "liteclient/state_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "core/error.h"

namespace sparrow::liteclient {
namespace {

constexpr char kMagic[8] = {'S', 'P', 'R', 'W', 'L', 'C', 'S', 'T'};
constexpr uint32_t kVersion = 1;
constexpr uint64_t kFnvOffset = 0xcbf29ce484222325ull, kFnvPrime = 0x100000001b3ull;

uint64_t fnv1a(const char* p, size_t n) {
  uint64_t h = kFnvOffset;
  for (size_t i = 0; i < n; ++i) {
    h ^= static_cast<unsigned char>(p[i]);
    h *= kFnvPrime;
  }
  return h;
}

template <typename T>
void put(std::string& out, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));  // little-endian hosts only (x86-64, arm64)
  out.append(b, sizeof(T));
}

void put_str(std::string& out, const std::string& s) {
  put<uint32_t>(out, static_cast<uint32_t>(s.size()));
  out += s;
}

void put_floats(std::string& out, const std::vector<float>& v) {
  put<uint64_t>(out, v.size());
  out.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

class Reader {
 public:
  Reader(const std::string& b, size_t end, const std::string& what) : b_(b), end_(end), what_(what) {}
  template <typename T>
  T get() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, b_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::string str() {
    const auto n = get<uint32_t>();
    need(n);
    std::string s = b_.substr(pos_, n);
    pos_ += n;
    return s;
  }
  std::vector<float> floats() {
    const auto n = get<uint64_t>();
    SPARROW_CHECK_T(FormatError, n <= (end_ - pos_) / sizeof(float), what_ << ": truncated state file");
    std::vector<float> v(static_cast<size_t>(n));
    std::memcpy(v.data(), b_.data() + pos_, v.size() * sizeof(float));
    pos_ += v.size() * sizeof(float);
    return v;
  }
  size_t pos() const { return pos_; }

 private:
  void need(uint64_t n) const { SPARROW_CHECK_T(FormatError, n <= end_ - pos_, what_ << ": truncated state file"); }
  const std::string& b_;
  size_t end_;
  const std::string& what_;
  size_t pos_ = 0;
};

void put_codec(std::string& out, const std::map<std::string, std::string>& codec) {
  put<uint32_t>(out, static_cast<uint32_t>(codec.size()));
  for (const auto& [name, bytes] : codec) {
    put_str(out, name);
    put_str(out, bytes);
  }
}

std::map<std::string, std::string> get_codec(Reader& r, const std::string& what) {
  std::map<std::string, std::string> codec;
  const auto n = r.get<uint32_t>();
  for (uint32_t i = 0; i < n; ++i) {
    std::string name = r.str();
    SPARROW_CHECK_T(FormatError, !codec.count(name), what << ": codec state of '" << name << "' appears twice");
    codec[name] = r.str();
  }
  return codec;
}

[[noreturn]] void fail_io(const std::string& what, const std::string& path) {
  throw Error("state_file: cannot " + what + " '" + path + "': " + std::strerror(errno));
}

}  // namespace

std::string encode_state(const ClientState& s) {
  std::string out(kMagic, sizeof(kMagic));
  put<uint32_t>(out, kVersion);
  put_str(out, s.client_id);
  put<uint64_t>(out, s.digest);
  put_str(out, s.run_id);
  put<uint8_t>(out, s.holds_model ? 1 : 0);
  put<uint64_t>(out, s.held_round);
  put_floats(out, s.held);
  put<uint64_t>(out, s.rounds);
  put_floats(out, s.control);
  put_codec(out, s.codec);
  put<uint64_t>(out, s.committed_round);
  put<uint8_t>(out, s.answered ? 1 : 0);
  put_floats(out, s.prev_control);
  put_codec(out, s.prev_codec);
  put<uint64_t>(out, fnv1a(out.data(), out.size()));
  return out;
}

ClientState decode_state(const std::string& b, const std::string& what) {
  SPARROW_CHECK_T(FormatError, b.size() >= sizeof(kMagic) + 4 + 8, what << ": truncated state file");
  SPARROW_CHECK_T(FormatError, std::memcmp(b.data(), kMagic, sizeof(kMagic)) == 0,
                  what << ": not a sparrow-client-lite state file (another magic)");
  const size_t end = b.size() - 8;
  uint64_t sum = 0;
  std::memcpy(&sum, b.data() + end, 8);
  Reader r(b, end, what);
  r.get<uint64_t>();  // the magic
  const auto version = r.get<uint32_t>();
  SPARROW_CHECK_T(FormatError, version == kVersion,
                  what << ": state file version " << version << ", this build reads " << kVersion);
  SPARROW_CHECK_T(FormatError, sum == fnv1a(b.data(), end), what << ": checksum mismatch (the file is damaged)");
  ClientState s;
  s.client_id = r.str();
  s.digest = r.get<uint64_t>();
  s.run_id = r.str();
  const auto holds = r.get<uint8_t>();
  SPARROW_CHECK_T(FormatError, holds <= 1, what << ": bad held-model flag");
  s.holds_model = holds == 1;
  s.held_round = r.get<uint64_t>();
  s.held = r.floats();
  s.rounds = r.get<uint64_t>();
  s.control = r.floats();
  s.codec = get_codec(r, what);
  s.committed_round = r.get<uint64_t>();
  const auto answered = r.get<uint8_t>();
  SPARROW_CHECK_T(FormatError, answered <= 1, what << ": bad answered flag");
  s.answered = answered == 1;
  s.prev_control = r.floats();
  s.prev_codec = get_codec(r, what);
  SPARROW_CHECK_T(FormatError, r.pos() == end, what << ": trailing bytes after the state");
  return s;
}

void save_state(const std::string& path, const ClientState& s) {
  const std::string bytes = encode_state(s);
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) fail_io("write", tmp);
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t w = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) {
      const int e = errno;
      ::close(fd);
      errno = e;
      fail_io("write", tmp);
    }
    done += static_cast<size_t>(w);
  }
  // The bytes reach the disk before the name points at them.
  if (::fsync(fd) != 0) {
    const int e = errno;
    ::close(fd);
    errno = e;
    fail_io("sync", tmp);
  }
  if (::close(fd) != 0) fail_io("close", tmp);
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
