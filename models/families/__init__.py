"""One file per model family, each declaring a `FAMILY` (models/family.py); models/registry.py lists them."""
