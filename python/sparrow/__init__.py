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

# Neither torch nor numpy is imported here: the extension links LibTorch's C++
# libraries (as sparrow-sim does) and imports the `torch` package the first time
# a tensor crosses to Python (model(), codecs, hooks), so a run started from
# Python pays no more than the same run from sparrow-sim.
from . import _sparrow
from ._sparrow import (  # noqa: F401
    CodecContext,
    CodecState,
    ConfigError,
    Error,
    FormatError,
    aggregator_names,
    codec_names,
    sampler_names,
    server_optimizer_names,
    set_log_level,
)
# Shown as sparrow.ConfigError in tracebacks, the name users catch.
for _cls in (Error, ConfigError, FormatError, CodecState, CodecContext):
    _cls.__module__ = "sparrow"
del _cls

from ._codec import Codec, CodecServer, codec, decode  # noqa: F401
from ._simulation import (  # noqa: F401
    ServerRun,
    Simulation,
    Updates,
    load_run_model,
    register_aggregator,
    register_sampler,
    register_server_optimizer,
)

__all__ = [
    "Simulation", "ServerRun", "Updates", "Codec", "CodecContext", "CodecServer", "CodecState", "codec",
    "decode", "load_run_model", "register_aggregator", "register_sampler", "register_server_optimizer",
    "aggregator_names", "sampler_names", "server_optimizer_names", "codec_names", "set_log_level", "Error",
    "ConfigError", "FormatError",
]
