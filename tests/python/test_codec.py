"""sparrow.codec: the compression library's encode/decode with caller-owned state."""

import os
import unittest

import numpy as np
import torch

from support import sparrow


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


class PackageTest(unittest.TestCase):
    def test_one_libtorch_in_the_process(self):
        # The extension links the LibTorch that torch._C uses: one copy of each library is loaded,
        # so a tensor is the same object on both sides.
        with open("/proc/self/maps") as f:
            paths = {os.path.realpath(line.split()[-1]) for line in f if "libtorch_cpu" in line or "libc10." in line}
        names = sorted(os.path.basename(p) for p in paths)
        self.assertEqual(len(names), len(set(n.split(".so")[0] for n in names)), names)
        self.assertTrue(any("libtorch_cpu" in n for n in names))

    def test_errors_are_named_in_the_package(self):
        self.assertEqual(sparrow.ConfigError.__module__, "sparrow")
        self.assertTrue(issubclass(sparrow.FormatError, sparrow.Error))
        self.assertTrue(issubclass(sparrow.Error, RuntimeError))


if __name__ == "__main__":
    unittest.main()
