"""``python -u -P __main__.py FD PARENT ROOM MODULE...``: the zygote (:func:`server.main`).

Run by path, this file imports nothing of epochal: the process every worker is forked from must
not have imported what a worker's own ``import epochal`` is to find on its path and read as it
is imported. It loads the zygote's modules, this file's siblings, as the package
:data:`PACKAGE`, a name nothing else imports, and hands over to its server.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType

PACKAGE = "_epochal_zygote"
"""The name the zygote's own modules have in the zygote (and so in every child)."""


def load() -> ModuleType:
    """The zygote's server module, loaded from this file's directory as ``PACKAGE.server``."""
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location(
        PACKAGE, os.path.join(here, "__init__.py"), submodule_search_locations=[here]
    )
    assert spec is not None and spec.loader is not None  # a file of this package
    package = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = package
    spec.loader.exec_module(package)
    return importlib.import_module(f"{PACKAGE}.server")


if __name__ == "__main__":
    load().main(sys.argv)
