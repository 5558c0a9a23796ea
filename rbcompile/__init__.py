"""rbcompile: compile Hugging Face transformers into adaptive runtime modules.

    import rbcompile
    model = rbcompile.compile("minilm-l6")          # a bundled name, a checkpoint folder or a model
    out = model(input_ids, attention_mask, budget=0.25)   # within model.guard (rbcompile.QualityGuard)
    model.save("build/minilm")
    model = rbcompile.load("build/minilm")

The API is imported on first use, so `import rbcompile` (and the CLI's start, where Ctrl-C must
already be handled) does not load torch.
"""
import importlib

__version__ = "0.1.0"

from rbcompile.errors import CompileError, UserError  # noqa: E402

_LAZY = {"CompiledModel": ("artifact.compiled", "CompiledModel"),
         "CompiledOutput": ("artifact.compiled", "CompiledOutput"),
         "load": ("runtime.engine.model", "load"),
         "QualityGuard": ("artifact.guard", "QualityGuard"),
         "compile": ("compiler.driver", "compile_model")}

__all__ = ["CompileError", "CompiledModel", "CompiledOutput", "QualityGuard", "UserError",
           "compile", "load", "__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        module, attribute = _LAZY[name]
        value = getattr(importlib.import_module(f".{module}", __name__), attribute)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'rbcompile' has no attribute {name!r}")
