#!/usr/bin/env python3
"""The peer of `sparrow-bench sim`: FedAvg on Fashion-MNIST as a researcher
writes it in plain PyTorch (python3-torch from Debian). One model, clients one
after another, torch.optim.SGD, weighted averaging of the client models.

The partition comes from sparrow-bench (one line per client: its sample
indices), so both run on the same clients' data; the clients selected per round
come from the same list (one line per round: client ids), so both train on the
very same samples. Prints one JSON object on stdout.

--model user_cnn|user_resnet builds the eager model of
examples/models/user_models.py; --init FILE.pt starts it from a scripted
file's weights (the file sparrow-sim loads as model = "torchscript:FILE.pt").

Buffers (BatchNorm's running statistics): with --buffers local (the default)
only parameters are averaged and loaded into the one model before each
client, so its running statistics carry on from client to client and the
final evaluation uses those of the clients trained last; that is what
sparrow-sim does (buffers stay local to a worker's model, never aggregated).
--buffers average averages them with the parameters instead (FedAvg over the
whole state_dict, integer counters taken from the last client).
"""
import argparse
import gzip
import json
import os
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


def read_idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load(data_dir, split, mean=0.2860, std=0.3530):
    prefix = "train" if split == "train" else "t10k"
    x = read_idx(f"{data_dir}/{prefix}-images-idx3-ubyte.gz").astype(np.float32) / 255.0
    y = read_idx(f"{data_dir}/{prefix}-labels-idx1-ubyte.gz").astype(np.int64)
    x = (x - mean) / std
    return torch.from_numpy(x).unsqueeze(1).contiguous(), torch.from_numpy(y)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(784, 200)
        self.fc2 = nn.Linear(200, 200)
        self.fc3 = nn.Linear(200, 10)

    def forward(self, x):
        x = x.flatten(1)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 5, padding=2)
        self.conv2 = nn.Conv2d(32, 64, 5, padding=2)
        self.fc1 = nn.Linear(7 * 7 * 64, 512)
        self.fc2 = nn.Linear(512, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def make_model(name):
    if name == "mlp":
        return MLP()
    if name == "cnn":
        return CNN()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "models"))
    import user_models
    return user_models.MODELS[name]()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--partition", required=True, help="one line per client: sample indices")
    ap.add_argument("--selection", required=True, help="one line per round: selected client ids")
    ap.add_argument("--model", default="mlp", choices=["mlp", "cnn", "user_cnn", "user_resnet"])
    ap.add_argument("--init", help="a TorchScript file whose weights (state_dict) the model starts from")
    ap.add_argument("--buffers", default="local", choices=["local", "average"],
                    help="buffers (BatchNorm running statistics): kept in the one model as sparrow-sim does, "
                         "or averaged with the parameters")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--warmup-rounds", type=int, default=0,
                    help="rounds trained before the clock starts (on a GPU: cuDNN's algorithm search)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    dev = torch.device(args.device)
    x_train, y_train = load(args.data, "train")
    x_test, y_test = load(args.data, "test")
    x_train, y_train = x_train.to(dev), y_train.to(dev)
    with open(args.partition) as f:
        parts = [torch.tensor([int(v) for v in line.split()], dtype=torch.long) for line in f]
    with open(args.selection) as f:
        rounds = [[int(v) for v in line.split()] for line in f if line.strip()]

    model = make_model(args.model)
    if args.init:
        model.load_state_dict(torch.jit.load(args.init, map_location="cpu").state_dict())
    model = model.to(dev)
    averaged = set(k for k, _ in model.named_parameters())
    if args.buffers == "average":
        averaged |= set(k for k, _ in model.named_buffers())
    global_state = {k: v.detach().clone() for k, v in model.state_dict().items() if k in averaged}
    samples = 0
    clients = 0
    t0 = time.perf_counter()
    for r, selected in enumerate(rounds):
        if r == args.warmup_rounds and r > 0:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            samples = 0
            clients = 0
            t0 = time.perf_counter()
        acc = {k: torch.zeros_like(v) for k, v in global_state.items()}
        total = 0
        for c in selected:
            model.load_state_dict(global_state, strict=False)
            opt = torch.optim.SGD(model.parameters(), lr=args.lr)
            idx = parts[c].to(dev)
            x, y = x_train[idx], y_train[idx]
            n = len(idx)
            for _ in range(args.epochs):
                perm = torch.randperm(n, device=dev)
                for start in range(0, n, args.batch):
                    b = perm[start:start + args.batch]
                    opt.zero_grad()
                    loss = F.cross_entropy(model(x[b]), y[b])
                    loss.backward()
                    opt.step()
            samples += n * args.epochs
            clients += 1
            with torch.no_grad():
                for k, v in model.state_dict().items():
                    if k not in acc:
                        continue
                    if v.is_floating_point():
                        acc[k].add_(v, alpha=float(n))
                    else:
                        acc[k].copy_(v)  # num_batches_tracked: the last client's
            total += n
        global_state = {k: v / total if v.is_floating_point() else v for k, v in acc.items()}
    if dev.type == "cuda":
        torch.cuda.synchronize()
    train_s = time.perf_counter() - t0

    model.load_state_dict(global_state, strict=False)
    model.eval()
    t1 = time.perf_counter()
    correct = 0
    with torch.no_grad():
        for start in range(0, len(y_test), 1000):
            xb = x_test[start:start + 1000].to(dev)
            correct += int((model(xb).argmax(1).cpu() == y_test[start:start + 1000]).sum())
    eval_s = time.perf_counter() - t1
    print(json.dumps({"rounds": len(rounds), "clients": clients, "samples": samples, "train_s": train_s,
                      "samples_per_s": samples / train_s, "eval_s": eval_s,
                      "accuracy": correct / len(y_test), "threads": args.threads, "buffers": args.buffers,
                      "torch": torch.__version__}))


if __name__ == "__main__":
    main()
