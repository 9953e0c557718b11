#pragma once
// The deployed client's training data: a shard of a built-in dataset or of a
// folder of the user's own data (core/data_folder.h). Every client of a run
// computes the same partition and takes its own shard, the one the simulator
// gives its client `index` (core::partition_folder). Whatever the source, the
// result is checked against the model before any connection is made: samples
// must fit the model's input shape and labels its classes.

#include <string>

#include "client/session.h"
#include "core/data_folder.h"
#include "core/datasets.h"

namespace sparrow::core {
class FlatConfig;
}

namespace sparrow::client {

// Loads the data DataConfig names (see its comment) and checks it with
// core::check_data_for_model(). ConfigError for a bad setting or a missing
// file, FormatError for a file that does not hold what it should.
core::Dataset load_client_data(const DataConfig& cfg, const std::string& model);

// Checks the data keys (data, data_dir, partition, clients, index,
// partition_seed; bound in `f` under those names) against the source they
// apply to, after the file and the overrides: a key that the source makes
// meaningless is a ConfigError naming it and why (data_dir without
// fashion-mnist, partition with synthetic data, partition and partition_seed
// other than their defaults with clients = 1, clients and partition_seed with
// a natural partition), so no setting is silently ignored. A folder that carries client_id.npy gets
// partition = "natural" unless `partition` was set. Shared by sparrow-client
// and sparrow-edge, whose data keys are the same.
void check_data_keys(const core::FlatConfig& f, DataConfig& d);

using core::check_data_for_model;
using core::check_model_on_data;
using core::load_data_folder;
using core::load_data_folder_test;
using core::read_npy_labels;

}  // namespace sparrow::client
