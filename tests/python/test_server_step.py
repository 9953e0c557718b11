"""Server optimisers written in Python: the global model's step in the shared round."""

import unittest

import numpy as np
import torch

from support import ScratchTest, sparrow, tiny

ROUNDS = []


@sparrow.register_server_optimizer("py_fedavg")
def py_fedavg(round, weights, aggregate):
    """The built-in fedavg (lr = 1): x += Δ, in numpy."""
    ROUNDS.append(round)
    return {n: w.numpy() + aggregate[n].numpy() for n, w in weights.items()}


# FedAdam as the built-in computes it (Reddi et al.'s Algorithm 2, no bias
# correction): the same float32 torch operations in the same order, with the
# constants rounded to float32 as the C++ side rounds them.
F32 = np.float32
LR, B1, B2, TAU = F32(0.01), F32(0.9), F32(0.99), F32(1e-3)


@sparrow.register_server_optimizer("py_fedadam", slots=("m", "v"))
def py_fedadam(round, weights, aggregate, state):
    out = {}
    for n, w in weights.items():
        d, s = aggregate[n], state[n]
        if "m" not in s:  # the first step
            s["m"] = torch.zeros_like(w)
            s["v"] = torch.full_like(w, float(TAU * TAU))
        s["m"].mul_(float(B1)).add_(d, alpha=float(F32(1) - B1))
        s["v"].mul_(float(B2)).add_(d * d, alpha=float(F32(1) - B2))
        out[n] = w.addcdiv(s["m"], s["v"].sqrt().add_(float(TAU)), value=float(LR))
    return out


class ServerStepTest(ScratchTest):
    def run_sim(self, name, **keys):
        sim = sparrow.Simulation(tiny(self.path(name), **keys))
        sim.run()
        return sim

    def test_fedavg_in_python_is_the_builtin_bit_for_bit(self):
        ROUNDS.clear()
        builtin = self.run_sim("builtin")
        mine = self.run_sim("python", server_optimizer="py_fedavg")
        self.assertSameModel(builtin.model(), mine.model())
        self.assertEqual(ROUNDS, [1, 2, 3])

    def test_fedadam_in_python_is_the_builtin_bit_for_bit(self):
        builtin = self.run_sim("builtin", server_optimizer="fedadam", rounds=4)
        mine = self.run_sim("python", server_optimizer="py_fedadam", rounds=4)
        self.assertSameModel(builtin.model(), mine.model())
        # ... and differs from plain fedavg, so the comparison can fail.
        avg = self.run_sim("avg", rounds=4)
        self.assertFalse(bool((avg.model()["fc.weight"] == mine.model()["fc.weight"]).all()))

    def test_state_is_checkpointed_and_resumed(self):
        whole = self.run_sim("whole", server_optimizer="py_fedadam", rounds=4, checkpoint_every=1)
        first = self.run_sim("part", server_optimizer="py_fedadam", rounds=2, checkpoint_every=1)
        first.close()
        rest = sparrow.Simulation.resume(self.path("part"), rounds=4)
        rest.run()
        self.assertSameModel(rest.model(), whole.model())

    def test_listed_replaced_and_refused(self):
        self.assertIn("py_fedadam", sparrow.server_optimizer_names())
        self.assertIn("fedadam", sparrow.server_optimizer_names())
        with self.assertRaises(sparrow.Error):
            sparrow.register_server_optimizer("fedavg", py_fedavg)  # a built-in
        sparrow.register_server_optimizer("py_stay", lambda r, w, d: w)
        sparrow.register_server_optimizer("py_stay", lambda r, w, d: {n: torch.zeros_like(t) for n, t in w.items()})
        sim = self.run_sim("zero", server_optimizer="py_stay", rounds=1)
        self.assertEqual(float(sim.model()["fc.weight"].abs().sum()), 0.0)

    def test_bad_results_end_the_run(self):
        sparrow.register_server_optimizer("py_short", lambda r, w, d: {"fc.weight": w["fc.weight"]})
        with self.assertRaisesRegex(ValueError, "returned 1 tensors for a model of 2"):
            self.run_sim("short", server_optimizer="py_short", rounds=1)
        sparrow.register_server_optimizer("py_none", lambda r, w, d: None)
        with self.assertRaisesRegex(TypeError, "returned NoneType"):
            self.run_sim("none", server_optimizer="py_none", rounds=1)
        sparrow.register_server_optimizer("py_nan", lambda r, w, d: {n: t * float("nan") for n, t in w.items()})
        with self.assertRaisesRegex(ValueError, "is not finite"):
            self.run_sim("nan", server_optimizer="py_nan", rounds=1)
        sparrow.register_server_optimizer("py_noslot", lambda r, w, d, s: w, slots=["m"])
        with self.assertRaisesRegex(ValueError, r"left no state\['fc.bias'\]\['m'\]"):
            self.run_sim("noslot", server_optimizer="py_noslot", rounds=1)
        with self.assertRaisesRegex(sparrow.ConfigError, "lr"):
            self.run_sim("keys", server_optimizer="py_fedavg:lr=2", rounds=1)


if __name__ == "__main__":
    unittest.main()
