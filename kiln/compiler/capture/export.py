"""capture: PyTorch model -> kiln primitive ``Graph``.

1. ``torch.export.export`` the model in eval mode under ``torch.no_grad()``. A model
   whose Python control flow depends on tensor values (``if x.sum() > 0``, a loop
   count read with ``.item()``) cannot be exported: that raises a short
   ``CaptureError`` naming the line in the user's code and the remedies
   (``torch.compile(model, backend="kiln")``, ``torch.where``/``torch.cond``);
2. ``run_decompositions`` with the core ATen table plus ``EXTRA_DECOMPOSITIONS``
   (composites whose decompositions are already primitive-friendly);
3. walk the FX graph: parameters, buffers and lifted constants become PARAM
   values, user inputs INPUT values (call order), and each ATen call is
   lowered through the registry in ``lower.py``; a call without a lowering, or
   one its lowering rejects, becomes an ``opaque`` node (recorded as a
   ``Fallback``), never an error;
4. clean up with ``passes.optimize`` (DCE, view canonicalisation, CSE,
   constant folding, the float32/bool dtype check).

Example::

    result = capture(model, (x,))
    outs = run_graph(result.graph, [x])
    y = result.unflatten(outs)  # same pytree as model(x)
"""

from __future__ import annotations

import contextlib
import io
import logging
import operator
import os
import sys
import sysconfig
import traceback
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils._pytree import TreeSpec, tree_unflatten

from kiln.compiler.capture.builder import Builder, CaptureError, LowerResult, Unsupported, pos
from kiln.compiler.capture.lower import find_lowering
from kiln.compiler.capture.passes import optimize
from kiln.compiler.capture.rnn import rnn_decompositions
from kiln.compiler.ir.graph import Graph, TensorMeta

aten = torch.ops.aten

# Composite ops outside the core ATen table whose reference decompositions
# produce only ops that have primitive lowerings.
EXTRA_DECOMPOSITIONS = [
    aten.elu,
    aten.leaky_relu,
    aten.log2,
    aten.erfc,
    aten.sinh,
    aten.cosh,
    aten.hypot,
    aten.logsumexp,
    aten.var_mean,
    aten.linalg_vector_norm,
    aten.trunc,
]


@dataclass(frozen=True)
class Fallback:
    """An op kiln runs through PyTorch unfused, and why."""

    node_name: str
    aten_op: str
    reason: str


@dataclass
class CaptureResult:
    """A captured model: the primitive graph (flat outputs), the pytree spec
    that rebuilds the model's output structure, and the ops left opaque."""

    graph: Graph
    out_spec: TreeSpec
    fallbacks: list[Fallback] = field(default_factory=list)
    mutations: list[str] = field(default_factory=list)  # buffers/inputs the model mutates

    def unflatten(self, outputs: Sequence[torch.Tensor]) -> Any:
        """Flat graph outputs -> the model's output pytree (tuple, dict, ...)."""
        return tree_unflatten(list(outputs), self.out_spec)


def fallback_report(graph: Graph) -> list[Fallback]:
    """Every opaque node of ``graph`` with the ATen op it calls and why."""
    return [
        Fallback(n.name, str(n.attrs.get("target")), str(n.attrs.get("reason", "")))
        for n in graph.nodes
        if n.op == "opaque"
    ]


def decomposition_table() -> dict[Any, Any]:
    """Core ATen decompositions plus ``EXTRA_DECOMPOSITIONS``, with LSTM and GRU stacks
    split into whole layers rather than unrolled."""
    table: dict[Any, Any] = dict(torch.export.default_decompositions().items())
    table.update(torch._decomp.get_decompositions(EXTRA_DECOMPOSITIONS))
    return rnn_decompositions(table)  # LSTM / GRU layers stay whole (capture/rnn.py)


def export_program(
    model: torch.nn.Module, example_inputs: tuple[torch.Tensor, ...]
) -> ExportedProgram:
    """torch.export in eval/inference mode, decomposed for lowering. Control flow on
    tensor values raises ``CaptureError`` saying where (see ``data_dependent_error``)."""
    with torch.no_grad():
        with _export_output() as dumps:
            try:
                ep = torch.export.export(_eval_mode(model), tuple(example_inputs))
            except Exception as e:
                err = data_dependent_error(e, model)
                if err is None:
                    raise
                dumps.append(str(getattr(e, "partial_fx_graph", "")))
                raise err from None
        return ep.run_decompositions(decomposition_table())


def _eval_mode(model: torch.nn.Module) -> torch.nn.Module:
    """``model.eval()``; a module from ``ExportedProgram.module()`` refuses to switch mode
    (it is traced in the mode it was exported in) and is taken as it is."""
    try:
        return model.eval()
    except NotImplementedError:
        return model


# What torch.export raises when Python control flow needs a tensor's value: the
# non-strict tracer's guard failure, and strict (dynamo) export's user error.
_DATA_DEPENDENT = (
    "Could not guard on data-dependent expression",
    "Could not extract specialized integer from data-dependent expression",
    "Could not extract specialized float from data-dependent expression",
    "Dynamic control flow is not supported",
)


def _is_data_dependent(e: BaseException) -> bool:
    from torch._dynamo.exc import UserError, UserErrorType
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    if isinstance(e, GuardOnDataDependentSymNode):
        return True
    if isinstance(e, UserError) and e.error_type == UserErrorType.DYNAMIC_CONTROL_FLOW:
        return True
    return isinstance(e, RuntimeError) and any(m in str(e) for m in _DATA_DEPENDENT)


def data_dependent_error(e: BaseException, model: torch.nn.Module) -> CaptureError | None:
    """``e`` from torch.export as a short ``CaptureError`` if it is control flow on tensor
    values: where in the user's code (file:line and the source line), what torch said in
    one line, and the remedies. ``None`` for any other failure."""
    if not _is_data_dependent(e):
        return None
    where = user_frame(e)
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    first = first.split(" (unhinted")[0].split("  (Size-like")[0]
    at = (
        f"at {where.filename}:{where.lineno} in {where.name}: {(where.line or '').strip()}"
        if where is not None
        else "(torch did not say where)"
    )
    return CaptureError(
        f"kiln cannot capture {type(model).__name__}: Python control flow on a tensor's "
        f"value {at}\n"
        f"  torch.export traces one graph for all inputs and cannot decide this ({first}).\n"
        '  Use torch.compile(model, backend="kiln"), which splits the graph there and '
        "compiles the pieces around it with kiln, or rewrite it with torch.where / torch.cond."
    )


def user_frame(e: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of ``e``'s traceback in the user's code: not torch, not kiln's
    compiler, not the standard library, not generated code (``<eval_with_key>``)."""
    skip = (
        os.path.dirname(torch.__file__) + os.sep,
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,  # kiln.compiler
        sysconfig.get_paths()["stdlib"] + os.sep,
    )
    frames = [
        f
        for f in traceback.extract_tb(e.__traceback__)
        if not f.filename.startswith("<") and not os.path.abspath(f.filename).startswith(skip)
    ]
    return frames[-1] if frames else None


class _DropUserCodeNotFound(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Unable to find user code")


@contextlib.contextmanager
def _export_output() -> Iterator[list[str]]:
    """Around ``torch.export.export``: what it prints to stderr passes through, except the
    partial graph it dumps on a failure the caller explains itself (the caller appends
    that text to the yielded list), and the symbolic-shapes logger's "Unable to find user
    code" line that comes with it."""
    dumps: list[str] = []
    real = sys.stderr
    buf = io.StringIO()
    shapes_log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    quiet = _DropUserCodeNotFound()
    shapes_log.addFilter(quiet)
    try:
        with contextlib.redirect_stderr(buf):
            yield dumps
    finally:
        shapes_log.removeFilter(quiet)
        text = buf.getvalue()
        for dump in filter(None, dumps):
            text = text.replace(dump + "\n", "")
        if text.strip():
            real.write(text)


def capture(model: torch.nn.Module, example_inputs: tuple[torch.Tensor, ...]) -> CaptureResult:
    """Capture ``model`` at the (static) shapes of ``example_inputs`` as a
    primitive graph; see the module docstring for the steps."""
    ep = export_program(model, example_inputs)
    with torch.no_grad():
        graph, mutations = to_graph(ep)
        graph = optimize(graph)
    if mutations:
        warnings.warn(f"kiln capture ignores in-place updates of {mutations}", stacklevel=2)
    spec = ep.call_spec.out_spec
    if spec is None:
        raise CaptureError("exported program has no output spec")
    return CaptureResult(graph, spec, fallback_report(graph), mutations)


def _constant_data(ep: ExportedProgram, target: str) -> torch.Tensor:
    if target in ep.state_dict:
        return ep.state_dict[target]
    data = ep.constants.get(target)
    if not isinstance(data, torch.Tensor):
        raise CaptureError(f"lifted constant {target!r} is not a tensor")
    return data


def _add_placeholders(b: Builder, ep: ExportedProgram, nodes: list[fx.Node]) -> None:
    """Parameters/buffers/constants -> PARAM (or 0-d CONST); user inputs -> INPUT."""
    by_name = {n.name: n for n in nodes}
    for spec in ep.graph_signature.input_specs:
        node = by_name[spec.arg.name]  # type: ignore[union-attr]
        if spec.kind == InputKind.USER_INPUT:
            val = node.meta.get("val")
            if not isinstance(val, torch.Tensor):
                raise CaptureError(f"user input {node.name} is not a tensor")
            b.env[node] = b.graph.add_input(node.name, TensorMeta(tuple(val.shape), val.dtype))
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            data = _constant_data(ep, str(spec.target)).detach().contiguous()
            b.env[node] = b.graph.add_constant(node.name, data)
        else:
            raise CaptureError(f"unsupported input kind {spec.kind} ({node.name})")


def _check_meta(b: Builder, v: str | None, val: object, what: str) -> None:
    if v is None or not isinstance(val, torch.Tensor):
        return
    want = TensorMeta(tuple(val.shape), val.dtype)
    if b.meta(v) != want:
        raise Unsupported(f"lowering of {what} gave {b.meta(v)}, expected {want}")


def _lower(b: Builder, node: fx.Node, deferred: dict[fx.Node, str]) -> LowerResult:
    """Lower one ATen call; on failure make it opaque (multi-output ops: one
    opaque node per output actually used, created by ``_getitem``)."""
    val = node.meta.get("val")
    fn = find_lowering(node.target)
    reason = "no lowering for this op"
    if fn is not None:
        b.set_prefix(node.name)
        try:
            out = fn(b, node)
            if isinstance(out, list):
                if not isinstance(val, (tuple, list)) or len(val) != len(out):
                    raise Unsupported(f"lowering gave {len(out)} outputs for {node.target}")
                for i, v in enumerate(out):
                    _check_meta(b, v, val[i], f"{node.target}[{i}]")
            else:
                _check_meta(b, out, val, str(node.target))
            return out
        except Unsupported as e:
            reason = str(e)
        except (
            ArithmeticError,
            AttributeError,
            LookupError,
            RuntimeError,
            TypeError,
            ValueError,
        ) as e:
            # An unexpected call form must not break capture: run it through torch.
            reason = f"lowering failed: {type(e).__name__}: {e}"
    if isinstance(val, (tuple, list)):
        deferred[node] = reason
        return [None] * len(val)
    return b.opaque(node, reason)


def _getitem(b: Builder, node: fx.Node, deferred: dict[fx.Node, str]) -> str:
    src, index = pos(node)[:2]
    outs = b.env.get(src)
    if not isinstance(src, fx.Node) or not isinstance(outs, list):
        raise CaptureError(f"getitem on single-output node {src}")
    v = outs[index]
    if v is None:
        reason = deferred.get(src, f"output {index} has no primitive form")
        v = outs[index] = b.opaque(src, reason, output_index=index)
    return v


def to_graph(ep: ExportedProgram) -> tuple[Graph, list[str]]:
    """Convert a decomposed ExportedProgram to an (unoptimised) kiln Graph.
    Returns the graph and the names of buffers/inputs the program mutates."""
    fx_graph = ep.graph_module.graph
    b = Builder(Graph())
    nodes = list(fx_graph.nodes)
    _add_placeholders(b, ep, [n for n in nodes if n.op == "placeholder"])
    deferred: dict[fx.Node, str] = {}
    for node in nodes:
        if node.op == "call_function":
            if node.target is operator.getitem:
                b.env[node] = _getitem(b, node, deferred)
            elif node.meta.get("val") is None and not node.users:
                continue  # runtime assertions (_assert_tensor_metadata, ...)
            else:
                b.env[node] = _lower(b, node, deferred)
        elif node.op == "output":
            _add_outputs(b, ep, node)
        elif node.op != "placeholder":
            raise CaptureError(f"unsupported FX node {node.op} {node.target}")
    mutated = [
        str(s.target)
        for s in ep.graph_signature.output_specs
        if s.kind in (OutputKind.BUFFER_MUTATION, OutputKind.USER_INPUT_MUTATION)
    ]
    return b.graph, mutated


def _add_outputs(b: Builder, ep: ExportedProgram, node: fx.Node) -> None:
    flat: Sequence[object] = pos(node)[0]
    specs = ep.graph_signature.output_specs
    for arg, spec in zip(flat, specs, strict=True):
        if spec.kind != OutputKind.USER_OUTPUT:
            continue
        if not isinstance(arg, fx.Node):
            raise CaptureError(f"non-tensor model output {arg!r}")
        b.graph.outputs.append(b.tensor(arg))
