"""Sparrow from Python: simulations, codecs, a server's database and your own
aggregation rule or client selector, over the C++ libraries (docs/python.md).

    import sparrow
    sim = sparrow.Simulation({"dataset": "synthetic:alpha=1,beta=1", "model": "logreg",
                              "rounds": 5, "clients": 20, "clients_per_round": 5,
                              "out": "runs/quick"})
    for m in sim.rounds():
        print(m["round"], m["train_loss"])
    sim.metrics()          # a pandas DataFrame (a dict of numpy arrays without pandas)
    sim.model()            # {name: torch.Tensor}
"""

# torch first: the extension's tensors are torch's own (libtorch_python), so
# its types must be registered before a tensor crosses.
import torch  # noqa: F401

from . import _sparrow
from ._sparrow import (  # noqa: F401
    CodecState,
    ConfigError,
    Error,
    FormatError,
    aggregator_names,
    codec_names,
    sampler_names,
    set_log_level,
)
# Shown as sparrow.ConfigError in tracebacks, the name users catch.
for _cls in (Error, ConfigError, FormatError, CodecState):
    _cls.__module__ = "sparrow"
del _cls

from ._simulation import (  # noqa: F401
    Codec,
    ServerRun,
    Simulation,
    Updates,
    codec,
    decode,
    load_run_model,
    register_aggregator,
    register_sampler,
)

__all__ = [
    "Simulation", "ServerRun", "Updates", "Codec", "CodecState", "codec", "decode", "load_run_model",
    "register_aggregator", "register_sampler", "aggregator_names", "sampler_names", "codec_names",
    "set_log_level", "Error", "ConfigError", "FormatError",
]
