"""Ctrl-C in a run: the round in progress is given up, the last completed one is checkpointed,
KeyboardInterrupt is raised, and Simulation.resume ends with the uninterrupted run's model."""

import os
import signal
import time
import unittest

from support import ScratchTest, sparrow, tiny

STOP_IN_ROUND = {"round": 0}


def first_k(round, candidates, k):
    if round == STOP_IN_ROUND["round"]:
        os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C in a terminal or a notebook
        time.sleep(0.5)  # the caller's thread notices within 0.1 s, before any client trains
    return candidates[(round % 3):][:k]


sparrow.register_sampler("py_first_k", first_k)


class InterruptTest(ScratchTest):
    def setUp(self):
        super().setUp()
        # ctest may start us with SIGINT ignored; a notebook has Python's handler.
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        self.addCleanup(signal.signal, signal.SIGINT, previous)

    def test_ctrl_c_checkpoints_and_resumes(self):
        STOP_IN_ROUND["round"] = 0
        whole = sparrow.Simulation(tiny(self.path("whole"), sampler="py_first_k", rounds=4))
        whole.run()
        STOP_IN_ROUND["round"] = 3
        sim = sparrow.Simulation(tiny(self.path("cut"), sampler="py_first_k", rounds=4))
        with self.assertRaises(KeyboardInterrupt):
            sim.run()
        self.assertEqual(sim.completed_rounds, 2)
        with self.assertRaisesRegex(sparrow.Error, "interrupted after round 2; continue it with Simulation.resume"):
            sim.run_round()
        self.assertEqual(sparrow.load_run_model(self.path("cut"))[1], 2)  # checkpointed, although checkpoint_every = 10
        sim.close()
        STOP_IN_ROUND["round"] = 0
        rest = sparrow.Simulation.resume(self.path("cut"))
        self.assertEqual([m["round"] for m in rest.rounds()], [3, 4])
        self.assertSameModel(rest.model(), whole.model())


if __name__ == "__main__":
    unittest.main()
