"""The package-dir layout: the checkout's passes/, kernels/ and runtime/ are rbcompile.passes,
rbcompile.kernels and rbcompile.runtime, and never top-level packages (Hugging Face's `kernels`,
which transformers 5.25 onwards imports, must stay itself), here and in rbcompile's children."""
import importlib.util
import subprocess
import sys

import pytest

from rbcompile.child import child_env

from conftest import ROOT

FIND_KERNELS = ("import importlib.util as u; s = u.find_spec('kernels'); "
                "print(s.origin if s else None)")


def _not_the_checkouts(origin) -> bool:
    return origin in (None, "None") or not str(origin).startswith(str(ROOT / "kernels"))


def test_the_checkouts_folders_are_rbcompiles_subpackages_only():
    import rbcompile.kernels
    import rbcompile.passes
    import rbcompile.runtime

    assert rbcompile.kernels.__file__ == str(ROOT / "kernels" / "__init__.py")
    assert rbcompile.passes.__file__ == str(ROOT / "passes" / "__init__.py")
    assert rbcompile.runtime.__file__ == str(ROOT / "runtime" / "__init__.py")
    top_level = importlib.util.find_spec("kernels")
    assert _not_the_checkouts(top_level and top_level.origin)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="PYTHONSAFEPATH is Python 3.11+")
def test_a_child_started_in_the_checkout_does_not_import_its_kernels_folder():
    child = subprocess.run([sys.executable, "-c", FIND_KERNELS], cwd=ROOT, env=child_env(),
                           capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr
    assert _not_the_checkouts(child.stdout.strip()), child.stdout
    unsafe = {key: value for key, value in child_env().items() if key != "PYTHONSAFEPATH"}
    shadowed = subprocess.run([sys.executable, "-c", FIND_KERNELS], cwd=ROOT, env=unsafe,
                              capture_output=True, text=True, timeout=60)
    assert shadowed.stdout.strip() == str(ROOT / "kernels" / "__init__.py")  # what it guards
