"""Step-level resumable PyTorch training on Ray Train."""

__version__ = "0.1.0"
