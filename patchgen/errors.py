"""Error types of the generator. Each message names what was asked, what was found and what to do."""

EXIT_CLEAN, EXIT_DRIFT, EXIT_USAGE, EXIT_ERROR = 0, 1, 2, 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command stopped by Ctrl-C


class PatchgenError(Exception):
    """A configuration or generation error: the CLI prints the message and exits with code 3."""

    exit_code = EXIT_ERROR


class ConfigError(PatchgenError):
    """A patch config is malformed or fails to import."""


class UnknownTarget(PatchgenError):
    """A model or device that has no config under patchgen/configs."""


class VersionMismatch(PatchgenError):
    """The installed transformers is not the pinned release the generated files derive from."""


class SourceNotFound(PatchgenError):
    """An upstream or bodies module file could not be located."""


class PatchTargetMissing(PatchgenError):
    """A declared patch target is not in the upstream module, or has the wrong kind."""


class PatchApplyError(PatchgenError):
    """A patch did not apply exactly once, or the output does not compile."""


class OrphanedFile(PatchgenError):
    """A generated file on disk belongs to no configured target."""


class InputError(PatchgenError):
    """A file patchgen reads is unusable: a corrupt or truncated wheel, text that is not UTF-8."""


class OutputError(PatchgenError):
    """The output folder cannot be written or is not a folder (permissions, a file in its place)."""


class StrayTempFile(PatchgenError):
    """A temporary file left by an interrupted write lies next to the generated files."""


class SignatureMismatch(PatchgenError):
    """An override drops or changes a parameter or a parameter annotation of the upstream method it replaces."""
