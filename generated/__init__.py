"""Checked-in generated modeling modules: generated/<model>/patched_modeling_<model>_<device>.py."""

from importlib import metadata as _metadata

from patchgen.pins import TRANSFORMERS_PIN as _PIN

# The modules are upstream's code of exactly this release: another one fails at a name it lacks, far
# from the cause, or imports and runs on internals that moved. Read from metadata: nothing imported.
try:
    _found = _metadata.version("transformers")
except _metadata.PackageNotFoundError:
    _found = "none"
if _found != _PIN:
    raise ImportError(
        f"patchgen's modules were generated from transformers {_PIN}, installed {_found}: "
        f"pip install transformers=={_PIN} (or regenerate them for {_found}: docs/upgrading.md)"
    )
