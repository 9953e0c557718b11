"""Your own data (arrays) and model (a torch.nn.Module) from Python, no files of yours."""

import os
import unittest

import numpy as np
import torch

from support import ScratchTest, sparrow


class Net(torch.nn.Module):
    def __init__(self, classes=4):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, classes)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def learnable(n, seed):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 4, n)
    x = rng.normal(size=(n, 16)).astype("float32") + 3 * np.eye(4, 16, dtype="float32")[y]
    return x, y


def config(out, **keys):
    cfg = {"clients": 10, "clients_per_round": 5, "rounds": 8, "eval_every": 1, "lr": 0.1, "out": out}
    cfg.update(keys)
    return cfg


class OwnDataTest(ScratchTest):
    def test_arrays_and_module_learn(self):
        torch.manual_seed(0)
        x, y = learnable(2000, 0)
        sim = sparrow.Simulation(config(self.path("run"), model=Net()), data=(x, y),
                                 test_data=(torch.from_numpy(learnable(500, 1)[0]), torch.from_numpy(learnable(500, 1)[1])))
        sim.run()
        acc = sim.metrics()["accuracy"]
        self.assertGreater(acc[-1], 0.9)  # 4 well-separated classes
        self.assertEqual(sorted(sim.model()), ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"])
        self.assertTrue(os.path.exists(os.path.join(self.path("run"), "inputs", "model.pt")))
        # The trained weights load back into your own class.
        net = Net()
        net.load_state_dict(sim.model())
        xt, yt = learnable(500, 1)
        self.assertAlmostEqual(float((net(torch.from_numpy(xt)).argmax(1).numpy() == yt).mean()), acc[-1], places=6)
        sim.close()
        # Resume finds the inputs in the run folder.
        more = sparrow.Simulation.resume(self.path("run"), rounds=9)
        self.assertEqual([m["round"] for m in more.rounds()], [9])

    def test_preflight_and_input_errors(self):
        x, y = learnable(100, 0)
        with self.assertRaisesRegex(sparrow.ConfigError, "outputs"):
            sparrow.Simulation(config(self.path("few"), model=Net(classes=2)), data=(x, y))  # labels up to 3
        with self.assertRaisesRegex(sparrow.ConfigError, "samples but y has"):
            sparrow.Simulation(config(self.path("len"), model=Net()), data=(x, y[:50]))
        with self.assertRaisesRegex(sparrow.ConfigError, "integer class labels"):
            sparrow.Simulation(config(self.path("float"), model=Net()), data=(x, y.astype("float32")))

        class Unscriptable(torch.nn.Module):
            def forward(self, x):
                return x.numpy()  # not TorchScript

        with self.assertRaisesRegex(sparrow.ConfigError, "torch.jit.script cannot compile Unscriptable"):
            sparrow.Simulation(config(self.path("script"), model=Unscriptable()), data=(x, y))


if __name__ == "__main__":
    unittest.main()
