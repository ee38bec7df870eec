"""Jinja2 templates of the generated files (package data)."""
