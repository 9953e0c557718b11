"""sparrow.Simulation: the same run as sparrow-sim, config dicts through the TOML parser, resume."""

import csv
import math
import os
import subprocess
import unittest

import numpy as np
import torch

from support import BIN_DIR, ScratchTest, sparrow, tiny


class SimulationTest(ScratchTest):
    def test_rounds_metrics_and_model(self):
        sim = sparrow.Simulation(tiny(self.path("run")))
        seen = [m["round"] for m in sim.rounds()]
        self.assertEqual(seen, [1, 2, 3])
        self.assertTrue(sim.done)
        table = sim.metrics()
        self.assertEqual(list(table["round"]), [1, 2, 3])
        # The figures are the run folder's metrics.csv.
        with open(os.path.join(sim.out, "metrics.csv")) as f:
            rows = list(csv.DictReader(f))
        self.assertEqual(len(rows), 3)
        for i, row in enumerate(rows):
            self.assertAlmostEqual(float(row["train_loss"]), float(table["train_loss"][i]), places=5)
            self.assertEqual(int(row["bytes_up"]), int(table["bytes_up"][i]))
        model = sim.model()
        self.assertEqual(sorted(model), ["fc.bias", "fc.weight"])
        self.assertIsInstance(model["fc.weight"], torch.Tensor)
        self.assertEqual(model["fc.weight"].dtype, torch.float32)
        # A copy: the caller may change it without changing the run.
        model["fc.weight"].zero_()
        self.assertGreater(float(sim.model()["fc.weight"].abs().sum()), 0)
        # The model a run folder's checkpoint holds is the same.
        ck, rnd = sparrow.load_run_model(sim.out)
        self.assertEqual(rnd, 3)
        self.assertSameModel(ck, sim.model())
        s = sim.summary()
        self.assertEqual(s["rounds"], 3)
        self.assertEqual(s["bytes_up"], int(np.sum(table["bytes_up"])))

    def test_same_model_as_sparrow_sim(self):
        cfg = tiny(self.path("py"), compression="topk:ratio=0.1")
        sparrow.Simulation(cfg).run()
        toml = self.path("exp.toml")
        with open(toml, "w") as f:
            f.write(sparrow._config.to_toml(tiny(self.path("cli"), compression="topk:ratio=0.1")))
        subprocess.run([os.path.join(BIN_DIR, "sparrow-sim"), "--config", toml, "--log-level", "warn"], check=True,
                       stdout=subprocess.DEVNULL)
        self.assertSameModel(sparrow.load_run_model(self.path("py"))[0], sparrow.load_run_model(self.path("cli"))[0])

    def test_toml_file_and_overrides(self):
        toml = self.path("exp.toml")
        with open(toml, "w") as f:
            f.write(sparrow._config.to_toml(tiny(self.path("a"), rounds=5)))
        sim = sparrow.Simulation(toml, rounds=2, profiles={"availability": 0.5}, out=self.path("b"))
        self.assertEqual(sim.total_rounds, 2)
        self.assertEqual(sim.out, self.path("b"))
        self.assertIn("availability = 0.5", sim.config())
        d = sparrow.Simulation(tiny(self.path("c")), rounds=1, profiles={"availability": 0.5})
        self.assertEqual(d.total_rounds, 1)
        self.assertIn("availability = 0.5", d.config())

    def test_unknown_key_is_the_toml_error(self):
        with self.assertRaises(sparrow.ConfigError) as d:
            sparrow.Simulation(tiny(self.path("x"), clients_per_rund=3))
        toml = self.path("bad.toml")
        with open(toml, "w") as f:
            f.write("clients_per_rund = 3\n")
        with self.assertRaises(sparrow.ConfigError) as t:
            sparrow.Simulation(toml)
        # The same message but for where the key was written.
        self.assertIn("config key 'clients_per_rund' is unknown: did you mean 'clients_per_round'?", str(d.exception))
        self.assertEqual(str(d.exception).split(": ", 1)[1], str(t.exception).split(": ", 1)[1])
        with self.assertRaises(sparrow.ConfigError):
            sparrow.Simulation(tiny(self.path("x"), compression="nope"))
        self.assertTrue(issubclass(sparrow.ConfigError, sparrow.Error))

    def test_run_folder_refused_then_forced(self):
        sparrow.Simulation(tiny(self.path("run"), rounds=1)).run()
        with self.assertRaisesRegex(sparrow.ConfigError, "already holds a run"):
            sparrow.Simulation(tiny(self.path("run"), rounds=1))
        sim = sparrow.Simulation(tiny(self.path("run"), rounds=1), force=True)
        sim.run()
        self.assertEqual(sim.completed_rounds, 1)

    def test_resume_continues_the_run(self):
        whole = sparrow.Simulation(tiny(self.path("whole"), rounds=4, checkpoint_every=1))
        whole.run()
        first = sparrow.Simulation(tiny(self.path("part"), rounds=2, checkpoint_every=1))
        first.run()
        first.close()
        rest = sparrow.Simulation.resume(self.path("part"), rounds=4)
        self.assertEqual(rest.completed_rounds, 2)
        self.assertEqual([m["round"] for m in rest.rounds()], [3, 4])
        self.assertEqual(list(rest.metrics()["round"]), [1, 2, 3, 4])
        self.assertSameModel(rest.model(), whole.model())

    def test_all_rounds_done(self):
        sim = sparrow.Simulation(tiny(self.path("run"), rounds=1))
        sim.run()
        with self.assertRaisesRegex(sparrow.ConfigError, "rounds are done"):
            sim.run_round()
        self.assertTrue(math.isfinite(sim.summary()["accuracy"]))

    def test_torchscript_module(self):
        sim = sparrow.Simulation(tiny(self.path("run"), rounds=1))
        sim.run()
        mod = sim.module()
        x = torch.randn(2, 60)
        self.assertEqual(tuple(mod(x).shape), (2, 10))
        w = sim.model()
        self.assertTrue(torch.allclose(mod(x), x @ w["fc.weight"].T + w["fc.bias"]))

    def test_dashboard(self):
        import json
        import urllib.request

        sim = sparrow.Simulation(tiny(self.path("run"), rounds=2), http="127.0.0.1:0")
        self.assertTrue(sim.url.startswith("http://127.0.0.1:"), sim.url)
        sim.run()

        direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback, whatever http_proxy says

        def get(path):
            with direct.open(sim.url + path, timeout=10) as r:
                return json.loads(r.read())

        self.assertEqual(get("api/run")["rounds_total"], 2)
        self.assertEqual(get("api/progress")["phase"], "done")
        rounds = get("api/rounds?since=0")["rounds"]
        self.assertEqual([r["round"] for r in rounds], [1, 2])
        self.assertAlmostEqual(rounds[1]["train_loss"], sim.metrics()["train_loss"][1], places=6)
        url = sim.url
        sim.close()  # the dashboard goes with the simulation
        with self.assertRaises(OSError):
            direct.open(url + "api/run", timeout=5)


if __name__ == "__main__":
    unittest.main()
