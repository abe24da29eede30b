"""The small classification task of the equivalence scripts (imported from beside them)."""
import torch
from torch import nn
from torch.utils.data import TensorDataset


def dataset(n):
    """``n`` samples of 10 features and 3 classes, the same on every rank and every call."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, 10, generator=g)
    y = (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 1).long()
    return TensorDataset(x, y)


def make_net():
    return nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3))
