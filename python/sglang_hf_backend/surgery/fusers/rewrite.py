"""Rewriting a module class's ``forward`` source so it calls fused layers.

The dataflow trace says *what* can be fused; this module changes *how the code calls
it*: the class's ``forward`` is parsed with ``ast``, edited (calls of the original
projections replaced by slices of one fused call, a multiply of an activation by a
projection replaced by SGLang's act-and-mul, a residual add + norm by the fused norm),
compiled once per class in the module's own globals and bound per instance. Code whose
shape these edits cannot handle safely (calls nested in control flow, inputs reassigned
between calls, closures, name mangling) is left alone: the caller then serves unfused.
"""

from __future__ import annotations

import ast
import copy
import inspect
import textwrap
import types
from typing import Callable


class RewriteError(Exception):
    """The forward's code does not have the shape an edit needs."""


class ForwardSource:
    """The parsed ``forward`` of one class, ready for edits and recompilation."""

    def __init__(self, cls: type):
        function = cls.forward
        code = inspect.unwrap(function).__code__
        if code.co_freevars:
            raise RewriteError(f"{cls.__name__}.forward uses closure variables {code.co_freevars}")
        try:
            source = textwrap.dedent(inspect.getsource(function))
        except (OSError, TypeError) as exc:
            raise RewriteError(f"no source for {cls.__name__}.forward") from exc
        tree = ast.parse(source)
        if not tree.body or not isinstance(tree.body[0], ast.FunctionDef):
            raise RewriteError(f"{cls.__name__}.forward is not a plain function definition")
        self.cls = cls
        self.function: ast.FunctionDef = tree.body[0]
        self.globals = inspect.unwrap(function).__globals__
        self.self_name = self.function.args.args[0].arg
        for node in ast.walk(self.function):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("__")
                and not node.attr.endswith("__")
            ):
                raise RewriteError(f"{cls.__name__}.forward uses a name-mangled attribute")

    def copy(self) -> "ForwardSource":
        clone = copy.copy(self)
        clone.function = copy.deepcopy(self.function)
        return clone

    # -- finding calls ----------------------------------------------------------
    def is_child_call(self, node: ast.AST, child: str) -> bool:
        """Is ``node`` a call ``self.<child>(...)``?"""
        return (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == child
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == self.self_name
        )

    def child_calls(self, child: str) -> list[tuple[int, ast.Call]]:
        """(top-level statement index, call) of every ``self.<child>(...)``."""
        found = []
        for index, statement in enumerate(self.function.body):
            for node in ast.walk(statement):
                if self.is_child_call(node, child):
                    if _nested_in_block(statement, node):
                        raise RewriteError(f"self.{child}(...) is called inside a control-flow block")
                    found.append((index, node))
        return found

    def single_argument(self, call: ast.Call) -> ast.expr:
        if len(call.args) != 1 or call.keywords:
            raise RewriteError("projection called with other than one positional argument")
        return call.args[0]

    def assigned_names(self, start: int, stop: int) -> set[str]:
        """Names stored by top-level statements ``start`` .. ``stop - 1``."""
        names = set()
        for statement in self.function.body[start:stop]:
            for node in ast.walk(statement):
                if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    names.add(node.id)
        return names

    def self_attribute(self, name: str) -> ast.Attribute:
        return ast.Attribute(value=ast.Name(id=self.self_name, ctx=ast.Load()), attr=name, ctx=ast.Load())

    # -- building ---------------------------------------------------------------
    def compile(self) -> Callable:
        module = ast.Module(body=[self.function], type_ignores=[])
        ast.fix_missing_locations(module)
        namespace: dict = {}
        filename = f"<sglang_hf_backend rewrite of {self.cls.__module__}.{self.cls.__qualname__}.forward>"
        exec(compile(module, filename, "exec"), self.globals, namespace)
        return namespace[self.function.name]


def bind_forward(instance, function: Callable) -> None:
    """Make ``instance`` (only) run ``function`` as its forward."""
    instance.forward = types.MethodType(function, instance)


def fuse_projection_calls(source: ForwardSource, children: list[str], fused: str, sizes_attr: str) -> None:
    """Replace ``self.<child>(X)`` calls (same X) by slices of one ``self.<fused>(X)`` call.

    Inserts ``_fused_<child>, ... = self.<fused>(X).split(self.<fused>.<sizes_attr>, dim=-1)``
    before the first statement that calls one of them.
    """
    calls = {child: source.child_calls(child) for child in children}
    if any(len(found) != 1 for found in calls.values()):
        raise RewriteError("each projection must be called exactly once")
    located = [calls[child][0] for child in children]
    arguments = {ast.dump(source.single_argument(call)) for _, call in located}
    if len(arguments) != 1:
        raise RewriteError("the projections are called on different expressions")
    first = min(index for index, _ in located)
    last = max(index for index, _ in located)
    argument = source.single_argument(located[0][1])
    used = {n.id for n in ast.walk(argument) if isinstance(n, ast.Name)}
    if used & source.assigned_names(first, last):
        raise RewriteError("the projections' input is reassigned between their calls")
    aliases = {child: f"_fused_{child}" for child in children}
    for _, call in located:
        child = call.func.attr
        replace_node(source.function, call, ast.Name(id=aliases[child], ctx=ast.Load()))
    fused_call = ast.Call(func=source.self_attribute(fused), args=[copy.deepcopy(argument)], keywords=[])
    split = ast.Call(
        func=ast.Attribute(value=fused_call, attr="split", ctx=ast.Load()),
        args=[ast.Attribute(value=source.self_attribute(fused), attr=sizes_attr, ctx=ast.Load())],
        keywords=[ast.keyword(arg="dim", value=ast.Constant(-1))],
    )
    targets = ast.Tuple(elts=[ast.Name(id=aliases[c], ctx=ast.Store()) for c in children], ctx=ast.Store())
    source.function.body.insert(first, ast.Assign(targets=[targets], value=split))


def _nested_in_block(statement: ast.stmt, node: ast.AST) -> bool:
    """Is ``node`` inside a compound statement (if/for/while/with/try) of ``statement``?"""
    blocks = (ast.If, ast.For, ast.While, ast.With, ast.Try, ast.AsyncFor, ast.AsyncWith)
    if isinstance(statement, blocks):
        return True
    return any(
        isinstance(inner, blocks + (ast.Lambda, ast.FunctionDef))
        and any(child is node for child in ast.walk(inner))
        for inner in ast.walk(statement)
        if inner is not statement
    )


def replace_node(root: ast.AST, old: ast.AST, new: ast.AST) -> None:
    for parent in ast.walk(root):
        for field, value in ast.iter_fields(parent):
            if value is old:
                setattr(parent, field, new)
                return
            if isinstance(value, list):
                for i, item in enumerate(value):
                    if item is old:
                        value[i] = new
                        return
    raise RewriteError("node to replace not found")


def install_fused_layer(
    instance, originals: tuple[str, ...], fused_name: str, layer, forward: Callable
) -> None:
    """Swap ``instance``'s original child layers for one fused layer; bind the rewritten forward."""
    for child in originals:
        delattr(instance, child)
    setattr(instance, fused_name, layer)
    bind_forward(instance, forward)
