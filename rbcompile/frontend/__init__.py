"""The front end: the CLI, the torch.compile backend, ONNX export and quality-latency curves
(the Python API is `rbcompile/__init__.py`)."""
