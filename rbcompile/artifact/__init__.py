"""The artifact: what the compile side writes and the run side reads. Its manifest, the generated
modules (IR, codegen: loading regenerates the code and compares), the region interpreter and
staged runner, the KV-cached decoder, budget plans and the quality guard, CUDA graphs and one
compiled graph per plan, and `CompiledModel`. It imports no pass, compiler or run-side module."""
