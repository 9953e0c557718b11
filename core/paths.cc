#include "core/paths.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <sstream>

#include "core/error.h"

namespace sparrow::core {
namespace fs = std::filesystem;

namespace {
std::string quoted(const std::string& s) { return "'" + s + "'"; }
}  // namespace

void check_file_path(const std::string& key, const std::string& path) {
  std::error_code ec;
  SPARROW_CHECK_T(ConfigError, !fs::is_directory(path, ec),
                  "config key " << quoted(key) << ": " << quoted(path) << " is a folder, not a file");
  if (fs::exists(path, ec)) return;
  const fs::path parent = fs::path(path).parent_path();
  if (parent.empty()) return;
  SPARROW_CHECK_T(ConfigError, fs::is_directory(parent, ec),
                  "config key " << quoted(key) << ": " << quoted(path) << " is in " << quoted(parent.string())
                                << (fs::exists(parent, ec) ? ", which is not a folder" : ", which does not exist"));
}

void check_output_folder(const std::string& key, const std::string& path) {
  std::error_code ec;
  const fs::path p = fs::absolute(path.empty() ? fs::path(".") : fs::path(path), ec);
  if (fs::exists(p, ec)) {
    SPARROW_CHECK_T(ConfigError, fs::is_directory(p, ec),
                    "config key " << quoted(key) << ": " << quoted(path) << " is a file, not a folder");
    return;
  }
  // The nearest missing folder: make it and remove it again.
  fs::path missing = p;
  while (missing.has_parent_path() && missing.parent_path() != missing && !fs::exists(missing.parent_path(), ec))
    missing = missing.parent_path();
  const fs::path parent = missing.parent_path();
  SPARROW_CHECK_T(ConfigError, fs::is_directory(parent, ec),
                  "config key " << quoted(key) << ": cannot create the folder " << quoted(path) << ": "
                                << quoted(parent.string()) << " is not a folder");
  if (::mkdir(missing.c_str(), 0700) != 0) {
    const int err = errno;
    throw ConfigError("config key " + quoted(key) + ": cannot create the folder " + quoted(path) + " (" +
                      std::strerror(err) + " in " + quoted(parent.string()) + ")");
  }
  ::rmdir(missing.c_str());
}

void check_input_file(const std::string& key, const std::string& path) {
  std::error_code ec;
  SPARROW_CHECK_T(ConfigError, fs::exists(path, ec),
                  "config key " << quoted(key) << ": " << quoted(path) << " does not exist");
  SPARROW_CHECK_T(ConfigError, !fs::is_directory(path, ec),
                  "config key " << quoted(key) << ": " << quoted(path) << " is a folder, not a file");
  SPARROW_CHECK_T(ConfigError, ::access(path.c_str(), R_OK) == 0,
                  "config key " << quoted(key) << ": " << quoted(path) << " cannot be read");
}

void check_input_path(const std::string& key, const std::string& path) {
  std::error_code ec;
  SPARROW_CHECK_T(ConfigError, fs::exists(path, ec),
                  "config key " << quoted(key) << ": " << quoted(path) << " does not exist");
  SPARROW_CHECK_T(ConfigError, ::access(path.c_str(), R_OK) == 0,
                  "config key " << quoted(key) << ": " << quoted(path) << " cannot be read");
}

namespace {
// x.npy + y.npy, or an IDX image and label file pair with `prefix` (train or t10k).
bool holds_data(const fs::path& dir) {
  std::error_code ec;
  auto has = [&](const std::string& name) {
    return fs::is_regular_file(dir / name, ec) || fs::is_regular_file(dir / (name + ".gz"), ec);
  };
  if (fs::is_regular_file(dir / "x.npy", ec) && fs::is_regular_file(dir / "y.npy", ec)) return true;
  for (const char* prefix : {"train", "t10k"})
    if (has(std::string(prefix) + "-images-idx3-ubyte") && has(std::string(prefix) + "-labels-idx1-ubyte")) return true;
  return false;
}
}  // namespace

void check_data_folder(const std::string& key, const std::string& path) {
  std::error_code ec;
  SPARROW_CHECK_T(ConfigError, fs::is_directory(path, ec),
                  "config key " << quoted(key) << ": " << quoted(path)
                                << (fs::exists(path, ec) ? " is not a folder" : " does not exist"));
  SPARROW_CHECK_T(ConfigError, holds_data(path) || holds_data(fs::path(path) / "test"),
                  "config key " << quoted(key) << ": the folder " << quoted(path)
                                << " holds no data (x.npy + y.npy, or MNIST-format IDX files such as "
                                   "train-images-idx3-ubyte + train-labels-idx1-ubyte)");
}

std::string secret_file_warning(const std::string& key, const std::string& path) {
  struct stat st {};
  if (path.empty() || ::stat(path.c_str(), &st) != 0 || (st.st_mode & 077) == 0) return "";
  std::ostringstream os;
  os << "config key " << quoted(key) << ": the secret key file " << quoted(path) << " can be "
     << ((st.st_mode & 044) ? "read" : "used") << " by other users (mode " << std::oct << (st.st_mode & 0777)
     << "); anyone who reads it can act as this program: chmod 600 " << quoted(path);
  return os.str();
}

}  // namespace sparrow::core
