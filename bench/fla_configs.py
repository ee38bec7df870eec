"""fla's autotuning results, kept as fla's own per-GPU config files, so a fresh machine skips the tuning.

    python bench/fla_configs.py --out DIR [--triton-cache DIR]   # on the GPU machine, after a run

fla 0.6 tunes each of its Triton kernels the first time it runs (tens of configurations compiled and
timed per kernel: minutes on a cold H200, most of a short device call). Triton writes every result
into its cache as `<kernel>.autotune.json` (fla turns `cache_results` on), and fla can read the best
configuration back from `$FLA_CONFIG_DIR/<kernel>.json` when `FLA_CACHE_MODE` says so. This script
turns the first into the second: for every tuned kernel, the fastest configuration per tuning key,
in fla's file format (`autotune_entries` keyed by the md5 of the key as fla serialises it). The
files are checked in under `bench/fla_configs/<GPU>/`; `bench/gpu_env.sh` points fla at them in
`strict` mode: a key seen before takes its recorded configuration, any other key is tuned as usual.
Entries already in DIR are kept (a run adds the keys it tuned). Only fla's kernels are written when
fla is importable (the cache also holds liger's tunings, which fla would never read).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import pkgutil
import sys
from pathlib import Path

CONFIG_FIELDS = ("kwargs", "num_warps", "num_stages", "num_ctas", "maxnreg", "ir_override")


def key_hash(key) -> str:
    """The hash fla files an entry under: md5 of the key as compact, key-sorted JSON."""
    return hashlib.md5(json.dumps(key, separators=(",", ":"), sort_keys=True).encode()).hexdigest()


def fastest(configs_timings: list) -> dict:
    """The configuration Triton picked: the least timing (a [median, p20, p80] list compares as Triton's min does)."""
    config, _ = min(configs_timings, key=lambda pair: pair[1])
    return {field: config.get(field) for field in CONFIG_FIELDS if field in config}


def tuned_kernels(triton_cache: Path) -> dict[str, dict[str, dict]]:
    """{kernel name: {key hash: {"autotune_key", "config"}}} from every `*.autotune.json` in Triton's cache."""
    kernels: dict[str, dict[str, dict]] = {}
    for path in sorted(triton_cache.glob("*/*.autotune.json")):
        record = json.loads(path.read_text())
        if not record.get("configs_timings"):
            continue
        name = path.name[: -len(".autotune.json")]
        key = record["key"]
        kernels.setdefault(name, {})[key_hash(key)] = {"autotune_key": key, "config": fastest(record["configs_timings"])}
    return kernels


def fla_kernel_names() -> set[str] | None:
    """The names of fla's autotuned Triton kernels (every module of fla imported), or None without fla."""
    try:
        import fla
        from triton.runtime.autotuner import Autotuner
    except ImportError:
        return None
    names = set()
    for info in pkgutil.walk_packages(fla.__path__, "fla."):
        try:
            module = importlib.import_module(info.name)
        except Exception as error:  # noqa: BLE001 - a module needing what fla does not install: its kernels never ran
            print(f"fla configs: {info.name} not imported ({type(error).__name__}: {error})", file=sys.stderr)
            continue
        for value in vars(module).values():
            for _ in range(4):  # @triton.heuristics / @triton.autotune wrap the JITFunction, each with `.fn`
                if isinstance(value, Autotuner):
                    names.add(value.base_fn.__name__)
                    break
                value = getattr(value, "fn", None)
    return names


def only(kernels: dict[str, dict[str, dict]], names: set[str] | None) -> dict[str, dict[str, dict]]:
    """The kernels named in `names` (all of them when None)."""
    return kernels if names is None else {name: entries for name, entries in kernels.items() if name in names}


def write(kernels: dict[str, dict[str, dict]], out: Path, triton_version: str) -> list[Path]:
    """One `<kernel>.json` per kernel in `out`, merged with the entries a file there already holds."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, entries in sorted(kernels.items()):
        path = out / f"{name}.json"
        merged = json.loads(path.read_text())["autotune_entries"] if path.exists() else {}
        merged.update(entries)
        text = json.dumps({"kernel_name": name, "triton_version": triton_version, "autotune_entries": merged},
                          indent=1, sort_keys=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(text + "\n")
        os.replace(tmp, path)
        written.append(path)
    return written


def default_triton_cache() -> Path:
    return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the config folder to write (fla's FLA_CONFIG_DIR)")
    parser.add_argument("--triton-cache", type=Path, default=None, help="default: $TRITON_CACHE_DIR or ~/.triton/cache")
    parser.add_argument("--triton-version", default=None, help="recorded in each file (default: the imported triton's)")
    args = parser.parse_args(argv)
    cache = args.triton_cache or default_triton_cache()
    if not cache.is_dir():
        raise SystemExit(f"no Triton cache at {cache}: run the kernels first, or pass --triton-cache")
    version = args.triton_version
    if version is None:
        import triton

        version = triton.__version__
    kernels = only(tuned_kernels(cache), fla_kernel_names())
    written = write(kernels, args.out, version)
    keys = sum(len(entries) for entries in kernels.values())
    print(f"fla configs: {len(written)} kernels, {keys} tuning keys from {cache} -> {args.out}")


if __name__ == "__main__":
    main()
