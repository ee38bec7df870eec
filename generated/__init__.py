"""Checked-in generated modeling modules: generated/<model>/patched_modeling_<model>_<device>.py."""

import transformers as _transformers

from patchgen.pins import TRANSFORMERS_PIN as _PIN

# The modules are upstream's code of exactly this release: another one fails at a name it lacks, far
# from the cause, or imports and runs on internals that moved. The version is the imported package's
# (which the modules import next anyway), not the metadata's: a distribution found first on sys.path
# need not be the package imported (a checkout on PYTHONPATH, a stale .dist-info beside another install).
_found = getattr(_transformers, "__version__", "unknown")
if _found != _PIN:
    raise ImportError(
        f"patchgen's modules were generated from transformers {_PIN}, imported {_found} "
        f"({getattr(_transformers, '__file__', None)}): pip install transformers=={_PIN} "
        f"(or regenerate them for {_found}: docs/upgrading.md)"
    )
