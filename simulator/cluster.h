#pragma once
// The ranks of one simulation run over MPI (docs/simulator.md, "Several
// machines: MPI ranks"). Rank 0 is the server's side of the run: it samples the
// clients, keeps the client-state store and the checkpoints, folds every update
// and steps the global model; ranks 1..R-1 train the clients rank 0 hands them.
// Only bytes cross this interface (serialized weights, client states and wire
// updates), so the simulator's rank code needs no MPI headers and a build
// without MPI compiles the same simulator.

#include <cstdint>
#include <memory>
#include <string>

namespace sparrow::simulator {

class Cluster {
 public:
  virtual ~Cluster() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Rank 0's `bytes` reach every rank (on the others `bytes` is replaced).
  virtual void broadcast(std::string& bytes) = 0;
  // Point to point, in order per pair of ranks; any size (sent in pieces
  // below MPI's int count limit).
  virtual void send(int to, const std::string& bytes) = 0;
  // Into `bytes` (resized; its capacity is reused: large messages are then
  // not fresh pages every round).
  virtual void receive(int from, std::string& bytes) = 0;
  // Ends every rank of the job (after an error one rank cannot report to the
  // others); does not return.
  [[noreturn]] virtual void abort(int code) = 0;
};

// True when this build can run over MPI (CMake option SPARROW_MPI and an MPI
// implementation found).
bool built_with_mpi();

// True when this process was started by an MPI launcher (mpirun/mpiexec:
// Open MPI's OMPI_COMM_WORLD_SIZE, or PMI/PMIx's variables).
bool started_by_mpi_launcher();

// Ranks of this job on this machine (Open MPI's OMPI_COMM_WORLD_LOCAL_SIZE;
// 1 when unknown): they share its cores.
int local_ranks();

// Joins the MPI job this process was started in (MPI_Init_thread; the
// destructor calls MPI_Finalize). nullptr when not started by a launcher.
// Throws ConfigError when started by a launcher in a build without MPI.
std::unique_ptr<Cluster> join_mpi(int* argc, char*** argv);

}  // namespace sparrow::simulator
