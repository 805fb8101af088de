"""User code for the plug-in tests (imported by path, as a user's package would be)."""

import torch
from torch import nn

NOT_A_FUNCTION = 42


class TiedLM(nn.Module):
    """Input embedding and output head share one weight (the usual weight tying)."""

    def __init__(self, vocab: int = 16, width: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.embed(ids))


def build_tied(model_section):
    return TiedLM(**model_section["args"])


def loss_one_arg(batch):
    return torch.zeros(())


def build_not_a_module(model_section):
    return "a string"


def build_batchnorm(model_section):
    """An MLP with BatchNorm: running statistics that differ between ranks after every step."""
    args = model_section["args"]
    return nn.Sequential(nn.Linear(args["features"], args["hidden"]), nn.BatchNorm1d(args["hidden"]), nn.ReLU(),
                         nn.Linear(args["hidden"], 1))


def loss_per_token(model, batch):
    """A loss that forgot to reduce: one value per token (a mistake only a rank can find)."""
    logits = model(batch["input_ids"][:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["input_ids"][:, 1:].reshape(-1).long(),
                                             reduction="none")
