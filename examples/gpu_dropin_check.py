"""Drop-in JointDP with a user's model and train loop on the GPU (CPU without one).

A user's ClientApp whose ``train_fn`` moves the model and batches to CUDA, under
``JointDPClient``, three in-process owners, two rounds, local then central noise; exits
1 if a reply failed, no accuracy came back or epsilon is outside (0, 8].

    python examples/gpu_dropin_check.py                            # torch.func per-sample path
    FLWR_JDP_PER_SAMPLE=opacus python examples/gpu_dropin_check.py  # Opacus's hooks
"""
import os
import sys

import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from flwr_jdp.client import JointDPClient
from flwr_jdp.inprocess import InProcessGrid
from flwr_jdp.strategies import JointDP
from flwr_jdp.training import per_sample

dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3)
        self.norm = nn.GroupNorm(2, 8)
        self.fc1 = nn.Linear(8 * 13 * 13, 32)
        self.fc3 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.norm(self.conv(x))), 2)
        return self.fc3(F.relu(self.fc1(x.flatten(1))))


def data(ctx, test=False):
    g = torch.Generator().manual_seed(int(ctx.node_config["partition-id"]) * 2 + int(test))
    y = torch.randint(0, 10, (160,), generator=g)
    x = torch.randn(160, 1, 28, 28, generator=g) * 0.3 + y.view(-1, 1, 1, 1) / 10
    return DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True, generator=g)


def train_fn(net, loader, lr=0.05):
    net.to(dev)
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=lr, momentum=0.9)
    net.train()
    for x, y in loader:
        x, y = x.to(dev), y.to(dev)
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()


app = ClientApp()
jdp = JointDPClient(app, model_fn=Net, train_data=lambda ctx: data(ctx))


@app.train()
def train(msg, ctx):
    return jdp.train(msg, ctx, Net(), data(ctx), train_fn)


@app.evaluate()
def evaluate(msg, ctx):
    model = jdp.load(Net(), msg, ctx, fit=lambda n: train_fn(n, data(ctx))).to(dev).eval()
    correct = n = 0
    with torch.no_grad():
        for x, y in data(ctx, test=True):
            correct += int((model(x.to(dev)).argmax(1).cpu() == y).sum())
            n += len(y)
    return Message(RecordDict({"metrics": MetricRecord({"accuracy": correct / n, "num-examples": n})}),
                   reply_to=msg)


ok = True
for placement in ("local", "central"):
    rc = {"jdp.personal-layers": "^fc3\\.", "jdp.num-rounds": 2, "jdp.noise-placement": placement,
          "jdp.target-epsilon": 8.0, "jdp.results-dir": f"/tmp/r-{placement}-{os.getpid()}"}
    grid = InProcessGrid(app, 3, rc)
    strategy = JointDP.from_run_config(rc, node_settle_s=0.0)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(Net().state_dict()), num_rounds=2)
    errors = [r.error.reason for r in grid.sent if r.has_error()]
    acc = result.evaluate_metrics_clientapp.get(2, {}).get("accuracy")
    print(f"backend={per_sample.BACKEND} placement={placement} epsilon={strategy.ledger.epsilon():.4f} "
          f"accuracy={acc} errors={errors[:2]}", flush=True)
    ok = ok and not errors and acc is not None and 0 < strategy.ledger.epsilon() <= 8.0
print("GPU_CHECK", "OK" if ok else "FAILED", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")
sys.exit(0 if ok else 1)
