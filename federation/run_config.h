#pragma once
// The one configuration model of a run (docs/configuration.md): the keys that
// sparrow-sim and sparrow-server share, declared, defaulted, bound and
// validated here once, so a simulation's config runs as a deployment with only
// the deployment keys added, and both programs give the same value, the same
// default and the same error text for each shared key.
//
// Contract:
//  - server::ServerConfig and simulator::SimConfig derive from RunConfig: code
//    reads `cfg.lr` either way. Each program binds its own keys after
//    bind(f, run) and calls validate(run, f) once the file and the overrides
//    are in.
//  - The keys only the other program uses are accepted, type-checked and
//    listed in RunConfig::no_effect (OtherProgramKeys): never silently ignored,
//    never an error. Each program reports them once when it loads a file.
//  - `clients` is the one shared key whose default differs: a simulation needs
//    a population (SimConfig sets 100); a deployment's is the clients that
//    connect (0 = not fixed).

#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <vector>

namespace sparrow::core {
class FlatConfig;
}

namespace sparrow::federation {

struct RunConfig {
  // The model.
  std::string model = "mlp";  // model spec (core::make_model; the simulator also has logreg)
  uint64_t seed = 1;          // run seed: every random choice of the run derives from it
  uint64_t model_seed = 0;    // the initial model is make_model(model, effective_model_seed()); 0 = seed

  // Local training (sent in every task).
  std::string algorithm = "fedavg";  // fedavg | fedprox | scaffold | fednova | feddyn
  double mu = 0;                     // FedProx proximal weight
  double feddyn_alpha = 0;           // FedDyn regulariser weight (> 0 with feddyn, 0 otherwise)
  int local_epochs = 1;
  int batch_size = 32;
  double lr = 0.05;
  double momentum = 0;
  double weight_decay = 0;

  // Codecs and the global step.
  std::string compression = "none";         // uplink compressor spec
  std::string downlink = "none";            // "none" or a compressor spec for the broadcast model delta
  std::string downlink_catchup = "auto";    // full | chain[:max=K] | patch | auto[:max=K] (federation/catchup.h)
  std::string server_optimizer = "fedavg";  // aggregation::ServerOptimizer spec
  std::string aggregator = "mean";          // robust aggregator spec (aggregation/robust.h)
  std::string dp = "none";                  // none | central:clip=,noise= | local:clip=,noise=
  std::string secagg = "none";              // none | secagg+:degree=,threshold=,clip=,timeout=
  double max_buffer_mb = 2048;              // bound on a buffering aggregator's memory (clients_per_round x model)
  // Early updates held so that a round is summed in client-id order
  // (federation/ordered_fold.h); past it, arrival order. 0 = arrival order.
  double fold_buffer_mb = 512;

  // Rounds and population.
  int rounds = 10;
  int clients_per_round = 10;
  // Who takes part (federation/sampler.h): "uniform", "least_recent", a
  // registered rule, or "auto" = the program's own (uniform in the
  // simulator, least_recent in the service).
  std::string sampler = "auto";
  // The population: the simulator's number of clients; the service's divisor
  // of SCAFFOLD's control update. 0 = not fixed (the service counts the
  // clients it has seen; the simulator refuses it).
  int clients = 0;

  // Buffered asynchronous aggregation (federation/async_engine.h,
  // docs/async.md): "sync" rounds, or "async" steps every `buffer` updates
  // with at most `max_concurrency` clients training, each update discounted
  // by `staleness` (federation/async_staleness.h). `rounds` counts steps.
  std::string mode = "sync";
  int buffer = 0;           // K; 0 = clients_per_round
  int max_concurrency = 0;  // C; 0 = buffer
  std::string staleness = "poly:a=0.5";

  // Evaluation of the global model: every eval_every rounds and after the
  // last; 0 = no periodic evaluation (the simulator still evaluates the last
  // round; the service evaluates nothing and needs no data).
  int eval_every = 0;
  std::string data_dir = "/usr/share/datasets/fashion-mnist";  // Fashion-MNIST IDX files

  // Keys the file set that only the other program uses (bind order); filled
  // by OtherProgramKeys::collect, reported by the program that loads a file.
  std::vector<std::string> no_effect;

  uint64_t effective_model_seed() const { return model_seed != 0 ? model_seed : seed; }
  // The selection rule's name, "auto" resolved to `own` (the program's rule).
  std::string effective_sampler(const std::string& own) const { return sampler == "auto" ? own : sampler; }
  // What SCAFFOLD's c += Σ Δc_i / population divides by, given the clients a
  // driver has seen: the larger of `clients` and those seen, at least 1 (a
  // deployment where more clients connect than declared averages over them).
  double scaffold_population(size_t seen) const;
};

// Binds the shared keys of `c` (in the order docs/configuration.md lists them).
void bind(core::FlatConfig& f, RunConfig& c);

// Checks the shared keys: finiteness (every double bound in `f`), ranges, spec
// strings (each built once: compressor, optimiser, aggregator, DP, SecAgg+) and
// their combinations. Throws ConfigError "<where>: config key 'k' <what>", the
// location from `f` (the binder that read the file).
void validate(const RunConfig& c, const core::FlatConfig& f);
// The same for a config built in code: the message without a location.
void validate(const RunConfig& c);

// The keys of the other program, bound to throwaway fields of their types so
// that a file written for one program loads in the other.
class OtherProgramKeys {
 public:
  enum class Program { kSimulator, kServer };
  // `self` is the program reading: the server binds the simulation-only keys,
  // the simulator the deployment-only keys. `f` must not outlive this object.
  OtherProgramKeys(core::FlatConfig& f, Program self);
  // The keys among them that the file or an override set, into c.no_effect.
  void collect(const core::FlatConfig& f, RunConfig& c) const;
  // The line each program logs for such a key: "config key 'k' has no effect
  // in <program> (...)".
  static std::string note(const std::string& key, Program self);
  // The keys the other program only uses (for docs and tests).
  static std::vector<std::string> keys(Program self);

 private:
  std::vector<std::string> keys_;
  std::deque<std::string> strings_;
  std::deque<double> doubles_;
  std::deque<int64_t> ints_;
  std::deque<bool> bools_;
};

}  // namespace sparrow::federation
