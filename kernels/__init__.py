"""Run time of patchgen: kernel handles, op slots, selection, shared-prefix plan, our kernels.

Imported as `patchgen.kernels` (the folder is never a top-level `kernels`, which is
HuggingFace's kernel-hub package). Importing this package loads no kernel library.
"""
