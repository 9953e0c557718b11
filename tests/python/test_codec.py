"""sparrow.codec: the compression library's encode/decode with caller-owned state."""

import os
import sqlite3
import subprocess
import sys
import unittest

import numpy as np
import torch

from support import ScratchTest, sparrow, tiny

ROWS = {}


@sparrow.register_aggregator("py_capture")
def py_capture(round, updates):
    """The built-in mean, keeping each client's decoded update (uncompressed: the exact delta)."""
    for cid, row, w in zip(updates.client_ids, updates.rows, updates.weights):
        ROWS[cid] = (row.clone(), w)
    return sum(w * r.double() for r, w in zip(updates.rows, updates.weights)) / updates.total_weight


class CodecTest(unittest.TestCase):
    def test_dense_round_trip_is_exact(self):
        x = torch.randn(3, 7)
        data, state = sparrow.codec("none").encode(x)
        self.assertIsInstance(data, bytes)
        y = sparrow.decode(data, x)
        self.assertEqual(tuple(y.shape), (3, 7))
        self.assertTrue(bool((y == x).all()))
        self.assertEqual(state.step, 1)

    def test_topk_keeps_the_largest(self):
        torch.manual_seed(0)
        x = torch.randn(1000)
        c = sparrow.codec("topk:ratio=0.01")
        data, _ = c.encode(x)
        y = c.decode(data, (1000,))
        kept = torch.nonzero(y).flatten()
        self.assertEqual(len(kept), 10)
        self.assertEqual(set(kept.tolist()), set(x.abs().topk(10).indices.tolist()))
        self.assertTrue(bool((y[kept] == x[kept]).all()))
        self.assertLess(len(data), 1000 * 4 // 10)  # far fewer bytes than the dense tensor

    def test_numpy_input(self):
        x = np.arange(12, dtype=np.float32).reshape(3, 4)
        data, _ = sparrow.codec("fp16").encode(x)
        self.assertTrue(np.array_equal(sparrow.decode(data).numpy(), x))

    def test_state_is_carried_and_not_changed_in_place(self):
        x = torch.randn(20, 25)  # DGC sends 1-D tensors (biases) dense, without state
        c = sparrow.codec("dgc:ratio=0.01")
        d1, s1 = c.encode(x)
        snapshot = {k: v.clone() for k, v in s1.tensors.items()}
        self.assertTrue(snapshot)  # DGC keeps a residual
        d2, s2 = c.encode(x, s1)
        self.assertEqual((s1.step, s2.step), (1, 2))
        for k, v in s1.tensors.items():
            self.assertTrue(bool((v == snapshot[k]).all()), k)
        # The residual makes the second encoding differ from a fresh one.
        fresh, _ = c.encode(x)
        self.assertNotEqual(d2, fresh)
        # A state restored from bytes encodes exactly as the original.
        restored = sparrow.CodecState.from_bytes(s1.to_bytes())
        self.assertEqual(c.encode(x, restored)[0], d2)

    def test_errors(self):
        with self.assertRaisesRegex(sparrow.ConfigError, "unknown compression method 'nope'"):
            sparrow.codec("nope")
        with self.assertRaises(sparrow.ConfigError):
            sparrow.codec("topk:ratoi=0.1")
        with self.assertRaises(sparrow.FormatError):
            sparrow.decode(b"not an update")
        data, _ = sparrow.codec("none").encode(torch.zeros(4))
        with self.assertRaises(sparrow.FormatError):
            sparrow.decode(data, (5,))
        with self.assertRaises(TypeError):
            sparrow.codec("none").encode("text")


class SharedStateTest(ScratchTest):
    """ACP and tcs from Python: a two-client round played with Codec and CodecServer
    gives the simulator's bytes: the same model and the same shared state for the next round."""

    def round_from_python(self, spec):
        # The clients' exact updates of round 1: a run without compression, same seed.
        ROWS.clear()
        sparrow.Simulation(tiny(self.path("plain"), aggregator="py_capture", rounds=1,
                                clients_per_round=2)).run()
        self.assertEqual(len(ROWS), 2)
        # The simulator's round 1 with the codec, and the checkpoint of what comes next.
        sim = sparrow.Simulation(tiny(self.path("sim"), compression=spec, rounds=1, clients_per_round=2,
                                      checkpoint_every=1))
        start = sim.model()
        sim.run()
        after = sim.model()
        sim.close()
        with sqlite3.connect(os.path.join(self.path("sim"), "client_state.db")) as db:
            shared = db.execute("SELECT value FROM meta WHERE key = 'checkpoint.acp'").fetchone()[0]
        # The same round from Python.
        codec = sparrow.codec(spec)
        server = sparrow.CodecServer(spec, start, seed=7)
        ctx = server.open(1, list(ROWS))
        names = ["fc.weight", "fc.bias"]  # the rows' layout: the model's parameter order
        for cid, (row, weight) in ROWS.items():
            parts = torch.split(row, [start[n].numel() for n in names])
            msgs = [codec.encode(p.reshape(start[n].shape), context=ctx[n].for_client(cid))[0]
                    for n, p in zip(names, parts)]
            server.add(cid, msgs, weight)
        aggregate = server.step()
        self.assertSameModel(server.weights, after)
        self.assertEqual(server.shared_bytes(), bytes(shared))
        self.assertFalse(bool((aggregate["fc.weight"] == 0).all()))
        return server, codec

    def test_acp(self):
        server, codec = self.round_from_python("acp:rank=2")
        factors = server.factors
        self.assertEqual(sorted(factors), ["fc.weight"])  # the bias travels dense
        f = factors["fc.weight"]  # round 1 sent Q; round 2's shared factor is Q̂ (cols × r), orthonormal
        self.assertEqual(tuple(f.shape), (60, 2))
        self.assertTrue(torch.allclose(f.t() @ f, torch.eye(2), atol=1e-5))
        # Round 2's clients send the other factor against it; decoding needs the same context.
        ctx = server.open(2, ["0", "1"])["fc.weight"]
        self.assertTrue(bool((ctx.shared == f).all()))
        x = torch.randn(10, 60)
        data, _ = codec.encode(x, context=ctx)
        y = codec.decode(data, x, context=ctx)
        self.assertTrue(torch.allclose(y, (x @ f) @ f.t(), atol=1e-5))  # P = x·Q̂ sent, P·Q̂ᵀ decoded
        self.assertLess(len(data), 600)  # a 10 × 2 factor, not the 600 values

    def test_tcs(self):
        server, codec = self.round_from_python("tcs:ratio=0.1")
        masks = server.masks
        self.assertEqual(sorted(masks), ["fc.bias", "fc.weight"])
        # At most ceil(0.1 · 600) positions, where round 1's step was nonzero.
        self.assertTrue(0 < masks["fc.weight"].numel() <= 60)
        # Round 2: the values at the mask (no index bits); decoding needs the mask.
        ctx = server.open(2, ["0", "1"])
        x = torch.randn(10, 60)
        masked, _ = codec.encode(x, context=ctx["fc.weight"])
        with self.assertRaises(sparrow.FormatError):
            codec.decode(masked, x)
        y = codec.decode(masked, x, context=ctx["fc.weight"])
        m = masks["fc.weight"]
        self.assertTrue(torch.allclose(y.flatten()[m], x.flatten()[m], rtol=0.02, atol=0.05))  # int8 values
        # mask= alone (positions you keep yourself) encodes the same bytes.
        again, _ = codec.encode(x, name="fc.weight", round=2, workers=2, mask=m)
        self.assertEqual(again, masked)

    def test_misuse(self):
        server = sparrow.CodecServer("acp:rank=2", {"w": torch.zeros(8, 8)})
        with self.assertRaisesRegex(sparrow.Error, "no round is open"):
            server.step()
        ctx = server.open(1, ["a"])
        with self.assertRaisesRegex(sparrow.Error, "'b' is not in this round"):
            server.add("b", [sparrow.codec("acp:rank=2").encode(torch.ones(8, 8), context=ctx["w"])[0]])
        with self.assertRaises(TypeError):
            sparrow.codec("acp:rank=2").encode(torch.ones(8, 8), round=1, context=ctx["w"])
        with self.assertRaises(sparrow.ConfigError):
            sparrow.CodecServer("acp:rank=2", {"w": torch.zeros(8, 8)}, aggregator="median")


class PackageTest(unittest.TestCase):
    def test_one_libtorch_in_the_process(self):
        # The extension links the LibTorch that torch._C uses: one copy of each library is loaded,
        # so a tensor is the same object on both sides.
        with open("/proc/self/maps") as f:
            paths = {os.path.realpath(line.split()[-1]) for line in f if "libtorch_cpu" in line or "libc10." in line}
        names = sorted(os.path.basename(p) for p in paths)
        self.assertEqual(len(names), len(set(n.split(".so")[0] for n in names)), names)
        self.assertTrue(any("libtorch_cpu" in n for n in names))

    def test_import_leaves_torch_out_until_a_tensor_crosses(self):
        # A run from Python costs what sparrow-sim costs: torch's Python modules (most of a
        # second) are imported by the first call that hands a tensor over, not by `import sparrow`.
        code = ("import os, sys, tempfile, sparrow\n"
                "seen = lambda: [m for m in ('torch', 'numpy', 'pandas') if m in sys.modules]\n"
                "print(seen())\n"
                "out = os.path.join(tempfile.mkdtemp(prefix='sparrow_py_'), 'run')\n"
                "sim = sparrow.Simulation({'dataset': 'synthetic:alpha=1,beta=1', 'model': 'logreg', 'rounds': 2,"
                " 'clients': 6, 'clients_per_round': 3, 'out': out})\n"
                "sim.run(); print(seen())\n"
                "sim.model(); print(seen())\n"
                "sim.close(); import shutil; shutil.rmtree(os.path.dirname(out))\n")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        self.assertEqual(r.stdout.split("\n")[:3], ["[]", "[]", "['torch', 'numpy']"])

    def test_errors_are_named_in_the_package(self):
        self.assertEqual(sparrow.ConfigError.__module__, "sparrow")
        self.assertTrue(issubclass(sparrow.FormatError, sparrow.Error))
        self.assertTrue(issubclass(sparrow.Error, RuntimeError))


if __name__ == "__main__":
    unittest.main()
