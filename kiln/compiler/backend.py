"""kiln as a ``torch.compile`` backend: ``torch.compile(model, backend="kiln")``.

Registered through the ``torch_dynamo_backends`` entry point (pyproject.toml), so
importing kiln changes no global state. Dynamo hands over an FX graph per captured
region (it splits the model at control flow on tensor values, which ``kiln.compile``
cannot capture); the backend returns a ``KilnGraph`` that compiles that graph with kiln
for each new input signature (shapes, dtypes, devices and dynamo's symbolic sizes), on
the first call's real tensors, and keeps up to ``max_shapes`` programs
(``torch.compile(..., options={"max_shapes": 4})``; 8 by default).

It never runs the FX graph in kiln's place without saying so: a graph kiln cannot compile
(or that updates an input or buffer in place), a new shape past the cap, or a call that
needs gradients (kiln's programs compute none) runs as the FX graph with a
``KilnFallbackWarning`` naming the reason, recorded in ``KilnGraph.kiln_fallbacks``;
``kiln_programs`` and ``kiln_calls`` show what kiln ran.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kiln.compiler.exec.compiled import CompiledModule

Tensor = torch.Tensor
Signature = tuple[Any, ...]

MAX_SHAPES = 8  # programs kept per graph


class KilnFallbackWarning(UserWarning):
    """A graph handed to the kiln backend runs as the FX graph (unfused), and why."""


class TorchCompileGraph(torch.nn.Module):
    """One graph dynamo captured, with its non-tensor inputs (dynamo's symbolic sizes,
    scalars) fixed at one call's values: kiln compiles static shapes, tensors in."""

    def __init__(self, gm: torch.fx.GraphModule, args: Sequence[Any]) -> None:
        super().__init__()
        self.gm = gm
        # kiln's capture cache keys on module classes, not code: dynamo's graphs are all
        # GraphModules (whose code a lazy one has not even generated yet), so key on it
        self.graph_code = gm.code
        self.n_args = len(args)
        # (position, value) of each non-tensor input; part of kiln's capture-cache key
        self.bound = tuple((i, a) for i, a in enumerate(args) if not isinstance(a, Tensor))

    def forward(self, *tensors: Tensor) -> Any:
        bound = dict(self.bound)
        it = iter(tensors)
        return self.gm(*(bound[i] if i in bound else next(it) for i in range(self.n_args)))


def signature(args: Sequence[Any]) -> Signature:
    """What a compiled program is specific to: each tensor's shape, dtype and device,
    and the value of each other input."""
    return tuple(
        (tuple(a.shape), a.dtype, str(a.device)) if isinstance(a, Tensor) else ("value", a)
        for a in args
    )


class KilnGraph:
    """The callable the backend returns for one dynamo graph: kiln's program for the
    call's input signature, compiled on the first call with it.

    ``kiln_programs`` maps each signature to its ``CompiledModule`` (its ``report`` says
    what kiln chose); ``kiln_fallbacks`` lists why calls ran as the FX graph;
    ``kiln_calls`` / ``graph_calls`` count the calls each way.
    """

    def __init__(self, gm: torch.fx.GraphModule, max_shapes: int = MAX_SHAPES) -> None:
        if max_shapes < 1:
            raise ValueError("max_shapes must be >= 1")
        self.gm = gm
        self.max_shapes = max_shapes
        self.kiln_programs: dict[Signature, CompiledModule] = {}
        self.kiln_fallbacks: list[str] = []
        self.kiln_calls = 0
        self.graph_calls = 0
        self._unfused: set[Signature] = set()  # signatures kiln failed on, or past the cap
        self._warned: set[str] = set()

    def __call__(self, *args: Any) -> Any:
        tensors = [a for a in args if isinstance(a, Tensor)]
        if any(isinstance(t, torch._subclasses.FakeTensor) for t in tensors):
            return self.gm(*args)  # traced (shape propagation), not run: nothing to compile
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            self._fall_back(
                "grad",
                "inputs require grad and grad mode is on, and kiln's programs compute no "
                "gradients; call the model under torch.no_grad() or torch.inference_mode()",
            )
            return self._graph(args)
        key = signature(args)
        program = self.kiln_programs.get(key)
        if program is None:
            if key in self._unfused:
                return self._graph(args)
            program = self._compile(key, args)
            if program is None:
                return self._graph(args)
        self.kiln_calls += 1
        return program(*tensors)

    def _compile(self, key: Signature, args: Sequence[Any]) -> CompiledModule | None:
        from kiln.compiler.api import compile as kiln_compile

        shapes = [list(a.shape) if isinstance(a, Tensor) else a for a in args]
        tried = len(self.kiln_programs) + len(self._unfused)
        if tried >= self.max_shapes:
            self._unfused.add(key)
            self._fall_back(
                "cap",
                f"this graph already has {tried} input signatures (max_shapes="
                f"{self.max_shapes}); new ones, first {shapes}, run as the FX graph "
                '(raise it with torch.compile(..., options={"max_shapes": N}))',
            )
            return None
        # constants the graph reads as attributes are outside the cache key: no cache
        cache = all(n.op != "get_attr" for n in self.gm.graph.nodes)
        probe = _copies([a for a in args if isinstance(a, Tensor)])
        versions = [t._version for t in probe]
        program, why = None, ""
        try:  # (verifying runs the graph on ``probe``)
            program = kiln_compile(TorchCompileGraph(self.gm, args), probe, cache=cache)
        except Exception as e:  # noqa: BLE001 - never break the user's model: run it unfused
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            why = f"{type(e).__name__}: {first}"
        mutated = [i for i, t in enumerate(probe) if t._version != versions[i]]
        if mutated:  # kiln's program would compute the outputs and skip the updates
            why = (
                f"it updates inputs {mutated} in place (of {len(probe)}; dynamo passes "
                "parameters and buffers as inputs), which kiln's programs do not"
            )
        if program is None or mutated:
            self._unfused.add(key)
            self._fall_back(
                f"error{len(self.kiln_fallbacks)}",
                f"could not compile the graph for inputs {shapes}: {why}",
            )
            return None
        self.kiln_programs[key] = program
        return program

    def _graph(self, args: Sequence[Any]) -> Any:
        self.graph_calls += 1
        return self.gm(*args)

    def _fall_back(self, kind: str, reason: str) -> None:
        """Record and warn, once per kind: the FX graph runs instead of kiln."""
        if kind in self._warned:
            return
        self._warned.add(kind)
        self.kiln_fallbacks.append(reason)
        warnings.warn(
            f"kiln backend: {reason}; running the FX graph unfused",
            KilnFallbackWarning,
            stacklevel=3,
        )


def _copies(tensors: Sequence[Tensor]) -> list[Tensor]:
    """Inputs to compile (and verify, which runs the graph) on: copies, so a graph that
    updates an input in place is caught by its version counter and the user's tensors are
    updated once, by the call itself. Parameters (the weights) are used as they are.
    Copies are made outside inference mode: inference tensors keep no version counter."""
    with torch.inference_mode(False):
        return [t if isinstance(t, torch.nn.Parameter) else t.clone() for t in tensors]


def kiln_backend(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    options: dict[str, Any] | None = None,
) -> KilnGraph:
    """The ``torch.compile`` backend: a ``KilnGraph`` for ``gm``. Compiling waits for the
    first call, whose real tensors kiln verifies against (``example_inputs`` may be
    fake). ``options``: ``{"max_shapes": N}``, the programs kept per graph."""
    del example_inputs
    opts = dict(options or {})
    max_shapes = int(opts.pop("max_shapes", MAX_SHAPES))
    if opts:
        raise ValueError(f"kiln backend: unknown options {sorted(opts)} (known: max_shapes)")
    return KilnGraph(gm, max_shapes)
