"""The pinned upstream release. Generated files derive from this exact transformers version."""

TRANSFORMERS_PIN = "5.24.0"
