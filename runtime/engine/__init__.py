"""The decoding engine: one loop (core.py: schedule -> execute -> update) that `generate`,
`rbcompile run`, `serve` and self-consistency use; its requests, waiting queue, K/V cache and
prefix cache, sampling, drafters and their policy, stop criteria, and the votes."""
