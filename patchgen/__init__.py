"""patchgen: generates readable, patched HuggingFace modeling modules.

Kept import-light on purpose: `import patchgen.kernels` (run time) must not pay for the
generator (libcst, jinja2), and nothing here imports torch.
"""

__version__ = "0.1.0"
