"""`patchgen`: generate, list and check the patched modeling modules.

Exit codes: 0 clean, 1 drift (--check), 2 usage, 3 configuration, input or environment error,
130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import time

from patchgen.errors import (
    EXIT_CLEAN,
    EXIT_DRIFT,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    OutputError,
    PatchgenError,
)


class Interrupted(Exception):
    """Ctrl-C during a run; the message says what was and was not written."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="patchgen",
        description="Generate readable, patched HuggingFace modeling modules (see docs/patchgen.md).",
        epilog="exit codes: 0 clean, 1 drift, 2 usage, 3 configuration, input or environment error, 130 interrupted",
    )
    parser.add_argument("--model", help="model to generate, e.g. qwen3_5")
    parser.add_argument("--device", help="device target, e.g. gpu or npu")
    parser.add_argument("--all", action="store_true", help="every model x device target")
    parser.add_argument("--list", action="store_true", help="print the targets and exit")
    parser.add_argument("--dry-run", action="store_true", help="generate in memory and say what would change")
    parser.add_argument(
        "--diff", action=argparse.BooleanOptionalAction, default=None,
        help="write the unified diff against upstream next to each module (default: on)",
    )
    parser.add_argument(
        "--check", nargs="?", const="", metavar="TARGET",
        help="regenerate in memory and fail on drift; TARGET is MODEL/DEVICE (default: all); never writes",
    )
    parser.add_argument("--fix", action="store_true", help="with --check: write the regenerated files")
    parser.add_argument(
        "--source", metavar="PATH",
        help="generate from a transformers wheel or unpacked directory instead of the installed package "
        "(skips the version pin: the header records the source's version)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="say what each step did")
    return parser


def _report_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="patchgen upgrade-report",
        description="What a transformers release changes under each patch (docs/upgrading.md).",
        epilog="exit codes: 0 every patch applies to unchanged upstream code, 1 something needs review, 3 error",
    )
    parser.add_argument("--source", metavar="PATH", required=True, help="the new transformers: a wheel or unpacked directory")
    parser.add_argument("--base", metavar="PATH", help="the old transformers (default: the installed pin)")
    parser.add_argument("--model")
    parser.add_argument("--device")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    report = bool(argv) and argv[0] == "upgrade-report"
    parser = _report_parser() if report else _parser()
    try:
        args = parser.parse_args(argv[1:] if report else argv)
    except SystemExit as exc:  # argparse exits 2 on usage errors and 0 on --help
        return int(exc.code or 0)
    try:
        with _cycle_collector_paused():
            return _upgrade_report(parser, args) if report else _run(parser, args)
    except PatchgenError as exc:
        print(f"patchgen: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except Interrupted as exc:
        print(f"patchgen: interrupted: {exc}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:
        print("patchgen: interrupted: nothing was written", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # the reader of our output went away (`patchgen --check | head`): nothing to tell it; stdout is pointed
        # at devnull so that the interpreter's final flush does not raise again
        with contextlib.suppress(OSError, ValueError, AttributeError):  # a stdout without a file descriptor
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except OSError as exc:  # the machine, not our code: a file that cannot be read or written
        where = f" {exc.filename}" if exc.filename else ""
        print(f"patchgen: error: cannot use{where}: {exc.strerror or exc}: check the path and its permissions",
              file=sys.stderr)
        return EXIT_ERROR
    except Exception as exc:  # noqa: BLE001 (never let a crash read as exit 1, "drift")
        import traceback

        traceback.print_exc()
        print(f"patchgen: internal error: {type(exc).__name__}: {exc} (please report it)", file=sys.stderr)
        return EXIT_ERROR


EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as a shell reports a process that signal ended


@contextlib.contextmanager
def _cycle_collector_paused():
    """Python's cycle collector off for one run, back as it was afterwards.

    Generation allocates millions of small tree nodes that live until the run ends and that reference
    counting frees anyway; the collector would traverse the growing trees again and again and find
    next to nothing (about a tenth of a `--check`, bench/generator_time.py).
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _usage(parser: argparse.ArgumentParser, message: str) -> int:
    parser.print_usage(sys.stderr)
    print(f"patchgen: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from patchgen import targets as targets_mod

    checking = args.check is not None
    if args.fix and not checking:
        return _usage(parser, "--fix only goes with --check")
    if (args.model is None) != (args.device is None):
        return _usage(parser, "--model and --device go together (or use --all)")
    chosen_modes = sum([bool(args.all), args.model is not None, bool(args.list)])
    if chosen_modes > 1 or (checking and (args.all or args.list)):
        return _usage(parser, "choose one of --model/--device, --all, --list, --check")
    if not checking and chosen_modes == 0:
        return _usage(parser, "nothing to do: give --model M --device D, --all, --list or --check")
    refused = _refused_flags(args, checking)
    if refused:
        return _usage(parser, refused)

    if args.list:
        redirected = bool(os.environ.get("PATCHGEN_OUTPUT_DIR"))  # else the repository's path, as in the headers
        for target in targets_mod.all_targets():
            output = target.output_path() if redirected else f"generated/{target.model}/{target.output_name}.py"
            print(f"{target.name}\t{target.config_path} -> {output}")
        return EXIT_CLEAN

    from patchgen.source import TransformersSource, check_pinned_version

    if args.source:
        source = TransformersSource(args.source)
        version = source.version
    else:
        source = None
        version = check_pinned_version()  # before any diff: a different upstream would drift everything
    every = targets_mod.all_targets()
    if checking:
        if args.check:
            selected = [targets_mod.parse_target(args.check)]
        elif args.model:
            selected = [targets_mod.find_target(args.model, args.device)]
        else:
            selected = every
        return _check(selected, every, source, fix=args.fix, verbose=args.verbose)
    selected = every if args.all else [targets_mod.find_target(args.model, args.device)]
    with_diff = True if args.diff is None else args.diff
    return _generate(selected, version, source, dry_run=args.dry_run, with_diff=with_diff, verbose=args.verbose)


def _refused_flags(args: argparse.Namespace, checking: bool) -> str | None:
    """Why a flag given does not fit the mode (it would be ignored, or contradict the mode), or None."""
    if checking:
        if args.dry_run:
            return "--check never writes and --check --fix writes: --dry-run has no meaning with --check"
        if args.diff is not None:
            return "--check always compares the module and its .diff: --diff/--no-diff only go with generating"
        if args.check and args.model:
            return f"--check {args.check} and --model/--device both name a target: give one of them"
    if args.list:
        given = [flag for flag, on in (("--dry-run", args.dry_run), ("--diff/--no-diff", args.diff is not None),
                                       ("--source", bool(args.source))) if on]
        if given:
            return f"--list prints the targets and reads nothing else: {', '.join(given)} has no meaning with it"
    return None


def _generate_one(target, source):
    from patchgen.pipeline import generate
    from patchgen.source import load_upstream

    config = target.load_config()
    return generate(target, config, load_upstream(config.upstream_module, source))


def _generate_all(selected, source):
    """Every selected target's result, in order; the models split over two processes where that helps."""
    from patchgen.parallel import run_targets

    # A wheel is read through one open zip file, whose read position a forked process would share.
    return run_targets(lambda target: _generate_one(target, source), selected, jobs=1 if source else None)


def _generate(selected, version, source, *, dry_run: bool, with_diff: bool, verbose: bool) -> int:
    try:
        start = time.perf_counter()
        results = _generate_all(selected, source)  # everything is generated before anything is written
        if verbose:
            print(f"generated {len(results)} target(s) from transformers {version} in {time.perf_counter() - start:.2f}s")
    except KeyboardInterrupt:
        raise Interrupted("nothing was written (stopped while generating; every file on disk is as it was)") from None
    if dry_run:
        from patchgen.check import expected_files

        for result in results:
            for path, text in expected_files(result, with_diff).items():
                changed = not path.exists() or path.read_bytes() != text.encode("utf-8")
                print(f"{'would write' if changed else 'unchanged'} {path}")
        return EXIT_CLEAN
    _write_all(results, with_diff, verbose, verb="wrote")
    return EXIT_CLEAN


def _write_all(results, with_diff: bool, verbose: bool, *, verb: str) -> None:
    """Write every result's files; on Ctrl-C or a failed write, say which targets are complete and which are not."""
    from patchgen.check import expected_files
    from patchgen.write import check_writable, write_if_changed

    for result in results:
        for path in expected_files(result, with_diff):
            check_writable(path)
    done: set = set()  # paths written or already up to date in this run
    try:
        for result in results:
            for path, text in expected_files(result, with_diff).items():
                if write_if_changed(path, text):
                    print(f"{verb} {path}")
                elif verbose:
                    print(f"unchanged {path}")
                done.add(path)
    except KeyboardInterrupt:
        raise Interrupted(_partial_report(results, with_diff, done)) from None
    except OutputError as exc:
        if not done:
            raise
        raise OutputError(f"{exc}; {_partial_report(results, with_diff, done)}") from None


def _partial_report(results, with_diff: bool, done: set) -> str:
    from patchgen.check import expected_files

    complete, partial, untouched = [], [], []
    for result in results:
        paths = list(expected_files(result, with_diff))
        finished = [p for p in paths if p in done]
        (complete if len(finished) == len(paths) else partial if finished else untouched).append(
            (result.target.name, [p for p in paths if p not in done])
        )
    parts = []
    if complete:
        parts.append(f"up to date: {', '.join(name for name, _ in complete)}")
    for name, missing in partial:
        parts.append(f"{name} partly written (not written: {', '.join(str(p) for p in missing)})")
    if untouched:
        parts.append(f"not written (old files kept): {', '.join(name for name, _ in untouched)}")
    return (
        "; ".join(parts)
        + ". Each file is either the old or the new one (writes are atomic). Run the command again to finish."
    )


def _check(selected, every, source, *, fix: bool, verbose: bool) -> int:
    from patchgen.check import check_orphans, check_output_folder, compare

    check_output_folder(every)
    check_orphans(every)
    try:
        results = _generate_all(selected, source)
    except KeyboardInterrupt:
        raise Interrupted("nothing was written (stopped while generating)") from None
    stale = []
    for result in results:
        drifts = compare(result)
        stale += drifts
        if verbose and not drifts:
            print(f"{result.target.name}: clean")
    if not stale:
        print(f"patchgen --check: {len(results)} target(s) clean")
        return EXIT_CLEAN
    for drift in stale:
        print(f"stale: {drift.path}")
        sys.stdout.write(drift.diff)
    if fix:
        _write_all(results, True, verbose, verb="fixed")
        return EXIT_CLEAN
    print(f"patchgen --check: {len(stale)} stale file(s); run `patchgen --check --fix` (or `make generate`)")
    return EXIT_DRIFT


def _upgrade_report(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from patchgen import targets as targets_mod
    from patchgen.source import TransformersSource, check_pinned_version, load_upstream
    from patchgen.upgrade import report_target

    if (args.model is None) != (args.device is None):
        return _usage(parser, "--model and --device go together")
    new_source = TransformersSource(args.source)
    base_source = TransformersSource(args.base) if args.base else None
    if base_source is None:
        check_pinned_version()
    selected = [targets_mod.find_target(args.model, args.device)] if args.model else targets_mod.all_targets()
    reports = []
    for target in selected:
        config = target.load_config()
        old = load_upstream(config.upstream_module, base_source)
        new = load_upstream(config.upstream_module, new_source)
        reports += report_target(target.name, config, old, new)
    if args.json:
        print(json.dumps([{**dataclasses.asdict(r), "needs_review": r.needs_review} for r in reports], indent=2))
    else:
        for r in reports:
            print(r.line())
            if r.diff:
                print("".join("    " + line for line in r.diff.splitlines(keepends=True)), end="")
        review = sum(r.needs_review for r in reports)
        print(f"{len(reports)} patch(es), {review} to review")
    return EXIT_DRIFT if any(r.needs_review for r in reports) else EXIT_CLEAN


if __name__ == "__main__":
    sys.exit(main())
