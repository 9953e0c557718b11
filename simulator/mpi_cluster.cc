#include <cstdlib>
#include <cstring>
#include <limits>

#include "core/error.h"
#include "simulator/cluster.h"

#ifdef SPARROW_WITH_MPI
#include <mpi.h>
#endif

namespace sparrow::simulator {

bool started_by_mpi_launcher() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"})
    if (std::getenv(v) != nullptr) return true;
  return false;
}

int local_ranks() {
  for (const char* v : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"})
    if (const char* n = std::getenv(v)) {
      const int k = std::atoi(n);
      if (k >= 1) return k;
    }
  return 1;
}

#ifdef SPARROW_WITH_MPI

bool built_with_mpi() { return true; }

namespace {

// MPI counts are ints: large messages go in pieces of at most 1 GiB.
constexpr size_t kPiece = size_t{1} << 30;

void check(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw Error(std::string("MPI ") + what + ": " + std::string(text, static_cast<size_t>(len)));
}

class MpiCluster final : public Cluster {
 public:
  MpiCluster(int* argc, char*** argv) {
    int provided = 0;
    // Only the main thread calls MPI (workers are threads of one rank).
    check(MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided), "init");
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
    if (provided < MPI_THREAD_FUNNELED) {
      MPI_Finalize();
      throw Error("MPI: this MPI library does not allow threads in a rank (MPI_THREAD_FUNNELED)");
    }
  }
  ~MpiCluster() override { MPI_Finalize(); }

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void broadcast(std::string& bytes) override {
    uint64_t n = bytes.size();
    check(MPI_Bcast(&n, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD), "broadcast");
    if (rank_ != 0) bytes.resize(n);
    for (size_t off = 0; off < n; off += kPiece) {
      const int len = static_cast<int>(std::min<size_t>(kPiece, n - off));
      check(MPI_Bcast(bytes.data() + off, len, MPI_BYTE, 0, MPI_COMM_WORLD), "broadcast");
    }
  }

  void send(int to, const std::string& bytes) override {
    uint64_t n = bytes.size();
    check(MPI_Send(&n, 1, MPI_UINT64_T, to, 0, MPI_COMM_WORLD), "send");
    for (size_t off = 0; off < n; off += kPiece) {
      const int len = static_cast<int>(std::min<size_t>(kPiece, n - off));
      check(MPI_Send(bytes.data() + off, len, MPI_BYTE, to, 0, MPI_COMM_WORLD), "send");
    }
  }

  void receive(int from, std::string& bytes) override {
    uint64_t n = 0;
    check(MPI_Recv(&n, 1, MPI_UINT64_T, from, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE), "receive");
    bytes.resize(n);
    for (size_t off = 0; off < n; off += kPiece) {
      const int len = static_cast<int>(std::min<size_t>(kPiece, n - off));
      check(MPI_Recv(bytes.data() + off, len, MPI_BYTE, from, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE), "receive");
    }
  }

  [[noreturn]] void abort(int code) override {
    MPI_Abort(MPI_COMM_WORLD, code);
    std::_Exit(code);
  }

 private:
  int rank_ = 0, size_ = 1;
};

}  // namespace

std::unique_ptr<Cluster> join_mpi(int* argc, char*** argv) {
  if (!started_by_mpi_launcher()) return nullptr;
  return std::make_unique<MpiCluster>(argc, argv);
}

#else

bool built_with_mpi() { return false; }

std::unique_ptr<Cluster> join_mpi(int*, char***) {
  if (!started_by_mpi_launcher()) return nullptr;
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"})
    if (const char* n = std::getenv(v); n != nullptr && std::strcmp(n, "1") == 0)
      return nullptr;  // one rank: the plain simulator
  throw ConfigError(
      "started by an MPI launcher, but this sparrow-sim was built without MPI (install libopenmpi-dev and "
      "rebuild with -DSPARROW_MPI=ON)");
}

#endif

}  // namespace sparrow::simulator
