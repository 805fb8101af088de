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
    return nn.Sequential(
        nn.Linear(args["features"], args["hidden"]),
        nn.BatchNorm1d(args["hidden"]),
        nn.ReLU(),
        nn.Linear(args["hidden"], 1),
    )


def loss_per_token(model, batch):
    """A loss that forgot to reduce: one value per token (a mistake only a rank can find)."""
    logits = model(batch["input_ids"][:, :-1])
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), batch["input_ids"][:, 1:].reshape(-1).long(), reduction="none"
    )


def build_gpt2(model_section):
    """A Hugging Face GPT2LMHeadModel (tied input and output embeddings, dropout) from the model section."""
    from transformers import GPT2Config, GPT2LMHeadModel

    m = model_section
    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=m["vocab_size"],
            n_positions=m["seq_len"],
            n_embd=m["d_model"],
            n_layer=m["n_layers"],
            n_head=m["n_heads"],
            bos_token_id=0,
            eos_token_id=0,
        )
    )


def hf_loss(model, batch):
    """Next-token loss of a Hugging Face causal LM, which returns an output object, not logits."""
    ids = batch["input_ids"]
    logits = model(input_ids=ids[:, :-1]).logits
    return torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1).long()
    )


def shift_tokens(batch):
    """A data.map: every token t -> (3t + 1) mod 50, and the pid of the process that ran it."""
    import os

    import numpy as np

    return {"input_ids": (batch["input_ids"] * 3 + 1) % 50, "pid": np.full(len(batch["input_ids"]), os.getpid())}


def drop_a_row(batch):
    """A data.map that filters: not row-preserving."""
    return {k: v[1:] for k, v in batch.items()}


def tokens_only(arrays):
    """A data.collate that takes input_ids and leaves the columns a data.map added."""
    import torch

    return {"input_ids": torch.tensor(arrays["input_ids"])}


class TwoDense(nn.Module):
    """fc1 -> relu -> fc2: the parameter names and shapes of the MindSpore net of tests/mindformers_side.py
    (a MindSpore Dense(in, out) holds weight [out, in] and bias [out], as torch's Linear does)."""

    def __init__(self, features: int = 64, hidden: int = 512):
        super().__init__()
        self.fc1 = nn.Linear(features, hidden)
        self.fc2 = nn.Linear(hidden, 1)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def build_two_dense(model_section):
    return TwoDense(**model_section["args"])


class WrappedLM(nn.Module):
    """A module of the user's around a transformers model: its tensors' names start with "lm."."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids):
        return self.lm(input_ids=input_ids)


def hf_from_pretrained(model_section):
    """As a fine-tuning user builds one: AutoModelForCausalLM.from_pretrained(model.args.path); with
    model.args.wrap, inside a module of the user's."""
    from transformers import AutoModelForCausalLM

    args = model_section["args"]
    model = AutoModelForCausalLM.from_pretrained(args["path"])
    return WrappedLM(model) if args.get("wrap") else model
