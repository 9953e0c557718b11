"""An MLP whose last layer is a LoRA adapter on a frozen Linear, scripted for Sparrow.

    python3 examples/lora_mlp.py lora_mlp.pt [--rank 4] [--alpha 8] [--seed 1]
    build/bin/sparrow-lite-export --model torchscript:lora_mlp.pt -o lora_mlp.lite

The module is the pattern sparrow-lite-export turns into a lite `lora_linear` layer
(docs/lite.md, "LoRA"): the frozen weight and bias are *buffers*, lora_A and lora_B the
only parameters of that layer, and forward is

    F.linear(x, self.weight, self.bias) + (x @ self.lora_A.t() @ self.lora_B.t()) * self.scaling

(`F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scaling` is recognised too).
Buffers, not `requires_grad=False` parameters: Sparrow's LibTorch side trains and sends
every parameter of a TorchScript model, so only buffers stay out of the update that the
lite client and the LibTorch client must agree on.

Here fc1 and fc2 stay ordinary trainable layers; in a real fine-tune the frozen base
would come from a pretrained model (`LoRALinear.from_linear(pretrained.fc3, ...)`).
"""

import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class LoRALinear(nn.Module):
    """y = x W^T + b + (alpha / r) (x A^T) B^T with W, b frozen (buffers) and A, B trained."""

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float):
        super().__init__()
        self.register_buffer("weight", torch.empty(out_features, in_features))
        self.register_buffer("bias", torch.zeros(out_features))
        # The usual LoRA initialisation: A like a Linear's weight, B zero, so the
        # adapted layer starts as the frozen one.
        self.lora_A = nn.Parameter(torch.empty(rank, in_features))
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        self.scaling = alpha / rank

    @classmethod
    def from_linear(cls, base: nn.Linear, rank: int, alpha: float) -> "LoRALinear":
        m = cls(base.in_features, base.out_features, rank, alpha)
        with torch.no_grad():
            m.weight.copy_(base.weight)
            if base.bias is not None:
                m.bias.copy_(base.bias)
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + (x @ self.lora_A.t() @ self.lora_B.t()) * self.scaling


class LoRAMlp(nn.Module):
    """784-200-200-10 with ReLU (Sparrow's `mlp`), the last layer LoRA-adapted."""

    def __init__(self, rank: int = 4, alpha: float = 8.0):
        super().__init__()
        self.fc1 = nn.Linear(784, 200)
        self.fc2 = nn.Linear(200, 200)
        self.fc3 = LoRALinear.from_linear(nn.Linear(200, 10), rank, alpha)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape([x.size(0), 784])
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default="lora_mlp.pt", help="the TorchScript file to write")
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--alpha", type=float, default=8.0)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    scripted = torch.jit.script(LoRAMlp(args.rank, args.alpha))
    scripted.save(args.out)
    trained = [name for name, _ in scripted.named_parameters()]
    frozen = [name for name, _ in scripted.named_buffers()]
    print(f"{args.out}: parameters {trained}, frozen buffers {frozen}")


if __name__ == "__main__":
    main()
