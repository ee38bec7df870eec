"""The module-level names a definition reads, by Python's scope rules: a read-only walk of that definition.

A bodies module is read only to learn, for each body, which imports it needs and which names it leaves to
the upstream module. libcst's ScopeProvider answers that for every node of the module, with two metadata
passes over the whole tree, and cost a quarter of `patchgen --check`. This walks only the definition
asked about: once per scope to collect what the scope binds (Python resolves names per scope, not per
line), once to resolve what it reads. tests/generator/test_scopes.py holds ScopeProvider as the reference.
"""

from __future__ import annotations

import dataclasses

import libcst as cst

from patchgen.codemods.names import all_import_bindings, child_nodes, dotted_name

# Calls whose string arguments are type expressions: cast(T, v) its first, TypeVar / NewType all but the first.
_TYPE_ARGUMENTS = {"typing.cast": lambda index: index == 0, "typing.TypeVar": bool, "typing.NewType": bool}
_LITERALS = {"typing.Literal", "typing_extensions.Literal"}


@dataclasses.dataclass(frozen=True)
class GlobalRead:
    """One read that no enclosing function or class scope binds: a module-level name, a builtin or nothing.

    `name` is what it binds to: the read name, or the longest dotted prefix of its attribute chain that a
    module-level `import a.b` binds ("a.b" for `a.b.c` when the module says `import a.b`).
    """

    name: str
    in_string: bool  # read inside a string annotation ("torch.Tensor"): no Name node stands for it


class _Scope:
    __slots__ = ("bound", "declared_global", "declared_nonlocal", "is_class", "parent")

    def __init__(self, parent: _Scope | None, is_class: bool = False):
        self.parent = parent
        # A function's names are local wherever they are bound in it. A class body runs top to bottom and
        # reads a module-level name until its own assignment (`IO = IO`): there, bound grows as it is read.
        self.bound: set[str] = set()
        self.declared_global: set[str] = set()
        self.declared_nonlocal: set[str] = set()
        self.is_class = is_class


@dataclasses.dataclass(frozen=True)
class ModuleScope:
    """What a module binds at module level, guarded blocks (if/try/with/for) included: they run there too."""

    # name -> the nodes that bind it, in source order: an Import/ImportFrom (`import a.b` binds "a" and
    # "a.b"), a ClassDef/FunctionDef, or the statement that assigns it
    bindings: dict[str, list[cst.CSTNode]]
    imported: dict[str, str]  # name -> the dotted object its first import binds it to ("typing.cast")

    @classmethod
    def of(cls, module: cst.Module) -> ModuleScope:
        bindings: dict[str, list[cst.CSTNode]] = {}

        def bind(name: str, node: cst.CSTNode) -> None:
            bindings.setdefault(name, []).append(node)

        for statement in module.body:
            _collect_bindings(statement, bind, statement)
        return cls(bindings, all_import_bindings(module))


def global_reads(definition: cst.FunctionDef | cst.ClassDef, enclosing_class: cst.ClassDef | None,
                 module: ModuleScope) -> list[GlobalRead]:
    """Every read in `definition` (a top-level function or class, or a method of `enclosing_class`) that
    resolves past the definition's own scopes to the module scope; in source order, repeats kept."""
    reader = _Reader(module)
    scope = None
    if enclosing_class is not None:  # the method's decorators and defaults are evaluated in the class body
        scope = _Scope(None, is_class=True)
        statements = list(enclosing_class.body.body)
        reader.collect(statements[: next(i for i, s in enumerate(statements) if s is definition)], scope)
    reader.read(definition, scope)
    return reader.found


def _collect_bindings(node: cst.CSTNode, bind, statement: cst.CSTNode) -> None:
    """Call bind(name, binding node) for each name that `node` binds in the scope it stands in.

    Nested functions, lambdas and classes bind only their own name here; a comprehension binds nothing
    here but what an assignment expression (`:=`) inside it binds, which Python puts in this scope.
    """
    kind = type(node)
    if kind is cst.FunctionDef or kind is cst.ClassDef:
        bind(node.name.value, node)
        return
    if kind is cst.Lambda:
        return
    if kind is cst.Import:
        for alias in node.names:
            if alias.asname is not None:
                _bind_target(alias.asname.name, bind, node)
            else:
                parts = dotted_name(alias.name).split(".")
                for end in range(1, len(parts) + 1):
                    bind(".".join(parts[:end]), node)
        return
    if kind is cst.ImportFrom:
        if not isinstance(node.names, cst.ImportStar):
            for alias in node.names:
                target = alias.asname.name if alias.asname is not None else alias.name
                _bind_target(target, bind, node)
        return
    if kind is cst.Assign:
        for target in node.targets:
            _bind_target(target.target, bind, statement)
    elif kind is cst.AnnAssign or kind is cst.AugAssign or kind is cst.For or kind is cst.NamedExpr:
        _bind_target(node.target, bind, statement)
    elif kind is cst.AsName:  # with ... as x, except E as x
        _bind_target(node.name, bind, statement)
    elif kind is cst.MatchAs or kind is cst.MatchStar:
        if node.name is not None:
            bind(node.name.value, statement)
    elif kind is cst.MatchMapping and node.rest is not None:
        bind(node.rest.value, statement)
    elif kind is cst.TypeAlias:
        bind(node.name.value, statement)
        return
    for child in child_nodes(node):
        _collect_bindings(child, bind, statement)


def _bind_target(target: cst.CSTNode, bind, statement: cst.CSTNode) -> None:
    kind = type(target)
    if kind is cst.Name:
        bind(target.value, statement)
    elif kind is cst.Tuple or kind is cst.List:
        for element in target.elements:
            _bind_target(element.value, bind, statement)
    elif kind is cst.StarredElement:
        _bind_target(target.value, bind, statement)
    # an attribute or a subscript stores into an object, and binds no name


class _Reader:
    def __init__(self, module: ModuleScope):
        self.module = module
        self.dotted = frozenset(name for name in module.bindings if "." in name)  # only imports bind these
        self.found: list[GlobalRead] = []
        self.in_string = False
        # Strings are code (a type written as a string) inside an annotation, and inside a typing
        # subscript or a cast() / TypeVar() argument outside one; never inside Literal[...].
        self.annotation = False
        self.hint = False
        self.literal = False

    # Scopes

    def collect(self, nodes, scope: _Scope) -> None:
        """Record what the scope binds and declares (global / nonlocal): nodes are its body."""
        for node in nodes:
            _collect_bindings(node, lambda name, _node: scope.bound.add(name), node)
        self._declarations(nodes, scope)

    def _declarations(self, nodes, scope: _Scope) -> None:
        for node in nodes:
            kind = type(node)
            if kind is cst.Global:
                scope.declared_global.update(n.name.value for n in node.names)
            elif kind is cst.Nonlocal:
                scope.declared_nonlocal.update(n.name.value for n in node.names)
            elif isinstance(node, (cst.FunctionDef, cst.ClassDef, cst.Lambda, cst.BaseExpression)):
                continue
            else:
                self._declarations(child_nodes(node), scope)

    def resolves_globally(self, name: str, scope: _Scope | None) -> bool:
        reading_scope = scope
        while scope is not None:
            # A class body's names are seen by its own statements only, not by its methods or comprehensions.
            if not scope.is_class or scope is reading_scope:
                if name in scope.declared_global:
                    return True
                if name in scope.declared_nonlocal:
                    return False  # bound by an enclosing function
                if name in scope.bound:
                    return False
            scope = scope.parent
        return True

    def note(self, chain: list[str], scope: _Scope | None) -> None:
        if not self.resolves_globally(chain[0], scope):
            return
        for end in range(len(chain), 1, -1):
            dotted = ".".join(chain[:end])
            if dotted in self.dotted:
                self.found.append(GlobalRead(dotted, self.in_string))
                return
        self.found.append(GlobalRead(chain[0], self.in_string))

    # Reads

    def read(self, node: cst.CSTNode, scope: _Scope | None) -> None:
        kind = type(node)
        handler = _READERS.get(kind)
        if handler is not None:
            handler(self, node, scope)
            return
        for child in child_nodes(node):
            self.read(child, scope)

    def read_name(self, node: cst.Name, scope) -> None:
        self.note([node.value], scope)

    def read_attribute(self, node: cst.Attribute, scope) -> None:
        attrs = []
        root: cst.CSTNode = node
        while type(root) is cst.Attribute:
            attrs.append(root.attr.value)
            root = root.value
        if type(root) is cst.Name:
            self.note([root.value, *reversed(attrs)], scope)
        else:
            self.read(root, scope)

    def read_block(self, node, scope) -> None:
        """Statements in order; in a class body each one binds its names once it has run."""
        for statement in node.body:
            self.read(statement, scope)
            self.bind_now(statement, scope)

    def bind_now(self, node: cst.CSTNode, scope, target: bool = False) -> None:
        if scope is not None and scope.is_class:
            add = scope.bound.add
            if target:
                _bind_target(node, lambda name, _node: add(name), node)
            else:
                _collect_bindings(node, lambda name, _node: add(name), node)

    def read_store(self, target: cst.CSTNode, scope) -> None:
        """An assignment target: its names are bindings, the objects it stores into are reads."""
        kind = type(target)
        if kind is cst.Name:
            return
        if kind is cst.Tuple or kind is cst.List:
            for element in target.elements:
                self.read_store(element.value, scope)
        elif kind is cst.StarredElement:
            self.read_store(target.value, scope)
        elif kind is cst.Attribute:
            self.read(target.value, scope)
        else:
            self.read(target, scope)

    def read_function(self, node: cst.FunctionDef, scope) -> None:
        for decorator in node.decorators:
            self.read(decorator, scope)
        inner = self._type_parameters(node.type_parameters, scope)
        function = _Scope(inner)
        self._parameters(node.params, inner, function)
        if node.returns is not None:
            self.read(node.returns, inner)
        self.collect([node.body], function)
        self.read(node.body, function)

    def read_lambda(self, node: cst.Lambda, scope) -> None:
        function = _Scope(scope)
        self._parameters(node.params, scope, function)
        _collect_bindings(node.body, lambda name, _node: function.bound.add(name), node.body)
        self.read(node.body, function)

    def _parameters(self, params: cst.Parameters, outer, function: _Scope) -> None:
        every = [*params.posonly_params, *params.params, *params.kwonly_params]
        for star in (params.star_arg, params.star_kwarg):
            if isinstance(star, cst.Param):
                every.append(star)
        for param in every:
            function.bound.add(param.name.value)
            if param.default is not None:
                self.read(param.default, outer)
            if param.annotation is not None:
                self.read(param.annotation, outer)

    def _type_parameters(self, parameters: cst.TypeParameters | None, scope):
        if parameters is None:
            return scope
        inner = _Scope(scope)
        for type_param in parameters.params:
            inner.bound.add(type_param.param.name.value)
        for type_param in parameters.params:
            bound = getattr(type_param.param, "bound", None)  # TypeVar only
            for expression in (bound, getattr(type_param, "default", None)):
                if expression is not None:
                    self.read(expression, inner)
        return inner

    def read_class(self, node: cst.ClassDef, scope) -> None:
        for decorator in node.decorators:
            self.read(decorator, scope)
        inner = self._type_parameters(node.type_parameters, scope)
        for arg in (*node.bases, *node.keywords):
            self.read(arg.value, inner)
        body = _Scope(inner, is_class=True)
        self._declarations([node.body], body)
        self.read(node.body, body)

    def read_comprehension(self, node, scope) -> None:
        for_in = node.for_in
        self.read(for_in.iter, scope)  # the first iterable is evaluated outside the comprehension
        inner = _Scope(scope)
        level = for_in
        while level is not None:
            _bind_target(level.target, lambda name, _node: inner.bound.add(name), level)
            level = level.inner_for_in
        level = for_in
        while level is not None:
            self.read_store(level.target, inner)
            if level is not for_in:
                self.read(level.iter, inner)
            for condition in level.ifs:
                self.read(condition.test, inner)
            level = level.inner_for_in
        if type(node) is cst.DictComp:
            self.read(node.key, inner)
            self.read(node.value, inner)
        else:
            self.read(node.elt, inner)

    def read_assign(self, node: cst.Assign, scope) -> None:
        for target in node.targets:
            self.read_store(target.target, scope)
        self.read(node.value, scope)

    def read_ann_assign(self, node: cst.AnnAssign, scope) -> None:
        self.read_store(node.target, scope)
        self.read(node.annotation, scope)
        if node.value is not None:
            self.read(node.value, scope)

    def read_aug_assign(self, node: cst.AugAssign, scope) -> None:
        self.read_store(node.target, scope)
        self.read(node.value, scope)

    def read_for(self, node: cst.For, scope) -> None:
        self.read(node.iter, scope)
        self.read_store(node.target, scope)
        self.bind_now(node.target, scope, target=True)
        self.read(node.body, scope)
        if node.orelse is not None:
            self.read(node.orelse, scope)

    def read_as_name(self, node: cst.AsName, scope) -> None:
        self.read_store(node.name, scope)
        self.bind_now(node.name, scope, target=True)

    def read_named_expr(self, node: cst.NamedExpr, scope) -> None:
        self.read(node.value, scope)
        self.read_store(node.target, scope)
        self.bind_now(node.target, scope, target=True)

    def read_del(self, node: cst.Del, scope) -> None:
        self.read_store(node.target, scope)

    def read_arg(self, node: cst.Arg, scope) -> None:
        self.read(node.value, scope)  # the keyword names the callee's parameter, not a variable

    def read_nothing(self, node, scope) -> None:
        return  # imports bind (collected per scope), global/nonlocal declare

    def read_match_as(self, node: cst.MatchAs, scope) -> None:
        if node.pattern is not None:
            self.read(node.pattern, scope)

    def read_match_keyword(self, node: cst.MatchKeywordElement, scope) -> None:
        self.read(node.pattern, scope)

    def read_match_mapping(self, node: cst.MatchMapping, scope) -> None:
        for element in node.elements:
            self.read(element.key, scope)
            self.read(element.pattern, scope)

    # Strings that are type expressions

    def read_annotation(self, node: cst.Annotation, scope) -> None:
        was = self.annotation
        self.annotation = True
        self.read(node.annotation, scope)
        self.annotation = was

    def read_call(self, node: cst.Call, scope) -> None:
        self.read(node.func, scope)
        is_type = _TYPE_ARGUMENTS.get(self._qualified(node.func, scope))
        was = self.hint
        for index, arg in enumerate(node.args):
            # A call's arguments are values (the keyword names a parameter), unless typing says they are types.
            self.hint = bool(is_type and is_type(index))
            self.read(arg.value, scope)
        self.hint = was

    def read_subscript(self, node: cst.Subscript, scope) -> None:
        self.read(node.value, scope)
        name = self._qualified(node.value, scope) if type(node.value) is cst.Name else None
        was_hint, was_literal = self.hint, self.literal
        if name is not None and name.startswith(("typing.", "typing_extensions.")):
            self.hint = True
        if name in _LITERALS:
            self.literal = True
        for element in node.slice:
            self.read(element, scope)
        self.hint, self.literal = was_hint, was_literal

    def read_string(self, node, scope) -> None:
        if not (self.annotation or self.hint) or self.literal:
            if type(node) is cst.ConcatenatedString:  # its f-string parts hold code
                self.read(node.left, scope)
                self.read(node.right, scope)
            return
        value = node.evaluated_value
        if not isinstance(value, str) or not value:
            return
        try:
            parsed = cst.parse_module(value)
        except cst.ParserSyntaxError:
            return  # not code: Python would not evaluate it either
        was = self.in_string
        self.in_string = True
        self.read(parsed, scope)
        self.in_string = was

    def read_formatted_string(self, node, scope) -> None:
        for part in node.parts:
            if type(part) is cst.FormattedStringExpression:
                self.read(part.expression, scope)
                if part.format_spec:
                    for spec in part.format_spec:
                        self.read(spec, scope)

    def _qualified(self, node: cst.CSTNode, scope) -> str | None:
        """The dotted object a module-level name (or attribute chain) stands for: `typing.cast` for `cast`
        after `from typing import cast`, or for `t.cast` after `import typing as t`; else None."""
        try:
            chain = dotted_name(node).split(".")
        except TypeError:
            return None
        origin = self.module.imported.get(chain[0])
        if origin is None or not self.resolves_globally(chain[0], scope):
            return None
        return ".".join([origin, *chain[1:]])

    def read_type_alias(self, node: cst.TypeAlias, scope) -> None:
        self.read(node.value, self._type_parameters(node.type_parameters, scope))


_READERS = {
    cst.Name: _Reader.read_name,
    cst.IndentedBlock: _Reader.read_block,
    cst.SimpleStatementSuite: _Reader.read_block,
    cst.SimpleStatementLine: _Reader.read_block,
    cst.Attribute: _Reader.read_attribute,
    cst.FunctionDef: _Reader.read_function,
    cst.Lambda: _Reader.read_lambda,
    cst.ClassDef: _Reader.read_class,
    cst.ListComp: _Reader.read_comprehension,
    cst.SetComp: _Reader.read_comprehension,
    cst.GeneratorExp: _Reader.read_comprehension,
    cst.DictComp: _Reader.read_comprehension,
    cst.Assign: _Reader.read_assign,
    cst.AnnAssign: _Reader.read_ann_assign,
    cst.AugAssign: _Reader.read_aug_assign,
    cst.For: _Reader.read_for,
    cst.AsName: _Reader.read_as_name,
    cst.NamedExpr: _Reader.read_named_expr,
    cst.Del: _Reader.read_del,
    cst.Arg: _Reader.read_arg,
    cst.Import: _Reader.read_nothing,
    cst.ImportFrom: _Reader.read_nothing,
    cst.Global: _Reader.read_nothing,
    cst.Nonlocal: _Reader.read_nothing,
    cst.MatchAs: _Reader.read_match_as,
    cst.MatchStar: _Reader.read_nothing,
    cst.MatchKeywordElement: _Reader.read_match_keyword,
    cst.MatchMapping: _Reader.read_match_mapping,
    cst.Annotation: _Reader.read_annotation,
    cst.Call: _Reader.read_call,
    cst.Subscript: _Reader.read_subscript,
    cst.SimpleString: _Reader.read_string,
    cst.ConcatenatedString: _Reader.read_string,
    cst.FormattedString: _Reader.read_formatted_string,
    cst.TypeAlias: _Reader.read_type_alias,
}
