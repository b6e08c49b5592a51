"""The package build: pyproject.toml holds the metadata; this file adds the native parts (native/build.py), so that
``pip install .`` and ``pip wheel .`` compile libattn_lt.so and the fast path into the package. A wheel that
carries them is tagged for this Python and platform; without nvcc (or with ATTN_LT_SKIP_NATIVE=1) the build says
so and makes a pure-Python wheel."""

import os
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "native"))
import build as native_build  # noqa: E402  (native/build.py)


def _native_wanted() -> bool:
    if os.environ.get(native_build.SKIP_ENV, "").strip() not in ("", "0"):
        native_build.say(f"native parts not built ({native_build.SKIP_ENV} is set): a pure-Python package")
        return False
    if native_build.find_nvcc() is None:
        native_build.say("native parts not built: nvcc not found (CUDA 12 or 13 toolkit; set NVCC or put it on "
                         "PATH); a pure-Python package that imports and explains, GPU calls need the library")
        return False
    return True


NATIVE = _native_wanted()


class NativeDistribution(Distribution):
    def has_ext_modules(self):  # the wheel carries compiled code: platform-tagged, not py3-none-any
        return NATIVE


class BuildNative(build_ext):
    """Builds the native parts into the package (in place for editable installs) through native/build.py."""

    def run(self):
        if not NATIVE:
            return
        out = (ROOT if self.inplace or getattr(self, "editable_mode", False) else Path(self.build_lib))
        try:
            native_build.build(out / "attn_lt" / "_native")
        except RuntimeError as e:
            raise SystemExit(f"attn_lt build: error: {e}") from None

    def get_outputs(self):
        return []


setup(distclass=NativeDistribution, cmdclass={"build_ext": BuildNative})
