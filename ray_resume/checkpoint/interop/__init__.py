"""Other formats: PyTorch DCP both ways (`dcp.load` reads a root; a DCP checkpoint is a `load_path`)
and a consolidated safetensors export (Hugging Face's)."""
