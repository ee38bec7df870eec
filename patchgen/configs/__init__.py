"""Patch configs: patchgen/configs/<model>/<device>.py, each defining `config`."""
