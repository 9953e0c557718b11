#pragma once
// The deployed client's training data: a shard of a built-in dataset (every
// client of a run computes the same partition and takes its own shard) or a
// folder of the user's own data (core/data_folder.h). Whatever the source, the
// result is checked against the model before any connection is made: samples
// must fit the model's input shape and labels its classes.

#include <string>

#include "client/session.h"
#include "core/data_folder.h"
#include "core/datasets.h"

namespace sparrow::client {

// Loads the data DataConfig names (see its comment) and checks it with
// core::check_data_for_model(). ConfigError for a bad setting or a missing
// file, FormatError for a file that does not hold what it should.
core::Dataset load_client_data(const DataConfig& cfg, const std::string& model);

using core::check_data_for_model;
using core::check_model_on_data;
using core::load_data_folder;
using core::load_data_folder_test;
using core::read_npy_labels;

}  // namespace sparrow::client
