"""Sparrow from Python, notebook style: run a simulation, look at it, try your own rule.

    PYTHONPATH=build/python python3 examples/python/quickstart.py [OUT_DIR]

(or `cmake --install build` and a plain `import sparrow`). About 20 s on 2 cores.
Each block below is a notebook cell.
"""

import os
import sys

import numpy as np
import torch

import sparrow

out = sys.argv[1] if len(sys.argv) > 1 else "runs/python-quickstart"

# 1. A simulation from a dict: the same keys and checks as a TOML file
#    (docs/configuration.md). 100 Fashion-MNIST clients, 10 a round, an MLP.
config = {
    "dataset": "fashion-mnist", "partition": "dirichlet:alpha=0.5", "model": "mlp",
    "clients": 100, "clients_per_round": 10, "rounds": 5, "eval_every": 1, "seed": 1,
    "out": os.path.join(out, "fedavg"),
}
sim = sparrow.Simulation(config, force=True)
for m in sim.rounds():  # one round at a time; Ctrl-C stops at the next safe point
    print(f"round {m['round']}: accuracy {m['accuracy']:.3f}, train loss {m['train_loss']:.3f}, "
          f"{m['bytes_up']} bytes up")
metrics = sim.metrics()  # a pandas DataFrame when pandas is installed, else numpy arrays
weights = sim.model()  # {"fc1.weight": torch.Tensor, ...}
print("parameters:", sum(t.numel() for t in weights.values()))


# 2. Your own aggregation rule: a coordinate-wise trimmed mean in numpy. It gets the
#    round's updates decoded (one flat float32 row per client, with its weight).
@sparrow.register_aggregator("my_trimmed_mean")
def my_trimmed_mean(round, updates):
    x = np.sort(np.stack([r.numpy() for r in updates.rows]), axis=0)
    return x[1:-1].mean(axis=0)  # drop the lowest and highest value per coordinate


# 3. Your own client selection: the first k available clients, in turn.
@sparrow.register_sampler("round_robin")
def round_robin(round, candidates, k):
    start = ((round - 1) * k) % len(candidates)
    return (candidates[start:] + candidates[:start])[:k]


# 4. Your own server step: server momentum (FedAvgM), its momentum kept per tensor in
#    `state`, which checkpoints save and a resume restores.
@sparrow.register_server_optimizer("my_momentum", slots=("m",))
def my_momentum(round, weights, aggregate, state):
    for name, w in weights.items():
        m = state[name].get("m", torch.zeros_like(w)).mul_(0.5).add_(aggregate[name])
        state[name]["m"] = m
        w += m
    return weights


robust = sparrow.Simulation(dict(config, aggregator="my_trimmed_mean", sampler="round_robin",
                                 server_optimizer="my_momentum", compression="topk:ratio=0.05",
                                 out=os.path.join(out, "robust")), force=True)
robust.run()
print("trimmed mean + round robin + momentum + top-5%:", f"accuracy {robust.summary()['accuracy']:.3f},",
      f"{int(np.sum(robust.metrics()['bytes_up']))} bytes up in all")

# 5. A codec on its own: what DGC sends for a tensor, and what arrives.
codec = sparrow.codec("dgc:ratio=0.01")
grad = torch.randn(200, 784)
data, state = codec.encode(grad)  # keep `state` (DGC's residual) for the next step
back = codec.decode(data, grad)
print(f"dgc: {grad.numel() * 4} bytes -> {len(data)}; {int((back != 0).sum())} values sent")

# 6. ACP needs the aggregator's shared factor: CodecServer plays the aggregator as the
#    simulator does (two clients, two rounds; ACP alternates which factor travels).
acp = sparrow.codec("acp:rank=4")
server = sparrow.CodecServer("acp:rank=4", {"w": torch.zeros(200, 784)}, seed=1)
states = {"a": None, "b": None}
for r in (1, 2):
    ctx = server.open(r, list(states))
    for cid in states:
        data, states[cid] = acp.encode(torch.randn(200, 784), states[cid], context=ctx["w"].for_client(cid))
        server.add(cid, [data], weight=1.0)
    server.step()
    print(f"acp round {r}: {len(data)} bytes a client, shared factor {tuple(server.factors['w'].shape)}")

# 7. The trained model as TorchScript, for use anywhere.
net = sim.module()
x = torch.randn(1, 1, 28, 28)
print("logits:", net(x).detach().numpy().round(2))
