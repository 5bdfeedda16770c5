"""Load generator and benchmark harness for any OpenAI-compatible server."""
