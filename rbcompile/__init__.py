"""rbcompile: compile Hugging Face transformers into adaptive runtime modules.

    import rbcompile
    model = rbcompile.compile("minilm-l6")          # a bundled name, a checkpoint folder or a model
    out = model(input_ids, attention_mask, budget=0.25)
    model.save("build/minilm")
    model = rbcompile.load("build/minilm")
"""
__version__ = "0.1.0"

from .compiled import CompiledModel, CompiledOutput, load  # noqa: E402
from .compiler import compile_model as compile  # noqa: E402,A001
from .errors import CompileError, UserError  # noqa: E402

__all__ = ["CompileError", "CompiledModel", "CompiledOutput", "UserError", "compile", "load",
           "__version__"]
