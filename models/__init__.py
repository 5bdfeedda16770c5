"""The math of the models, written for selective batching (flat tokens, per-request attention)."""
