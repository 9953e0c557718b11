"""The compression library from Python: codecs with caller-owned state, and the
aggregating side (CodecServer) that gives ACP and tcs the shared state their
clients need, made as the simulator makes it."""

import math

from . import _sparrow

CodecContext = _sparrow.CodecContext


class Codec:
    """A codec of the compression library, built from its spec ("dgc:ratio=0.001").

    ``encode(tensor, state=None)`` returns ``(bytes, state)``: the tensor as the
    wire carries it (one verified message; ``len(bytes)`` is what it costs)
    and the codec's state after this step (residuals, momentum), which you
    pass to the next encode of the same tensor. The state passed in is not
    changed. ``decode(bytes)`` gives the tensor back.

    ACP and tcs encode against shared state the aggregator broadcasts: pass
    ``shared=`` (ACP's factor) or ``mask=`` (tcs's positions) yourself, or
    ``context=`` a ``CodecContext`` from ``CodecServer.open``, and decode with
    the same.
    """

    def __init__(self, spec, seed=0):
        self._codec = _sparrow._Codec(spec, seed)
        self._seed = seed

    @property
    def spec(self):
        return self._codec.spec

    @property
    def method(self):
        return self._codec.method

    def _context(self, context, round, workers, name, shared, mask):
        if context is None:
            return CodecContext(name=name, seed=self._seed, round=round, workers=workers, shared=shared, mask=mask)
        if shared is not None or mask is not None or round != -1 or workers != 1 or name != "x":
            raise TypeError("context= holds the round, workers, name, shared factor and mask: pass it alone")
        if not isinstance(context, CodecContext):
            raise TypeError(f"context: a sparrow.CodecContext, got {type(context).__name__}")
        return context

    def encode(self, tensor, state=None, round=-1, workers=1, name="x", shared=None, mask=None, context=None):
        """``(bytes, state)``: ``tensor`` encoded with ``state`` (None: a fresh one).

        ``round`` (ACP picks P or Q by its parity; -1: the state's step),
        ``workers`` (DGC's clipping), ``name`` (keys the tensor's random
        streams), ``shared`` (ACP: the shared factor of this round), ``mask``
        (tcs: the round's mask, ascending int64 positions), or ``context=``
        a CodecContext holding all of them."""
        ctx = self._context(context, round, workers, name, shared, mask)
        return self._codec.encode(tensor, state, ctx)

    def decode(self, data, shape_or_like=None, shared=None, mask=None, round=-1, name="x", context=None):
        """The tensor in ``data``. ACP's factor and a tcs update with a mask decode
        only with the encode's ``shared``/``mask`` and round (or its ``context``)."""
        if context is None and (shared is not None or mask is not None):
            context = CodecContext(name=name, seed=self._seed, round=round, shared=shared, mask=mask)
        return decode(data, shape_or_like, self._seed, context)

    def __repr__(self):
        return f"sparrow.codec({self.spec!r})"


def codec(spec, seed=0):
    """A Codec for ``spec`` ("topk:ratio=0.01", "qsgd:bits=4", ...); ConfigError for an unknown one."""
    return Codec(spec, seed)


def decode(data, shape_or_like=None, seed=0, context=None):
    """The tensor in ``data`` (any codec's bytes: the format says how to decode).

    ``shape_or_like`` (a shape or a tensor) checks the shape and gives the result
    that shape; ``context`` (a CodecContext) decodes ACP's factor or a masked tcs
    update."""
    t = _sparrow._decode(bytes(data), context, seed)
    if shape_or_like is None:
        return t
    shape = tuple(shape_or_like.shape) if hasattr(shape_or_like, "shape") else tuple(shape_or_like)
    if t.numel() != math.prod(shape):
        raise _sparrow.FormatError(f"decode: the bytes hold {t.numel()} values, not a tensor of shape {shape}")
    return t.reshape(shape)


class CodecServer:
    """The aggregating side of a codec, as the simulator runs it: the global model,
    each round's codec contexts (ACP's shared factor, tcs's mask), the fold of the
    clients' updates in canonical id order, the global step, and the shared state
    of the next round made from that step.

        server = sparrow.CodecServer("acp:rank=4", weights, seed=7)
        ctx = server.open(1, ["0", "1"])                 # {tensor name: CodecContext}
        for cid, delta in updates.items():               # your clients
            msgs = [codec.encode(delta[n], states[cid][n], context=ctx[n].for_client(cid))
                    for n in ctx]                        # keep each new state
            server.add(cid, [m for m, _ in msgs], weight=samples[cid])
        aggregate = server.step()                        # weights, factors, masks move on

    ``weights``: {name: tensor} (the model; its names in sorted order are the
    model's order). ``server_optimizer`` and ``aggregator`` are the config keys
    (ACP needs the plain ``mean``).
    """

    def __init__(self, spec, weights, seed=0, server_optimizer="fedavg", aggregator="mean"):
        self.spec = spec
        self._server = _sparrow._CodecServer(spec, dict(weights), seed, server_optimizer, aggregator)

    def open(self, round, clients):
        """Starts round ``round`` (1-based) for ``clients`` (ids); their contexts by tensor name.

        A client encodes with ``ctx[name].for_client(client_id)`` (its task's seed,
        as the simulator's clients) or ``ctx[name]`` itself."""
        return self._server.open(round, [str(c) for c in clients])

    def add(self, client, messages, weight=1.0):
        """Folds ``client``'s update: one ``Codec.encode`` message per tensor, weighted by ``weight``."""
        self._server.add(str(client), list(messages), float(weight))

    def step(self):
        """Ends the round: the aggregate {name: tensor}; the weights, ACP's factors and the
        tcs masks are then the next round's."""
        return self._server.step()

    @property
    def weights(self):
        """The global model {name: tensor} (copies)."""
        return self._server.weights()

    @property
    def factors(self):
        """ACP's shared factors for the next round {name: tensor}."""
        return self._server.factors()

    @property
    def masks(self):
        """tcs's masks for the next round {name: int64 positions}."""
        return self._server.masks()

    def shared_bytes(self):
        """The shared state as a checkpoint stores it (b"" when none)."""
        return self._server.shared_bytes()
