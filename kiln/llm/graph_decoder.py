"""The decode step on a GPU as one CUDA-graph replay.

``GraphDecoder`` runs the ``Transformer`` with a *static* KV cache: positions are a
device tensor, keys and values are written with ``index_copy_`` and attention reads all
``max_len`` slots behind a mask, so a step has fixed shapes and never reads a value back
to the host. The first step is captured (after a warm-up on a side stream) as one CUDA
graph over static token/position buffers; every later step copies the token and position
in and replays it: one launch per token instead of hundreds. Compressed layers run their
GPU kernels inside the graph (the INT8/INT4 Triton GEMVs of ``kernels.gpu.woq_triton``).

Prefill runs eagerly (its shape is the prompt's). Off CUDA the same static step runs
without a graph: that is how it is tested against ``EagerDecoder`` on the CPU.
"""

from __future__ import annotations

import torch

from kiln.models.transformer import Transformer

Tensor = torch.Tensor


class GraphDecoder:
    """``Decoder`` whose ``step`` replays one CUDA graph (``graphs=False``: runs the same
    static step eagerly)."""

    def __init__(self, model: Transformer, batch: int, max_len: int, graphs: bool = True) -> None:
        self.model = model
        self.cache = model.new_cache(batch, max_len)
        self.cache.static = True
        dev = next(model.parameters()).device
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=dev)  # static inputs
        self.positions = torch.zeros(1, dtype=torch.long, device=dev)
        self.use_graph = graphs and dev.type == "cuda"
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: Tensor | None = None  # the graph's static output (B, V)

    @torch.inference_mode()
    def prefill(self, tokens: Tensor) -> Tensor:  # (B, T) -> the last position's (B, 1, V)
        return self.model(tokens.to(self.tokens.device), 0, self.cache, last_only=True)

    @torch.inference_mode()
    def step(self, tokens: Tensor, pos: int) -> Tensor:  # (B,) at position pos -> (B, V)
        if pos >= self.cache.max_len:
            raise ValueError(f"position {pos} is past the cache's {self.cache.max_len} slots")
        self.tokens.copy_(tokens[:, None], non_blocking=True)
        self.positions.fill_(pos)
        if not self.use_graph:
            return self._step()
        if self.graph is None:
            self._capture()
        assert self.graph is not None and self.logits is not None
        self.graph.replay()
        return self.logits.clone()

    def _step(self) -> Tensor:
        return self.model.forward_at(self.tokens, self.positions, self.cache)[:, 0]

    def _capture(self) -> None:
        """Warm up on a side stream (the writes it makes are the step's own: the same
        token at the same position), then capture the step."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.logits = self._step()
        self.graph = graph
