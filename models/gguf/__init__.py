"""GGUF files: reading their tensors in place (reader.py), decoding their block formats (blocks.py) and converting their metadata to an HF directory once (convert.py)."""
