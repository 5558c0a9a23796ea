"""The runtime that drives compiled modules: caches, complexity estimation and budget plans."""
