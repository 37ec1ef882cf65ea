"""A forgerl generator backed by an OpenAI-compatible ``/v1/completions`` server."""
