#pragma once
// The dashboard's view of a simulation (docs/monitoring.md), for sparrow-sim
// and the Python package alike: the run, its rounds, the progress of the
// round in training and the clients that took part so far (a population of
// thousands shows those that trained). Every call is from the thread that
// drives the Simulator except received(), which only updates the progress.

#include <cstdint>
#include <map>
#include <memory>

#include "monitor/board.h"

namespace sparrow::simulator {

class Simulator;
struct RoundMetrics;

class SimBoard {
 public:
  explicit SimBoard(std::shared_ptr<monitor::Board> b) : board_(std::move(b)) {}

  // The run (its config as sparrow-sim writes it) and the rounds already done.
  void start(const Simulator& sim);
  void round_started(int round, int selected);
  // Clients of the round in training that finished so far.
  void received(int64_t n);
  void round_done(const RoundMetrics& m, bool last);
  void stopped();

 private:
  std::shared_ptr<monitor::Board> board_;
  std::map<int64_t, monitor::ClientInfo> clients_;
};

}  // namespace sparrow::simulator
