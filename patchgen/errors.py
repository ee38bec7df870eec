"""Error types of the generator. Each message names what was asked, what was found and what to do."""

EXIT_CLEAN, EXIT_DRIFT, EXIT_USAGE, EXIT_ERROR = 0, 1, 2, 3


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


class SignatureMismatch(PatchgenError):
    """An override drops or changes a parameter or a parameter annotation of the upstream method it replaces."""
