"""Python aggregation rules and client selectors in the shared round."""

import unittest

import numpy as np
import torch

from support import ScratchTest, sparrow, tiny

CALLS = []


@sparrow.register_aggregator("py_median", description="coordinate-wise median in numpy")
def py_median(round, updates):
    CALLS.append((round, len(updates.rows), list(updates.weights)))
    return np.median(np.stack([r.numpy() for r in updates.rows]), axis=0)


IDS = []


@sparrow.register_aggregator("py_median_ids")
def py_median_ids(round, updates):
    IDS.append((round, list(updates.client_ids)))
    return np.median(np.stack([r.numpy() for r in updates.rows]), axis=0)


def evens(round, candidates, k):
    return [c for c in candidates if int(c) % 2 == 0][:k]


sparrow.register_sampler("py_evens", evens)


class HooksTest(ScratchTest):
    def test_numpy_median_is_the_builtin_median(self):
        for k in (5, 4):  # odd: the middle value; even: the mean of the two middle ones
            with self.subTest(clients_per_round=k):
                CALLS.clear()
                a = sparrow.Simulation(tiny(self.path(f"builtin{k}"), aggregator="median", clients_per_round=k))
                a.run()
                b = sparrow.Simulation(tiny(self.path(f"python{k}"), aggregator="py_median", clients_per_round=k))
                b.run()
                self.assertSameModel(a.model(), b.model())
                self.assertEqual([c[0] for c in CALLS], [1, 2, 3])
                self.assertEqual([c[1] for c in CALLS], [k, k, k])
                self.assertTrue(all(w > 0 for c in CALLS for w in c[2]))
                # ... and not the mean, so the test can tell.
                c = sparrow.Simulation(tiny(self.path(f"mean{k}"), clients_per_round=k))
                c.run()
                self.assertFalse(bool((c.model()["fc.weight"] == b.model()["fc.weight"]).all()))

    def test_listed_and_replaced(self):
        self.assertIn("py_median", sparrow.aggregator_names())
        self.assertIn("py_evens", sparrow.sampler_names())
        with self.assertRaises(sparrow.Error):
            sparrow.register_aggregator("median", py_median)  # a built-in
        # A second registration replaces the function (a notebook cell run again).
        sparrow.register_aggregator("py_first", lambda r, u: u.rows[0])
        sparrow.register_aggregator("py_first", lambda r, u: torch.zeros_like(u.rows[0]))
        sim = sparrow.Simulation(tiny(self.path("zero"), aggregator="py_first", rounds=1))
        sim.run()
        self.assertEqual(float(sim.model()["fc.weight"].abs().sum()), 0.0)  # logreg starts at zero

    def test_client_ids_are_the_updates_senders(self):
        # A slow uplink and a deadline drop some of each round's selection
        # (deterministically: the bytes and bandwidths are the seed's).
        IDS.clear()
        sim = sparrow.Simulation(tiny(self.path("ids"), aggregator="py_median_ids", rounds=4, deadline_s=2.0,
                                      profiles={"uplink_mbps": 0.01, "downlink_mbps": 1000}))
        dropped = 0
        for m in sim.rounds():
            r, ids = IDS[-1]
            self.assertEqual(r, m["round"])
            self.assertEqual(ids, [str(c) for c in m["participants"]])  # the updates aggregated, in order
            self.assertTrue(set(ids) <= {str(c) for c in sim.selection(r)})
            self.assertEqual(ids, sorted(ids, key=int))  # canonical: "9" before "11"
            dropped += m["dropped"]
        self.assertGreater(dropped, 0)  # so the ids are not simply the selection
        self.assertEqual(len(IDS), 4)

    def test_sampler(self):
        sim = sparrow.Simulation(tiny(self.path("evens"), sampler="py_evens", clients_per_round=4))
        for m in sim.rounds():
            self.assertEqual(m["participants"], [0, 2, 4, 6])
        self.assertEqual(sim.selection(1), [0, 2, 4, 6])

    def test_bad_hooks_are_errors(self):
        sparrow.register_aggregator("py_short", lambda r, u: u.rows[0][:3])
        with self.assertRaisesRegex(ValueError, "returned 3 values"):
            sparrow.Simulation(tiny(self.path("short"), aggregator="py_short", rounds=1)).run()
        sparrow.register_sampler("py_stranger", lambda r, c, k: ["999"])
        with self.assertRaisesRegex(sparrow.Error, "'999', not a candidate"):
            sparrow.Simulation(tiny(self.path("stranger"), sampler="py_stranger", rounds=1)).run()

        def boom(r, u):
            raise ValueError("no aggregate today")

        sparrow.register_aggregator("py_boom", boom)
        with self.assertRaisesRegex(ValueError, "no aggregate today"):
            sparrow.Simulation(tiny(self.path("boom"), aggregator="py_boom", rounds=1)).run()


if __name__ == "__main__":
    unittest.main()
