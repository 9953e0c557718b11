"""Exported weights load into PyTorch with load_state_dict, without renaming.

Trains a user's TorchScript model (nested nn.Sequential children named 0, 1, a
BatchNorm with buffers, names with '_' and '.') and the built-in MLP for a few
rounds with sparrow-sim, exports them, and loads state_dict.pt and the .npy files
into the user's own class and into model.pt with strict load_state_dict.

    python3 export_state_dict_test.py SPARROW_SIM

Exit status 77 (CTest: skipped) when this python3 has no torch or numpy.
"""

import pathlib
import subprocess
import sys
import tempfile

try:
    import numpy as np
    import torch
except ImportError as e:
    print(f"export_state_dict_test: SKIPPED, {e} (install python3-torch)")
    sys.exit(77)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.BatchNorm1d(12), torch.nn.ReLU())
        self.fc_out = torch.nn.Linear(12, 3)

    def forward(self, x):
        return self.fc_out(self.body(x))


def run(cmd, cwd):
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"export_state_dict_test: {' '.join(cmd)} exited {p.returncode}:\n{p.stderr[-3000:]}")
    return p.stdout


def npy_weights(folder):
    return {f.name[: -len(".npy")]: torch.from_numpy(np.load(f)) for f in sorted(folder.glob("*.npy"))}


def check(cond, what):
    if not cond:
        sys.exit(f"export_state_dict_test: FAILED: {what}")


def main():
    sim = str(pathlib.Path(sys.argv[1]).resolve())
    with tempfile.TemporaryDirectory(prefix="sparrow-export-") as tmp:
        d = pathlib.Path(tmp)
        torch.manual_seed(0)
        initial = Net()
        torch.jit.script(initial).save(str(d / "net.pt"))
        rng = np.random.default_rng(1)
        for folder, n in [(d / "data", 1200), (d / "data" / "test", 300)]:
            folder.mkdir(parents=True, exist_ok=True)
            y = rng.integers(0, 3, n)
            x = rng.normal(size=(n, 8)).astype("float32") + 3 * np.eye(3, 8, dtype="float32")[y]
            np.save(folder / "x.npy", x)
            np.save(folder / "y.npy", y)
        common = ["--set", "rounds=3", "--set", "clients=10", "--set", "clients_per_round=4", "--set", "workers=1"]
        run([sim, "--config", "/dev/null", "--set", "out=user", "--set", "dataset=folder:data",
             "--set", "model=torchscript:net.pt", *common], d)
        out = run([sim, "export", "user"], d)
        check("user/export/state_dict.pt" in out, f"export does not print state_dict.pt: {out!r}")
        exp = d / "user" / "export"

        # The user's own class takes state_dict.pt as is (strict: every key, nothing else).
        net = Net()
        net.load_state_dict(torch.load(exp / "state_dict.pt"))
        changed = [k for k, v in net.state_dict().items() if not torch.equal(v, initial.state_dict()[k])]
        check(any(k.endswith("weight") for k in changed), "the exported weights are the initial ones")
        # The .npy files are the parameters under the same names; only buffers are not there.
        result = Net().load_state_dict(npy_weights(exp / "weights"), strict=False)
        check(result.unexpected_keys == [], f"unexpected .npy names {result.unexpected_keys}")
        check(set(npy_weights(exp / "weights")) == {k for k, _ in net.named_parameters()},
              f".npy names {sorted(npy_weights(exp / 'weights'))} are not the parameters' names")
        check(set(result.missing_keys) <= {k for k, _ in net.named_buffers()},
              f".npy files lack parameters: {result.missing_keys}")
        for k, v in npy_weights(exp / "weights").items():
            check(torch.equal(v, net.state_dict()[k]), f"{k}.npy differs from state_dict.pt")
        # model.pt computes what the class with those weights computes.
        x = torch.from_numpy(np.load(d / "data" / "test" / "x.npy"))
        scripted = torch.jit.load(str(exp / "model.pt")).eval()
        check(torch.allclose(scripted(x), net.eval()(x), atol=1e-6), "model.pt and Net differ")

        # A built-in model: model.pt, state_dict.pt and the .npy files agree key for key.
        run([sim, "--config", "/dev/null", "--set", "out=mlp", "--set", "model=mlp", *common], d)
        run([sim, "export", "mlp"], d)
        exp = d / "mlp" / "export"
        m = torch.jit.load(str(exp / "model.pt"))
        sd = torch.load(exp / "state_dict.pt")
        check(set(sd) == set(m.state_dict()) == set(npy_weights(exp / "weights")),
              f"keys differ: {sorted(sd)} / {sorted(m.state_dict())}")
        m.load_state_dict(npy_weights(exp / "weights"))
        check(all(torch.equal(m.state_dict()[k], v) for k, v in sd.items()), "state_dict.pt differs from model.pt")
    print("export_state_dict_test: passed")


if __name__ == "__main__":
    main()
