"""Compressed replacements for ``nn.Linear``.

Every class stores only its compressed tensors (as buffers, so ``state_dict`` and
safetensors carry exactly them), knows its byte size, can rebuild the dense fp32 weight,
and runs its forward through the fastest kernel for the device (``kiln.kernels.registry`` for
the quantized ones). Kernels are prepared lazily, once, and dropped whenever the buffers
move (``.to``) or are overwritten (``load_state_dict``).

The stored tensors are a format, like the packed data of torchao's tensor subclasses: their
dtypes are what the kernels and checkpoints require, and no module-wide cast changes them.
``model.half()``, ``.float()``, ``.bfloat16()``, ``.double()`` and ``.to(device, dtype)`` move
every buffer to the new device but keep its dtype; the dtype the call asks for becomes the
layer's ``compute_dtype`` instead (see ``CompressedLinear._apply``). The output always has
the input's dtype, as an ``nn.Linear``'s does after the same call.

``LAYER_KINDS`` maps the ``kind`` string saved in a checkpoint to its class: the one
registry a loader needs (``GgufLinear``, a GGUF tensor's blocks, lives in ``gguf_linear.py``
and adds itself; the package imports it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kiln.compress import quantizers as qz
from kiln.kernels.formats import dequantize_int4
from kiln.kernels.registry import int4_weight_only, int8_weight_only

Kernel = Callable[[Tensor], Tensor]
Layer = TypeVar("Layer", bound="CompressedLinear")

# The dtypes a compressed layer computes in: those a floating-point cast of a model may ask for.
COMPUTE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _keeping_dtype(fn: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """``fn`` (what ``nn.Module._apply`` maps over a module's tensors) for a tensor of a
    fixed format: a call that would change its dtype only moves it to the device ``fn``
    sends it to; any other (a device move, ``share_memory_``, ``to_empty``) runs as it is.
    ``fn`` first runs on an empty tensor of the same dtype and device, which costs nothing
    and tells which kind of call it is."""

    def apply(t: Tensor) -> Tensor:
        probe = fn(t.new_empty(0))
        return fn(t) if probe.dtype == t.dtype else t.to(probe.device)

    return apply


class CompressedLinear(nn.Module):
    """Base class: shapes, bias, byte size, kernel cache, dtype-keeping moves.

    ``compute_dtype`` (float32 when built) is the dtype the layer computes in where its
    kernel allows: the dense formats (2:4, low rank) cast their weights to it, the INT8 /
    INT4 kernels take float32 activations whatever it is on a CPU, and activations of it
    on a GPU (the Triton kernels). Floating-point casts of the
    module set it; the buffers, the bias included (an fp32 buffer of the format), keep
    their dtypes.
    """

    kind: ClassVar[str]
    bias: Tensor | None
    compute_dtype: torch.dtype

    def __init__(self, in_features: int, out_features: int, bias: Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.compute_dtype = torch.float32
        self._kernel: Kernel | None = None

    # -- what subclasses provide -------------------------------------------------------
    def meta(self) -> dict[str, Any]:
        """Everything besides the tensors that ``empty`` needs to rebuild this layer."""
        return {"in_features": self.in_features, "out_features": self.out_features}

    @classmethod
    def empty(cls, meta: dict[str, Any], has_bias: bool) -> CompressedLinear:
        """A layer of the right shapes with uninitialised buffers, for loading."""
        raise NotImplementedError

    def dense_weight(self) -> Tensor:
        """The effective weight as dense fp32: (N, K)."""
        raise NotImplementedError

    def slice_rows(self, start: int, stop: int) -> CompressedLinear:
        """The layer computing output channels [start, stop) only (tensor-parallel
        column sharding, or splitting layers that were compressed side by side)."""
        raise NotImplementedError

    def slice_cols(self, start: int, stop: int) -> CompressedLinear:
        """The layer reading input features [start, stop) only: x[..., start:stop] times
        W[:, start:stop]^T, plus the full bias (tensor-parallel row sharding; the caller
        that sums the partial products adds the bias once). Formats that store K in blocks
        accept only block boundaries and refuse others with a ValueError."""
        raise NotImplementedError

    def _check_cols(self, start: int, stop: int, multiple: int, why: str) -> None:
        if not 0 <= start < stop <= self.in_features:
            raise ValueError(
                f"{type(self).__name__}.slice_cols: [{start}, {stop}) is not a non-empty "
                f"range of its {self.in_features} input features"
            )
        for edge in (start, stop):
            if edge % multiple:
                raise ValueError(
                    f"{type(self).__name__}.slice_cols: column {edge} is not a multiple of "
                    f"{multiple} ({why}); slice [{start}, {stop}) at such boundaries"
                )

    def _bias_all(self) -> Tensor | None:
        return None if self.bias is None else self.bias.clone()

    def _bias_rows(self, start: int, stop: int) -> Tensor | None:
        return None if self.bias is None else self.bias[start:stop].clone()

    def _sliced(self, part: Layer) -> Layer:
        """``part``, a slice of this layer, computing in this layer's dtype."""
        part.compute_dtype = self.compute_dtype
        return part

    def _kernel_dtype(self) -> torch.dtype:
        """The dtype the kernel takes x in (and returns y in): the compute dtype."""
        return self.compute_dtype

    def _build_kernel(self) -> Kernel:
        """x (..., K) -> x W^T (..., N), without bias, x in ``_kernel_dtype``. Default: the
        dense weight in the compute dtype + F.linear."""
        w = self.dense_weight().to(self.compute_dtype)
        return lambda x: F.linear(x, w)

    # -- shared ------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes of the stored tensors (what a checkpoint of this layer holds)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def forward(self, x: Tensor) -> Tensor:  # (..., K) -> (..., N), in x's dtype
        if self._kernel is None:
            self._kernel = self._build_kernel()
        dtype = self._kernel_dtype()
        y = self._kernel(x if x.dtype == dtype else x.to(dtype))
        if self.bias is not None:
            y = y + self.bias  # fp32: a half-precision y is promoted, then rounded once
        return y.to(x.dtype)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> CompressedLinear:
        """``nn.Module._apply`` (behind ``.to``, ``.cuda``, ``.half``, ``.float``, ...) for a
        fixed format: every buffer goes to the device ``fn`` moves it to, but keeps its dtype
        (an INT4 scale stays fp16 through ``.float()``, an INT8 scale fp32 through
        ``.half()``, so nothing is rounded and the kernels still take them). The dtype ``fn``
        gives a floating weight of this layer's compute dtype, as it would an
        ``nn.Linear``'s, becomes the compute dtype; one outside ``COMPUTE_DTYPES`` (a complex
        or integer cast) is refused with a TypeError before anything moves. The kernel is
        dropped, to be rebuilt for the new device and dtype."""
        device = next((b.device for b in self.buffers()), torch.device("cpu"))
        dtype = fn(torch.empty(0, dtype=self.compute_dtype, device=device)).dtype
        if dtype not in COMPUTE_DTYPES:
            names = ", ".join(str(d) for d in COMPUTE_DTYPES)
            raise TypeError(
                f"{type(self).__name__} computes in one of {names}; it cannot be cast to {dtype}"
            )
        self._kernel = None
        super()._apply(_keeping_dtype(fn), recurse)
        self.compute_dtype = dtype
        return self

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self._kernel = None
        super()._load_from_state_dict(*args, **kwargs)

    def extra_repr(self) -> str:
        text = f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"
        if self.compute_dtype != torch.float32:
            text += f", compute_dtype={self.compute_dtype}"
        return text


class Int8Linear(CompressedLinear):
    """INT8 per-channel weights: qweight int8 (N, K), scale fp32 (N,)."""

    kind = "int8"
    qweight: Tensor
    scale: Tensor

    def __init__(self, qweight: Tensor, scale: Tensor, bias: Tensor | None) -> None:
        n, k = qweight.shape
        super().__init__(k, n, bias)
        self.register_buffer("qweight", qweight.to(torch.int8).contiguous())
        self.register_buffer("scale", scale.float().contiguous())

    @classmethod
    def empty(cls, meta: dict[str, Any], has_bias: bool) -> Int8Linear:
        n, k = meta["out_features"], meta["in_features"]
        bias = torch.zeros(n) if has_bias else None
        return cls(torch.zeros(n, k, dtype=torch.int8), torch.ones(n), bias)

    def dense_weight(self) -> Tensor:
        return self.qweight.float() * self.scale[:, None]

    def slice_rows(self, start: int, stop: int) -> Int8Linear:
        q, scale = self.qweight[start:stop].clone(), self.scale[start:stop].clone()
        return self._sliced(Int8Linear(q, scale, self._bias_rows(start, stop)))

    def slice_cols(self, start: int, stop: int) -> Int8Linear:
        self._check_cols(start, stop, 1, "any column")
        q = self.qweight[:, start:stop].clone()  # per-channel scales cover every column
        return self._sliced(Int8Linear(q, self.scale.clone(), self._bias_all()))

    def _kernel_dtype(self) -> torch.dtype:
        # kiln's CPU INT8 kernels take float32 activations; its Triton ones any float dtype
        return self.compute_dtype if self.qweight.is_cuda else torch.float32

    def _build_kernel(self) -> Kernel:
        return int8_weight_only(self.qweight, self.scale)


class Int4Linear(CompressedLinear):
    """INT4 group-wise weights: packed uint8 (N, K/2), scale/offset fp16 (N, K/g)."""

    kind = "int4"
    packed: Tensor
    scale: Tensor
    offset: Tensor

    def __init__(
        self, packed: Tensor, scale: Tensor, offset: Tensor, group_size: int, bias: Tensor | None
    ) -> None:
        n, k = packed.shape[0], packed.shape[1] * 2
        qz.check_int4_shape(k, group_size)
        if scale.shape != (n, k // group_size) or offset.shape != scale.shape:
            raise ValueError(f"scale/offset must be {(n, k // group_size)}, got {scale.shape}")
        super().__init__(k, n, bias)
        self.group_size = group_size
        self.register_buffer("packed", packed.to(torch.uint8).contiguous())
        self.register_buffer("scale", scale.half().contiguous())
        self.register_buffer("offset", offset.half().contiguous())

    def meta(self) -> dict[str, Any]:
        return {**super().meta(), "group_size": self.group_size}

    @classmethod
    def empty(cls, meta: dict[str, Any], has_bias: bool) -> Int4Linear:
        n, k, g = meta["out_features"], meta["in_features"], meta["group_size"]
        params = torch.ones(n, k // g, dtype=torch.float16)
        bias = torch.zeros(n) if has_bias else None
        return cls(torch.zeros(n, k // 2, dtype=torch.uint8), params, params.clone(), g, bias)

    def dense_weight(self) -> Tensor:
        return dequantize_int4(self.packed, self.scale, self.offset, self.group_size)

    def slice_rows(self, start: int, stop: int) -> Int4Linear:
        return self._sliced(Int4Linear(
            self.packed[start:stop].clone(), self.scale[start:stop].clone(),
            self.offset[start:stop].clone(),
            self.group_size, self._bias_rows(start, stop),
        ))  # fmt: skip

    def slice_cols(self, start: int, stop: int) -> Int4Linear:
        g = self.group_size
        self._check_cols(start, stop, g, f"INT4 groups are {g} columns wide")
        return self._sliced(Int4Linear(
            self.packed[:, start // 2 : stop // 2].clone(),  # two columns per byte
            self.scale[:, start // g : stop // g].clone(),
            self.offset[:, start // g : stop // g].clone(),
            g, self._bias_all(),
        ))  # fmt: skip

    def _kernel_dtype(self) -> torch.dtype:
        # kiln's CPU INT4 kernels take float32 activations; its Triton ones any float dtype
        return self.compute_dtype if self.packed.is_cuda else torch.float32

    def _build_kernel(self) -> Kernel:
        return int4_weight_only(self.packed, self.scale, self.offset, self.group_size)


class Sparse24Linear(CompressedLinear):
    """2:4 sparse weights stored compressed: the kept values (N, K/2) fp32 and their
    positions, 2 bits each, packed 4 per byte (N, K/8) uint8.

    On a GPU with semi-structured sparse kernels for the compute dtype (fp16 and bf16 with
    cuSPARSELt: after ``.half()``) the forward uses them; elsewhere the dense weight is
    rebuilt once in the compute dtype and used with F.linear (correct, not faster).
    """

    kind = "2:4"
    values: Tensor
    positions: Tensor

    def __init__(self, values: Tensor, positions: Tensor, bias: Tensor | None) -> None:
        n, k = values.shape[0], values.shape[1] * 2
        super().__init__(k, n, bias)
        self.register_buffer("values", values.float().contiguous())
        self.register_buffer("positions", positions.to(torch.uint8).contiguous())

    @classmethod
    def from_dense(cls, w: Tensor, bias: Tensor | None) -> Sparse24Linear:
        """(N, K) weights with at most 2 nonzeros per group of 4 inputs."""
        n, k = w.shape
        groups = w.float().reshape(n, k // 4, 4)
        nonzero = (groups != 0).sum(-1)
        if bool((nonzero > 2).any()):
            raise ValueError("weight is not 2:4 sparse (a group of 4 has > 2 nonzeros)")
        # positions of the 2 kept entries per group: nonzeros first, ties by index
        order = torch.argsort((groups == 0).to(torch.int8), dim=-1, stable=True)[..., :2]
        pos = order.sort(dim=-1).values  # (N, K/4, 2) ascending
        values = torch.gather(groups, -1, pos).reshape(n, k // 2)
        nib = (pos[..., 0] | (pos[..., 1] << 2)).to(torch.uint8)  # (N, K/4) one nibble per group
        return cls(values, nib[:, 0::2] | (nib[:, 1::2] << 4), bias)

    @classmethod
    def empty(cls, meta: dict[str, Any], has_bias: bool) -> Sparse24Linear:
        n, k = meta["out_features"], meta["in_features"]
        bias = torch.zeros(n) if has_bias else None
        return cls(torch.zeros(n, k // 2), torch.zeros(n, k // 8, dtype=torch.uint8), bias)

    def dense_weight(self) -> Tensor:
        n, k = self.out_features, self.in_features
        nib = torch.stack((self.positions & 0xF, self.positions >> 4), -1).reshape(n, k // 4)
        pos = torch.stack((nib & 3, (nib >> 2) & 3), -1).long()  # (N, K/4, 2)
        dense = torch.zeros(n, k // 4, 4, dtype=torch.float32, device=self.values.device)
        dense.scatter_(-1, pos, self.values.reshape(n, k // 4, 2))
        return dense.reshape(n, k)

    def slice_rows(self, start: int, stop: int) -> Sparse24Linear:
        return self._sliced(
            Sparse24Linear(
                self.values[start:stop].clone(),
                self.positions[start:stop].clone(),
                self._bias_rows(start, stop),
            )
        )

    def slice_cols(self, start: int, stop: int) -> Sparse24Linear:
        self._check_cols(start, stop, 4, "2:4 groups are 4 columns wide")
        if (stop - start) % 8:
            raise ValueError(
                f"Sparse24Linear.slice_cols: [{start}, {stop}) is {stop - start} columns; the "
                "format packs two 4-column groups per byte, so the width must be a multiple of 8"
            )
        n, k = self.out_features, self.in_features
        # one nibble per 4-column group: unpack, take the groups, repack two per byte
        nib = torch.stack((self.positions & 0xF, self.positions >> 4), -1).reshape(n, k // 4)
        nib = nib[:, start // 4 : stop // 4]  # (N, (stop - start) / 4)
        positions = nib[:, 0::2] | (nib[:, 1::2] << 4)
        values = self.values[:, start // 2 : stop // 2].clone()  # two kept values per group
        return self._sliced(Sparse24Linear(values, positions, self._bias_all()))

    def _build_kernel(self) -> Kernel:
        w = self.dense_weight().to(self.compute_dtype)
        if w.is_cuda:
            from kiln.kernels.gpu.sparse24 import sparse24_linear, sparse24_supported, to_sparse24

            if sparse24_supported(w.device, w.dtype):
                ws = to_sparse24(w)
                return lambda x: sparse24_linear(x, ws, None)
        return lambda x: F.linear(x, w)


class LowRankLinear(CompressedLinear):
    """W ~ U (N, r) @ V (r, K): two thin matmuls, in the compute dtype (the fp32 factors are
    cast to it once, when the kernel is built)."""

    kind = "lowrank"
    u: Tensor
    v: Tensor

    def __init__(self, u: Tensor, v: Tensor, bias: Tensor | None) -> None:
        if u.shape[1] != v.shape[0]:
            raise ValueError(f"rank mismatch: U {tuple(u.shape)}, V {tuple(v.shape)}")
        super().__init__(v.shape[1], u.shape[0], bias)
        self.register_buffer("u", u.float().contiguous())
        self.register_buffer("v", v.float().contiguous())

    @property
    def rank(self) -> int:
        return int(self.u.shape[1])

    def meta(self) -> dict[str, Any]:
        return {**super().meta(), "rank": self.rank}

    @classmethod
    def empty(cls, meta: dict[str, Any], has_bias: bool) -> LowRankLinear:
        n, k, r = meta["out_features"], meta["in_features"], meta["rank"]
        bias = torch.zeros(n) if has_bias else None
        return cls(torch.zeros(n, r), torch.zeros(r, k), bias)

    def dense_weight(self) -> Tensor:
        return self.u @ self.v

    def slice_rows(self, start: int, stop: int) -> LowRankLinear:
        return self._sliced(
            LowRankLinear(self.u[start:stop].clone(), self.v.clone(), self._bias_rows(start, stop))
        )

    def slice_cols(self, start: int, stop: int) -> LowRankLinear:
        self._check_cols(start, stop, 1, "any column")
        part = LowRankLinear(self.u.clone(), self.v[:, start:stop].clone(), self._bias_all())
        return self._sliced(part)

    def _build_kernel(self) -> Kernel:
        u, v = self.u.to(self.compute_dtype), self.v.to(self.compute_dtype)
        return lambda x: F.linear(F.linear(x, v), u)


LAYER_KINDS: dict[str, type[CompressedLinear]] = {
    cls.kind: cls for cls in (Int8Linear, Int4Linear, Sparse24Linear, LowRankLinear)
}


def dense_nbytes(layer: nn.Linear) -> int:
    """Bytes of an uncompressed linear layer's weight and bias."""
    return sum(p.numel() * p.element_size() for p in layer.parameters(recurse=False))
