"""The Python layer over _sparrow: Simulation, ServerRun and the hooks.

numpy (and torch, through the extension) are imported by the calls that need
them, not by ``import sparrow``: a run started from Python costs what the same
run costs from sparrow-sim (docs/python.md, "Cost")."""

import os
from collections import namedtuple

from . import _config, _sparrow

# What a Python aggregation rule gets for one round (fn(round, updates)):
#   rows          one float32 torch.Tensor [d] per update: the client's model
#                 delta, decoded, its tensors flattened in the model's parameter order (already
#                 scaled down to a norm bound when the run has one)
#   weights       each update's sample weight (list of float)
#   norms         each update's L2 norm before any clipping (list of float)
#   total_weight  sum of the weights
#   client_ids    each update's client id (str), the row's sender
# Rows are in canonical client-id order (the order the built-in rules see).
Updates = namedtuple("Updates", ["rows", "weights", "norms", "total_weight", "client_ids"])

# Columns of Simulation.metrics() and their dtypes (metrics.csv's figures).
_COLUMNS = {
    "round": "int64", "accuracy": "float64", "loss": "float64", "train_loss": "float64",
    "bytes_up": "uint64", "bytes_down": "uint64", "sim_round_s": "float64", "real_s": "float64",
    "clients": "int64", "dropped": "int64", "abandoned": "bool", "samples": "int64",
    "eval_s": "float64", "epsilon": "float64", "clip": "float64",
}


def _table(rows, columns):
    """A pandas DataFrame when pandas imports, else a dict of numpy arrays."""
    import numpy as np

    data = {c: np.array([r[c] for r in rows], dtype=t) for c, t in columns.items()}
    try:
        import pandas
    except ImportError:
        return data
    return pandas.DataFrame(data)


class Simulation:
    """A simulated federated run, as ``sparrow-sim`` runs it.

    ``config``: a dict of config keys (docs/configuration.md) or the path of a
    TOML file; ``overrides`` are applied after it as ``--set key=value`` is.
    ``resume=True`` continues the run folder ``config`` names (a path to the
    folder, as ``sparrow-sim --resume``); ``force=True`` starts afresh in a
    folder that already holds a run. ``http="127.0.0.1:8080"`` serves the live
    dashboard while the object lives (``http_token``: the token file needed
    off loopback).

    With a config dict, ``data=(x, y)`` (numpy arrays or tensors: samples
    ``[N, ...]``, integer labels ``[N]``) and ``test_data=(x, y)`` are your
    data set, and ``model=`` may be a ``torch.nn.Module`` (scripted for you);
    both are written into ``<out>/inputs/`` and checked before the first round.
    """

    def __init__(self, config, resume=False, force=False, http="", http_token="", data=None, test_data=None,
                 **overrides):
        sets = _config.to_overrides(overrides)
        if isinstance(config, dict):
            if resume:
                raise TypeError("resume=True takes the run folder's path, not a dict")
            merged = dict(config)
            for key, v in overrides.items():
                if isinstance(v, dict) and isinstance(merged.get(key), dict):
                    merged[key] = {**merged[key], **v}
                else:
                    merged[key] = v
            _inputs(merged, data, test_data, force)
            source, is_path, sets = _config.to_toml(merged), False, []
        elif isinstance(config, (str, os.PathLike)):
            if data is not None or test_data is not None or not isinstance(overrides.get("model", ""), str):
                raise TypeError("data=, test_data= and a torch.nn.Module model= need a config dict")
            source, is_path = os.fspath(config), True
        else:
            raise TypeError(f"config: a dict or a TOML file's path, got {type(config).__name__}")
        self._names = None  # a torchscript model's parameter names (model())
        self._sim = _sparrow._Simulation(source, is_path, sets, bool(resume), bool(force), http, http_token)

    @classmethod
    def resume(cls, out_dir, **overrides):
        """Continues the run in ``out_dir`` after its last checkpoint (``rounds=N`` extends it)."""
        return cls(os.fspath(out_dir), resume=True, **overrides)

    # -- running -------------------------------------------------------------
    def run_round(self):
        """Runs the next round; its metrics as a dict (``participants``: the ids aggregated)."""
        return self._sim.run_round()

    def rounds(self):
        """Yields each remaining round's metrics as it completes."""
        while not self._sim.done():
            yield self._sim.run_round()

    def run(self, progress=None):
        """Runs the remaining rounds (``progress(metrics)`` after each); returns summary()."""
        for m in self.rounds():
            if progress is not None:
                progress(m)
        return self.summary()

    def checkpoint(self):
        """Checkpoints the last completed round now (a run also does every checkpoint_every rounds)."""
        self._sim.checkpoint()

    def close(self):
        """Closes the run folder now (its databases stay locked while the object lives)."""
        self._sim.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    # -- inspecting ----------------------------------------------------------
    @property
    def done(self):
        return self._sim.done()

    @property
    def completed_rounds(self):
        return self._sim.completed_rounds()

    @property
    def total_rounds(self):
        return self._sim.total_rounds()

    @property
    def out(self):
        """The run folder (config.toml, metrics.csv, run.db, client_state.db)."""
        return self._sim.out()

    @property
    def url(self):
        """The dashboard's address ("" without ``http=``)."""
        return self._sim.url()

    def config(self):
        """The complete effective config as TOML text (what config.toml holds)."""
        return self._sim.config_toml()

    def model(self):
        """The global model: {parameter name: torch.Tensor} (copies), named as the module names
        them (a torchscript model's ``fc1.weight``, which the C++ side calls ``fc1_weight``)."""
        weights = self._sim.model()
        name = self._sim.model_name()
        if not name.startswith("torchscript:"):
            return weights
        if self._names is None:
            import torch

            self._names = {n.replace(".", "_"): n for n, _ in torch.jit.load(name[len("torchscript:"):]).named_parameters()}
        return {self._names.get(k, k): v for k, v in weights.items()}

    def module(self):
        """The global model as a ``torch.jit`` module (the model.pt ``sparrow-sim export`` writes)."""
        return _module(self._sim.model_name(), self._sim.model())

    def metrics(self):
        """Every completed round's figures: a pandas DataFrame, or a dict of numpy arrays."""
        return _table(self._sim.history(), _COLUMNS)

    def history(self):
        """Every completed round's metrics, as run_round() returns them."""
        return self._sim.history()

    def summary(self):
        """Totals: rounds, last accuracy and loss, bytes up and down, simulated and real seconds."""
        return self._sim.summary()

    def selection(self, round):
        """The client ids round ``round`` (1-based) trains."""
        return self._sim.selection(round)


def _save_arrays(folder, xy, what):
    import numpy as np

    try:
        x, y = xy
    except (TypeError, ValueError):
        raise TypeError(f"{what}: a pair (x, y) of arrays or tensors") from None
    x = x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)
    y = y.detach().cpu().numpy() if hasattr(y, "detach") else np.asarray(y)
    if len(x) != len(y):
        raise sparrow_config_error(f"{what}: x has {len(x)} samples but y has {len(y)}")
    if not np.issubdtype(y.dtype, np.integer):
        raise sparrow_config_error(f"{what}: y must hold integer class labels, not {y.dtype}")
    os.makedirs(folder, exist_ok=True)
    np.save(os.path.join(folder, "x.npy"), np.ascontiguousarray(x, dtype=np.float32))
    np.save(os.path.join(folder, "y.npy"), np.ascontiguousarray(y, dtype=np.int64))


def sparrow_config_error(text):
    return _sparrow.ConfigError(text)


def _inputs(cfg, data, test_data, force):
    """Your arrays and your torch.nn.Module as the files the simulator reads, in <out>/inputs/.

    They are written into the run folder so that resume finds them again. A
    folder that already holds a run is left alone (the simulator refuses it
    unless force=True)."""
    module = cfg.get("model")
    if data is None and test_data is None and (module is None or isinstance(module, str)):
        return
    if test_data is not None and data is None:
        raise TypeError("test_data= needs data=")
    out = os.path.abspath(os.fspath(cfg.get("out", "runs/default")))
    inputs = os.path.join(out, "inputs")
    write = force or not os.path.exists(os.path.join(out, "run.db"))
    if data is not None:
        if write:
            _save_arrays(inputs, data, "data")
            if test_data is not None:
                _save_arrays(os.path.join(inputs, "test"), test_data, "test_data")
        cfg["dataset"] = "folder:" + inputs
    if module is not None and not isinstance(module, str):
        import torch

        path = os.path.join(inputs, "model.pt")
        if write:
            if not isinstance(module, torch.jit.ScriptModule):
                try:
                    module = torch.jit.script(module)
                except Exception as e:  # TorchScript's own error type varies by version
                    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                    raise sparrow_config_error(f"model: torch.jit.script cannot compile {type(module).__name__}: "
                                               f"{first}") from e
            os.makedirs(inputs, exist_ok=True)
            module.save(path)
        cfg["model"] = "torchscript:" + path


def _module(model_name, weights):
    import tempfile

    import torch

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.pt")
        _sparrow._save_torchscript(model_name, weights, path)
        return torch.jit.load(path)


def load_run_model(run_dir):
    """A run folder's last checkpointed global model: ({name: torch.Tensor}, round)."""
    return _sparrow.load_run_model(os.fspath(run_dir))


class ServerRun:
    """A sparrow-server database opened read-only, as ``sparrow-server status`` and ``export`` read it."""

    def __init__(self, db_path):
        self._run = _sparrow._ServerRun(os.fspath(db_path))

    def info(self):
        """The run's row: run_id, config_hash, config (TOML), created; None for an empty database."""
        return self._run.run()

    def rounds(self):
        """One row per completed round: a DataFrame, or a dict of numpy arrays without pandas."""
        rows = self._run.rounds()
        cols = {"round": "int64", "started": "float64", "finished": "float64", "seconds": "float64",
                "selected": "int64", "updates": "int64", "rejected": "int64", "stale": "int64",
                "bytes_in": "uint64", "bytes_out": "uint64", "train_loss": "float64",
                "eval_loss": "float64", "eval_accuracy": "float64"}
        return _table(rows, cols)

    def clients(self):
        """Every client the server has seen, as a list of dicts."""
        return self._run.clients()

    def metrics(self, round=None):
        """The named figures of ``round`` (default: the last completed one)."""
        return self._run.metrics(self._run.completed_rounds() if round is None else round)

    @property
    def completed_rounds(self):
        return self._run.completed_rounds()

    @property
    def model_name(self):
        return self._run.model_name()

    def model(self):
        """The newest intact checkpoint's global model: ({name: torch.Tensor}, round)."""
        return self._run.model()

    def module(self):
        """The newest checkpoint's model as a ``torch.jit`` module (``sparrow-server export``'s model.pt)."""
        return _module(self.model_name, self.model()[0])

    def close(self):
        self._run.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def register_aggregator(name, fn=None, description=""):
    """Makes ``fn(round, updates) -> aggregate`` the aggregation rule ``aggregator = "name"``.

    ``updates`` is an ``Updates`` (rows, weights, norms, total_weight, client_ids); the
    result is the round's aggregate delta, a float32 torch.Tensor or numpy
    array with the rows' length. Registering a name again replaces its
    function; a built-in name is refused (sparrow.Error). Usable as a decorator
    without ``fn``: ``@sparrow.register_aggregator("mymedian")``.
    """
    if fn is None:
        return lambda f: register_aggregator(name, f, description) or f
    return _sparrow.register_aggregator(name, fn, description)


def register_sampler(name, fn=None, description=""):
    """Makes ``fn(round, candidates, k) -> ids`` the selection rule ``sampler = "name"``.

    ``candidates``: the ids (str) of the clients that can take part this round
    (1-based), in id order; return at most ``k`` of them (str or int).
    Registering a name again replaces its function. Usable as a decorator.
    """
    if fn is None:
        return lambda f: register_sampler(name, f, description) or f
    return _sparrow.register_sampler(name, fn, description)


def register_server_optimizer(name, fn=None, slots=(), description=""):
    """Makes ``fn`` the server optimiser ``server_optimizer = "name"``: the global model's step.

    ``fn(round, weights, aggregate)`` (``fn(round, weights, aggregate, state)``
    with ``slots``) gets the global model and the round's aggregate (the mean
    update, what the built-in ``fedavg`` adds), both ``{name: float32
    torch.Tensor}`` copies, and returns the new weights ``{name: tensor or
    numpy array}``, every tensor of the model. ``slots=("m", "v")``: the
    per-tensor tensors the optimiser keeps between rounds, in
    ``state[name][slot]`` (empty dicts before the first step): set every slot
    of every tensor, with the weight's shape. They are the optimiser's state
    that checkpoints save and a resume restores; without ``slots`` the
    function is stateless (Python variables it keeps are not checkpointed).
    Registering a name again replaces its function; a built-in name is
    refused (sparrow.Error). Usable as a decorator.
    """
    if fn is None:
        return lambda f: register_server_optimizer(name, f, slots, description) or f
    if isinstance(slots, str):
        slots = (slots,)
    return _sparrow.register_server_optimizer(name, fn, list(slots), description)
