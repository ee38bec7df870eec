"""Thin adapters from kernel libraries to the op-slot signatures of docs/ops.md.

Each module imports its library at its top, so it is imported only when a kernel handle loads
it (never by ``import patchgen.kernels``). Adapters translate arguments; they hold no math.
"""
