"""What a checkpoint is on disk, with no I/O: names and paths, the tensor pieces of a save (`plan`),
`common.json` and `metadata.json` and their parsing (ours and the variants we read), the manifest a rank
reports, a shard's digests, the training state as named tensors, and what a checkpoint must fit."""
