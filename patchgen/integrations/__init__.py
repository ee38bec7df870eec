"""Integrations with the libraries users already run (one module per library; imported explicitly).

``patchgen.integrations.auto``: transformers' auto classes (``patchgen.register``).
``patchgen.integrations.trl``: ``SharedPrefixGRPOTrainer``. Nothing here is imported by the
generated modules or by ``import patchgen``.
"""
