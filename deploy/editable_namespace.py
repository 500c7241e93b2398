"""Copied into site-packages by `deploy/install-runtime.sh PYTHON --editable` (with a .pth that
imports it): an editable install of Baton that is not hidden by a folder named baton.

From the parent of a clone named baton, that folder (no __init__.py) is a namespace package to
Python's path finder, which is asked before setuptools' editable finder: `from baton import LLM`
fails with "unknown location". A regular install is not hidden so (a regular package anywhere on
sys.path beats namespace portions); this finder gives the editable install the same standing and
changes nothing else (PYTHONPATH, or the clone's own baton/ seen from its root, still come first).
"""
import sys
from importlib.machinery import PathFinder

PACKAGE = "baton"
EDITABLE_FINDER = f"__editable___{PACKAGE}_"      # setuptools' module name: __editable___<name>_<version>_finder


class NamespaceShadowFinder:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != PACKAGE:
            return None
        spec = PathFinder.find_spec(name, path, target)
        if spec is None or spec.origin is not None:          # absent, or a regular package: as usual
            return None
        for finder in sys.meta_path:                          # only a namespace: the editable install
            if getattr(finder, "__module__", "").startswith(EDITABLE_FINDER):
                return finder.find_spec(name, path, target)
        return None


def install() -> None:
    if NamespaceShadowFinder not in sys.meta_path:
        at = sys.meta_path.index(PathFinder) if PathFinder in sys.meta_path else len(sys.meta_path)
        sys.meta_path.insert(at, NamespaceShadowFinder)
