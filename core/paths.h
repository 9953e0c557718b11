#pragma once
// Checks of the paths a config names, made before a program starts anything
// (binds, opens, trains), so that a bad path is a config error naming the key
// (exit 2) rather than SQLite's or the filesystem's text halfway through.

#include <string>

namespace sparrow::core {

// `path` (the value of config key `key`) names a file the program creates or
// writes (a database, a progress file). ConfigError naming the key when it is
// a folder, or when its folder does not exist or is not a folder. Nothing is
// created.
void check_file_path(const std::string& key, const std::string& path);

// `path` names a folder the program creates or writes into (`out`).
// ConfigError naming the key when it exists and is not a folder, or when it
// cannot be created (a parent that is a file, a read-only or virtual file
// system such as /proc): the nearest missing folder is made and removed again
// to find out, so nothing is left behind.
void check_output_folder(const std::string& key, const std::string& path);

// `path` names a file the program reads (a key, an allow-list, a weights or
// token file). ConfigError naming the key when it does not exist, is a folder
// or cannot be opened for reading.
void check_input_file(const std::string& key, const std::string& path);

// `path` names a file or a folder the program reads (an allow-list may be
// either). ConfigError naming the key when it does not exist or cannot be read.
void check_input_path(const std::string& key, const std::string& path);

// `path` names a folder of the user's data (core/data_folder.h): x.npy + y.npy,
// MNIST-format IDX train or t10k files (optionally .gz), or a test/ subfolder
// holding either. ConfigError naming the key when it is not a folder or holds
// none of these (e.g. /etc). The files themselves are read later.
void check_data_folder(const std::string& key, const std::string& path);

// `path` names a secret key file. A warning naming the key and the file when
// other users may read or write it (as ssh warns); "" when it is private or
// cannot be examined (loading it then reports the problem).
std::string secret_file_warning(const std::string& key, const std::string& path);

}  // namespace sparrow::core
