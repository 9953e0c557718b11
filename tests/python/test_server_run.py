"""sparrow.ServerRun: a server's database as `sparrow-server status --json` and `export` read it."""

import json
import os
import subprocess
import unittest

import numpy as np

from support import BIN_DIR, ScratchTest, sparrow


class ServerRunTest(ScratchTest):
    def test_status_and_export(self):
        server = os.path.join(BIN_DIR, "sparrow-server")
        d = self.path("try")
        subprocess.run([server, "try", "--clients", "2", "--rounds", "2", "--dir", d, "--log-level", "warn"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=240)
        db = os.path.join(d, "server.db")
        status = json.loads(subprocess.run([server, "status", "--db", db, "--json"], check=True,
                                           capture_output=True, text=True).stdout)
        with sparrow.ServerRun(db) as run:
            self.assertEqual(run.info()["run_id"], status["run_id"])
            self.assertEqual(run.completed_rounds, status["completed_rounds"])
            rounds = run.rounds()
            self.assertEqual(list(rounds["round"]), [r["round"] for r in status["rounds"]])
            self.assertEqual(list(rounds["bytes_in"]), [r["bytes_in"] for r in status["rounds"]])
            self.assertEqual(sorted(c["client_id"] for c in run.clients()),
                             sorted(c["client_id"] for c in status["clients"]))
            for k, v in status["latest_metrics"].items():
                self.assertAlmostEqual(run.metrics()[k], v, places=6)
            model, rnd = run.model()
            self.assertEqual(rnd, 2)
            out = self.path("export")
            subprocess.run([server, "export", "--db", db, "--out", out], check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
            for name, t in model.items():
                self.assertTrue(np.array_equal(np.load(os.path.join(out, "weights", name + ".npy")), t.numpy()), name)

    def test_refusals(self):
        with self.assertRaises(sparrow.ConfigError):
            sparrow.ServerRun(self.path("missing.db"))
        junk = self.path("junk.db")
        with open(junk, "wb") as f:
            f.write(b"not a database" * 100)
        with self.assertRaises(sparrow.FormatError):
            sparrow.ServerRun(junk)


if __name__ == "__main__":
    unittest.main()
