"""libcst codemods: one small transformer per kind of edit, composed by patchgen.pipeline."""
