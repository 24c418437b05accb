"""Running a Triton program: static buffers, launches in order, one CUDA graph.

Every value the program stores has a fixed tensor for the executor's lifetime: inputs
and outputs get static buffers, parameters are moved to the device once, intermediates
are slices of one arena laid out by the static memory plan (``fusion.program``), and
values produced by ATen calls get buffers of their own. Launch arguments are therefore
fixed at construction. On a CUDA device each kernel's launch configuration is tuned
(``tune.py``, cached on disk), then the whole program is captured once, after a warm-up
run, as one CUDA graph: a call copies the inputs in, replays the graph and
returns copies of the outputs (so a result survives the next call). If capture fails
the program runs launch by launch, and ``graph_error`` says why.

Under ``TRITON_INTERPRET=1`` the same launches run on CPU tensors through Triton's
interpreter: that is how the code generator is tested without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kiln.compiler.codegen.gpu.attention import AttentionCall, Operand3
from kiln.compiler.codegen.gpu.codegen import AtenCall, Step, TritonProgram
from kiln.compiler.codegen.gpu.source import Launch
from kiln.compiler.exec.executors import check_inputs
from kiln.compiler.exec.tune import tune
from kiln.compiler.fusion.program import Program, Slot
from kiln.compiler.ir.graph import ValueKind
from kiln.compiler.ir.layout import Access, access
from kiln.compiler.ir.semantics import eval_node
from kiln.kernels.gpu.attention import attention

Tensor = torch.Tensor


class TritonExecutor:
    """Executes ``tprog`` for ``prog`` on ``device``; ``graphs``: capture a CUDA graph
    (ignored off CUDA)."""

    def __init__(
        self, prog: Program, tprog: TritonProgram, device: torch.device, graphs: bool = True
    ) -> None:
        self.prog, self.tprog, self.device = prog, tprog, device
        g = prog.graph
        empty = lambda v: torch.empty(g.meta(v).shape, dtype=g.meta(v).dtype, device=device)  # noqa: E731
        self.inputs = [empty(v) for v in g.inputs]
        self.outputs = [empty(v) for v in g.outputs]
        self.arena = torch.empty(max(prog.arena_bytes, 64), dtype=torch.uint8, device=device)
        self.consts = {v: t.to(device) for v, t in g.constants.items()}
        self.stored: dict[str, Tensor] = {}
        for v, s in prog.storage.items():
            meta = g.meta(v)
            if s.slot == Slot.INPUT:
                t = self.inputs[s.index]
            elif s.slot == Slot.OUTPUT:
                t = self.outputs[s.index]
            elif s.slot == Slot.PARAM:
                t = self.consts[v]
            elif s.slot == Slot.ARENA:
                nbytes = meta.numel * meta.dtype.itemsize
                t = self.arena[s.offset : s.offset + nbytes].view(meta.dtype).view(meta.shape)
            else:  # produced by an ATen call: a buffer of its own
                t = empty(v)
            self.stored[v] = t
        self._steps = [self._bind(step) for step in tprog.steps]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.graph_error = ""
        self.tuned = 0  # kernels whose launch configuration was timed now (not cached)
        if device.type == "cuda":
            launches = [(s, r) for s, r in zip(tprog.steps, self._steps) if isinstance(s, Launch)]
            self.tuned = tune(launches, device)
            if graphs:
                self._capture()

    # -- running ----------------------------------------------------------------
    def __call__(self, inputs: Sequence[Tensor]) -> list[Tensor]:
        check_inputs(self.prog, inputs)
        for buf, x in zip(self.inputs, inputs):
            buf.copy_(x, non_blocking=True)
        if self.graph is not None:
            self.graph.replay()
        else:
            self._run_steps()
        return [o.clone() for o in self.outputs]

    def _run_steps(self) -> None:
        for step in self._steps:
            step()
        for j, v in self.prog.final_copies:
            self.outputs[j].copy_(self._value(v))

    def _capture(self) -> None:
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):  # compiles every kernel and settles ATen's workspaces
                    self._run_steps()
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._run_steps()
            self.graph = graph
        except Exception as err:  # noqa: BLE001 - reported, then launches run one by one
            self.graph = None
            self.graph_error = f"CUDA graph capture failed ({type(err).__name__}: {err})"

    # -- binding steps to tensors --------------------------------------------------
    def _value(self, v: str) -> Tensor:
        """A value as a tensor: its storage, a view of its root, or a constant."""
        if v in self.stored:
            return self.stored[v]
        a = self.prog.access(v)
        root = self.stored.get(a.root)
        if root is None:
            root = self.consts[a.root]
        return root.as_strided(a.shape, a.strides, root.storage_offset() + a.offset)

    def _bind(self, step: Step) -> Callable[[], None]:
        if isinstance(step, AtenCall):
            return self._bind_aten(step)
        if isinstance(step, AttentionCall):
            return self._bind_attention(step)
        args = [self.stored[r] for r in step.roots]

        def launch() -> None:  # grid and options read at call time: tuning may change them
            step.fn[step.grid](*args, **step.options)

        return launch

    def _operand(self, op: Operand3) -> Tensor:
        root = self.stored[op.root]
        return root.as_strided(op.shape, op.strides, root.storage_offset() + op.offset)

    def _bind_attention(self, call: AttentionCall) -> Callable[[], None]:
        q, k, v = self._operand(call.q), self._operand(call.k), self._operand(call.v)
        mask = None if call.mask is None else self._operand(call.mask)
        out = self.stored[call.out]

        def run() -> None:
            attention(q, k, v, scale=call.scale, mask=mask, out=out)

        return run

    def _bind_aten(self, call: AtenCall) -> Callable[[], None]:
        g = self.prog.graph
        k = self.prog.kernels[call.kernel]
        nodes = [g.node(n) for n in k.nodes]
        inside = {n.output for n in nodes}
        ext = {v: self._value(v) for n in nodes for v in n.inputs if v not in inside}
        for v in ext:
            if g.values[v].kind == ValueKind.CONST:
                ext[v] = self.consts[v]
        outs = [(o, self.stored[o]) for o in k.outputs]
        if not nodes:  # a copy kernel: materialise a view
            src = {o: self._value_of_view(o) for o in k.outputs}

            def run_copy() -> None:
                for o, dst in outs:
                    dst.copy_(src[o])

            return run_copy

        def run() -> None:
            env = dict(ext)
            for n in nodes:
                env[n.output] = eval_node(
                    n, [env[i] if i in env else self._view_of(i, env) for i in n.inputs]
                )
            for o, dst in outs:
                dst.copy_(env[o])

        return run

    def _value_of_view(self, v: str) -> Tensor:
        a = access(self.prog.graph, v, [s for s in self.prog.storage if s != v])
        assert isinstance(a, Access)
        root = self.stored[a.root]
        return root.as_strided(a.shape, a.strides, root.storage_offset() + a.offset)

    def _view_of(self, v: str, env: dict[str, Tensor]) -> Tensor:
        """A layout view of an in-kernel value, derived from its producer's input."""
        p = self.prog.graph.producer(v)
        assert p is not None
        return eval_node(p, [env[i] if i in env else self._view_of(i, env) for i in p.inputs])
