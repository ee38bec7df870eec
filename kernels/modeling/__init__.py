"""Run-time helpers of the generated Qwen3.5 modules: packed metadata, shared-prefix threading, LM head.

The generated forwards stay close to upstream and call these for what would otherwise be repeated
in every body: reading the packed kwargs, deciding and building the shared-prefix plan (with the
guards of shared_prefix.md section 4), and the LM head with deduplicated rows and the exact loss.
"""
