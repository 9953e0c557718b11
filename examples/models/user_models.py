#!/usr/bin/env python3
"""Two models as a researcher writes them, for 1x28x28 images and 10 classes,
and how to hand them to Sparrow: script them with torch.jit.script and save.

    python3 examples/models/user_models.py --out DIR [--seed S]

writes DIR/user_cnn.pt and DIR/user_resnet.pt (initial weights drawn under
torch.manual_seed(S)); use them with model = "torchscript:DIR/user_cnn.pt".
bench/peer_fedavg.py imports this file to build the same models eagerly.

user_cnn     three stages of 3x3 conv (padding 1) + ReLU + 2x2 max-pool,
             1 -> 16 -> 32 -> 64 channels (28 -> 14 -> 7 -> 3), then
             Flatten and Linear(576, 10); an nn.Sequential.
user_resnet  a small ResNet: 3x3 stem conv (16) + BatchNorm + ReLU, three
             basic blocks (16, 32 stride 2, 64 stride 2; a 1x1 conv + BatchNorm
             shortcut where the shape changes), AdaptiveAvgPool2d(1), Flatten,
             Linear(64, 10); submodules called in order.
"""
import argparse
import os

import torch
import torch.nn as nn


def user_cnn():
    def stage(cin, cout):
        return [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]

    return nn.Sequential(*stage(1, 16), *stage(16, 32), *stage(32, 64), nn.Flatten(), nn.Linear(64 * 3 * 3, 10))


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class UserResNet(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.layer1 = BasicBlock(16, 16, 1)
        self.layer2 = BasicBlock(16, 32, 2)
        self.layer3 = BasicBlock(32, 64, 2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(64, classes)

    def forward(self, x):
        x = self.layer3(self.layer2(self.layer1(self.stem(x))))
        return self.fc(self.flatten(self.pool(x)))


def user_resnet():
    return UserResNet()


MODELS = {"user_cnn": user_cnn, "user_resnet": user_resnet}


def forward_macs(model, shape=(1, 1, 28, 28)):
    """Multiply-accumulates of one sample's forward pass through the model's
    Conv2d and Linear layers (what dominates; BatchNorm, pooling and
    activations are left out), and those of the first such layer (whose
    input gradient training does not need). Counted with forward hooks."""
    macs = []

    def hook(mod, inp, out):
        if isinstance(mod, nn.Conv2d):
            k = mod.kernel_size[0] * mod.kernel_size[1] * mod.in_channels // mod.groups
            macs.append(out[0].numel() * k)
        else:
            macs.append(out[0].numel() * mod.in_features)

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    was_training = model.training
    model.eval()
    with torch.no_grad():
        model(torch.zeros(shape))
    model.train(was_training)
    for h in handles:
        h.remove()
    return sum(macs), macs[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for user_cnn.pt and user_resnet.pt")
    ap.add_argument("--seed", type=int, default=1, help="seed of the initial weights")
    ap.add_argument("--macs", action="store_true",
                    help="also print one line per model: NAME FORWARD_MACS FIRST_LAYER_MACS (per sample)")
    ap.add_argument("--check", action="store_true",
                    help="check that each saved file computes what the eager model does, in training and "
                         "evaluation mode, and that its state_dict loads into a fresh eager model")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for name, make in MODELS.items():
        torch.manual_seed(args.seed)
        model = make()
        torch.jit.script(model).save(os.path.join(args.out, name + ".pt"))
        if args.macs:
            total, first = forward_macs(model)
            print(name, total, first)
        if args.check:
            check(name, make, model, os.path.join(args.out, name + ".pt"))


def check(name, make, eager, path):
    scripted = torch.jit.load(path)
    fresh = make()
    fresh.load_state_dict(scripted.state_dict())  # strict: every parameter and buffer by its name
    x = torch.randn(8, 1, 28, 28)
    for training in (True, False):
        for m in (eager, scripted, fresh):
            m.train(training)
        with torch.no_grad():
            want = eager(x)
            for what, m in (("scripted", scripted), ("reloaded", fresh)):
                got = m(x)
                if got.shape != (8, 10) or not torch.allclose(got, want, atol=1e-5):
                    raise SystemExit(f"{path}: the {what} {name} differs from the eager one "
                                     f"({'training' if training else 'evaluation'} mode)")
    print(f"{path}: ok")


if __name__ == "__main__":
    main()
