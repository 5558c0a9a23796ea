"""Serving: the OpenAI-compatible HTTP app (schemas, endpoints, streaming, metrics, limits,
connections, the model thread) with its config, and Ray Serve replicas."""
