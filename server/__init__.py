"""HTTP only: the OpenAI-compatible API over the scheduler."""
