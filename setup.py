"""The package build: pyproject.toml holds the metadata; this file adds the native parts (native/build.py), so that
``pip install .`` and ``pip wheel .`` compile libattn_lt.so and the fast path into the package. A wheel that
carries them is tagged for this Python and platform; without nvcc (or with ATTN_LT_SKIP_NATIVE=1) the build says
so and makes a pure-Python wheel."""

import importlib.util
import shutil
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("attn_lt_native_build", ROOT / "native" / "build.py")
native_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(native_build)

SKIPPED = native_build.skip_reason()
if SKIPPED:
    native_build.say(f"native parts not built: {SKIPPED}; a pure-Python package that imports and explains, GPU "
                     "calls need the library")


class NativeDistribution(Distribution):
    def has_ext_modules(self):  # the wheel carries compiled code: platform-tagged, not py3-none-any
        return SKIPPED is None


class BuildNative(build_ext):
    """Builds the native parts into the package through native/build.py: in place for editable installs, else
    into the build folder, which then holds what this build made and nothing older."""

    def run(self):
        if SKIPPED:
            return
        if self.inplace or getattr(self, "editable_mode", False):
            out = ROOT / "attn_lt" / "_native"
        else:
            out = Path(self.build_lib) / "attn_lt" / "_native"
            shutil.rmtree(out, ignore_errors=True)
        try:
            native_build.build(out)
        except RuntimeError as e:
            raise SystemExit(f"attn_lt build: error: {e}") from None
        self._outputs = [str(p) for p in out.iterdir()]

    def get_outputs(self):
        return getattr(self, "_outputs", [])


setup(distclass=NativeDistribution, cmdclass={"build_ext": BuildNative})
