"""Compile our Triton kernels for a GPU target on a machine without one (used by compile_kernels.py).

The CPU tests run the kernels through Triton's interpreter, which accepts code that Triton's compiler
rejects (a name bound in both branches of an `if` with two block shapes, for one). Here each launch a
launcher makes is recorded instead of run, as Triton's own launch path specialises it for the target
(argument types, constexprs, launch options), and each distinct specialisation goes through the
compiler's stages: the frontend (Python AST to TTIR) and then the backend's own, as far as asked.

Everything here needs `TRITON_INTERPRET=0` before triton is imported (kernels are then JITFunctions),
so it runs in a process of its own. It reaches into Triton's launch and compile internals (the binder
of `JITFunction.run`, `backend.add_stages`): written against Triton 3.9, and checked by the tests.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import pkgutil
import time
import traceback
from dataclasses import dataclass, field

from triton import knobs
from triton._C.libtriton import ir
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

PACKAGE = "patchgen.kernels.triton"
STAGES = ("ttir", "ttgir", "llir", "ptx", "cubin")  # the nvidia backend's, in order
# Shared memory one block may use (the opt-in maximum), by compute capability: a kernel asking for more
# compiles, but its launch fails on the device ("out of resource: shared memory").
SHARED_MEMORY = {90: 232448}


def parse_target(text: str) -> GPUTarget:
    """'cuda:90' -> GPUTarget('cuda', 90, 32)."""
    backend, _, arch = text.partition(":")
    if backend != "cuda" or not arch.isdigit():
        raise ValueError(f"target must be 'cuda:<sm>' such as 'cuda:90', got {text!r}")
    return GPUTarget("cuda", int(arch), 32)


def full_name(kernel: JITFunction) -> str:
    return f"{kernel.fn.__module__}.{kernel.fn.__qualname__}"


@dataclass
class Launch:
    """One specialisation of one kernel, as Triton's launch path would compile it for the target."""

    kernel: JITFunction
    signature: dict
    constexprs: dict
    attrs: dict
    options: object
    cases: list[str] = field(default_factory=list)  # which launcher calls asked for it
    deep: bool = False  # a configuration the GPU runs: compiled through more stages

    @property
    def name(self) -> str:
        return full_name(self.kernel)

    def frontend_key(self) -> tuple:
        """What the frontend (AST -> TTIR) reads: the warps, stages and register cap act from TTGIR on, so
        launches that differ only in them share one TTIR."""
        return self.name, repr(self.signature), repr(self.constexprs), repr(self.attrs)

    def describe(self) -> dict:
        """The specialisation in words: argument types, constexpr values and launch options."""
        names = list(self.signature)
        args = {k: v for k, v in self.signature.items() if v != "constexpr"}
        consts = {names[path[0]]: _plain(value) for path, value in self.constexprs.items() if len(path) == 1}
        opts = {k: getattr(self.options, k) for k in ("num_warps", "num_stages", "maxnreg")}
        return {"args": args, "constexprs": consts, "options": opts}


def _plain(value):
    return value if isinstance(value, (bool, int, float, str, type(None))) else repr(value)


class LaunchRecorder:
    """Stands in for `JITFunction.run` while active: each launch is specialised by Triton's own binder
    for `target` and kept once per distinct specialisation; nothing runs (outputs stay uninitialised,
    which the launchers never read on the host)."""

    def __init__(self, target: GPUTarget):
        self.target = target
        self.backend = make_backend(target)
        self.launches: dict[tuple, Launch] = {}
        self.case = "?"
        self.deep = False
        self._binders: dict[JITFunction, object] = {}

    def record(self, kernel: JITFunction, args, kwargs) -> None:
        kwargs = dict(kwargs)
        kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
        binder = self._binders.get(kernel)
        if binder is None:
            binder = self._binders[kernel] = create_function_from_signature(kernel.signature, kernel.params,
                                                                            self.backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = kernel._pack_args(self.backend, kwargs, bound, specialization,
                                                                  options)
        key = (full_name(kernel), repr(specialization), repr(sorted(options.__dict__.items())))
        launch = self.launches.setdefault(key, Launch(kernel, signature, constexprs, attrs, options))
        if self.case not in launch.cases:
            launch.cases.append(self.case)
        launch.deep |= self.deep

    @contextlib.contextmanager
    def active(self):
        recorder = self

        def run(self, *args, grid, warmup, **kwargs):
            recorder.record(self, args, kwargs)

        saved = JITFunction.run
        JITFunction.run = run
        try:
            yield self
        finally:
            JITFunction.run = saved

    @contextlib.contextmanager
    def labelled(self, case: str, deep: bool = False):
        previous, self.case, self.deep = (self.case, self.deep), case, deep
        try:
            yield
        finally:
            self.case, self.deep = previous


@dataclass
class Compiled:
    """How far one specialisation got: the stages passed, with seconds from the start, or the error."""

    stages: list[tuple[str, float]]
    error: str | None = None
    failed_stage: str | None = None
    shared_bytes: int | None = None


def compile_launch(launch: Launch, target: GPUTarget, last_stage: str) -> Compiled:
    """Run the frontend (AST -> TTIR) and the backend's stages up to `last_stage`, in memory (no cache)."""
    if last_stage not in STAGES:
        raise ValueError(f"last stage must be one of {STAGES}, got {last_stage!r}")
    backend = make_backend(target)
    options = launch.options
    src = ASTSource(launch.kernel, launch.signature, launch.constexprs, launch.attrs)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    stages: dict = {}
    backend.add_stages(stages, options, src.language)
    metadata = {"hash": "compile-check", "target": target, **options.__dict__}
    start = time.perf_counter()
    done: list[tuple[str, float]] = []
    stage = "ast"
    try:
        module = src.make_ir(target, options, backend.get_codegen_implementation(options),
                             backend.get_module_map(), context)
        done.append(("ast", time.perf_counter() - start))
        for stage, run in stages.items():
            module = run(module, metadata)
            done.append((stage, time.perf_counter() - start))
            if stage == last_stage:
                break
    except Exception as e:  # noqa: BLE001 - every compiler error is the finding, reported with its stage
        message = "".join(traceback.format_exception_only(type(e), e)).strip()
        return Compiled(done, message, stage)
    shared = metadata.get("shared")
    limit = SHARED_MEMORY.get(target.arch)
    if shared is not None and limit is not None and shared > limit:
        return Compiled(done, f"needs {shared} bytes of shared memory a block, sm_{target.arch} has {limit}: "
                              f"smaller blocks or fewer stages", "shared memory", shared)
    return Compiled(done, shared_bytes=shared)


def package_modules(package: str = PACKAGE) -> list:
    root = importlib.import_module(package)
    names = [package] + [m.name for m in pkgutil.walk_packages(root.__path__, package + ".")]
    return [importlib.import_module(name) for name in names]


def jit_functions(package: str = PACKAGE) -> dict[str, JITFunction]:
    """Every @triton.jit function defined in the package, by full name."""
    found = {}
    for module in package_modules(package):
        for value in vars(module).values():
            if isinstance(value, JITFunction) and value.fn.__module__ == module.__name__:
                found[full_name(value)] = value
    return found


def called_jit_functions(kernel: JITFunction) -> dict[str, JITFunction]:
    """The @triton.jit functions a kernel calls, directly or through the helpers it calls."""
    seen: dict[str, JITFunction] = {}
    todo = [kernel]
    while todo:
        fn = todo.pop()
        for node in ast.walk(ast.parse(fn.src)):
            if not isinstance(node, ast.Call):
                continue
            callee = _resolve(node.func, fn.fn.__globals__)
            if isinstance(callee, JITFunction) and full_name(callee) not in seen:
                seen[full_name(callee)] = callee
                todo.append(callee)
    return seen


def _resolve(node, scope):
    if isinstance(node, ast.Name):
        return scope.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _resolve(node.value, scope)
        return getattr(base, node.attr, None) if base is not None else None
    return None
