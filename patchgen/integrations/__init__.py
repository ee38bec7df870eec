"""Integrations with the trainers users already run (one module per library; imported explicitly).

``patchgen.integrations.trl``: ``SharedPrefixGRPOTrainer``. Nothing here is imported by the
generated modules or by ``import patchgen``.
"""
