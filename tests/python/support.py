"""Shared by the Python package's tests: a tiny synthetic run and a scratch folder per test."""

import os
import shutil
import tempfile
import unittest

import sparrow

BIN_DIR = os.environ.get("SPARROW_BIN_DIR", os.path.join(os.path.dirname(__file__), "..", "..", "build", "bin"))


def tiny(out, **keys):
    """A few-millisecond run: multinomial logistic regression on synthetic data."""
    cfg = {"dataset": "synthetic:alpha=1,beta=1", "model": "logreg", "rounds": 3, "clients": 12,
           "clients_per_round": 5, "eval_every": 1, "seed": 7, "out": out}
    cfg.update(keys)
    return cfg


class ScratchTest(unittest.TestCase):
    """Each test runs in a folder of its own (tests run in parallel)."""

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="sparrow_py_")
        self.addCleanup(shutil.rmtree, self.dir, True)

    def path(self, name):
        return os.path.join(self.dir, name)

    def assertSameModel(self, a, b):
        self.assertEqual(sorted(a), sorted(b))
        for k in a:
            self.assertTrue(bool((a[k] == b[k]).all()), f"{k} differs by {float((a[k] - b[k]).abs().max())}")


__all__ = ["sparrow", "tiny", "ScratchTest", "BIN_DIR"]
