"""The compiler: load a checkpoint, trace it (with and without a KV cache), run the passes,
calibrate plans and widths, and write the artifact (`driver.compile_model`)."""
