"""Checked-in generated modeling modules: generated/<model>/patched_modeling_<model>_<device>.py."""
