"""The small classification task of the equivalence scripts (imported from beside them)."""
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset


def dataset(n):
    """``n`` samples of 10 features and 3 classes, the same on every rank and every call."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, 10, generator=g)
    y = (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 1).long()
    return TensorDataset(x, y)


def make_net():
    return nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3))


def one_process_reference(initial, world, batch, steps, lr, momentum=0.0, accumulate=1, device="cpu"):
    """What one process trains with batch ``world * batch * accumulate``: the same samples in the
    same order as ``world`` ranks under Lightning's sampler, plain SGD (with ``momentum``) from the
    state dict ``initial``, on ``device``; returns the final state dict."""
    net = make_net().to(device)
    net.load_state_dict(initial)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    ds = dataset(world * batch * steps * accumulate)
    # Lightning gives training loaders a DistributedSampler(shuffle=True, seed=0): rank r reads
    # perm[r::W], so step k of all ranks together covers perm[k·W·B : (k+1)·W·B].
    seed = int(os.getenv("PL_GLOBAL_SEED", 0))  # the sampler's seed, as Lightning picks it
    perm = torch.randperm(len(ds), generator=torch.Generator().manual_seed(seed)) if world > 1 else torch.arange(len(ds))
    loader = DataLoader(Subset(ds, perm.tolist()), batch_size=world * batch * accumulate, shuffle=False)
    for x, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(net(x.to(device)), y.to(device)).backward()
        opt.step()
    return net.state_dict()
