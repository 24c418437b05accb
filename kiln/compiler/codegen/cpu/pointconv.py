"""1x1 convolutions as GEMMs through kiln's micro-kernel (``gemm.py``).

An NCHW 1x1 conv is, per image, ``out (C_out, HW) = W (C_out, C_in) @ X (C_in, HW)``:
the constant weight is the *left* operand, read in place (row-major, unit stride
along C_in, as the micro-kernel wants A); the activations are the right operand,
packed per call into column panels (each channel row of X is contiguous along HW).
The conv's bias is added per output row; the epilogue (activations, residuals) runs
on the registers as for any GEMM, and the stores along HW are contiguous.

A channels-last 1x1 conv is one plain GEMM over every pixel of the batch, like a
Linear: ``out (N*HW, C_out) = X (N*HW, C_in) @ W^T (C_in, C_out)``. The activations are
the left operand, read in place (rows of C_in contiguous channels); the weight is the
right one, packed into column panels once at compile time, so no call packs anything.
The bias is a per-column epilogue add.
"""

from __future__ import annotations

import torch

from kiln.compiler.codegen.cpu.dwconv import KernelState
from kiln.compiler.codegen.cpu.emit import Operand, supports_pointwise
from kiln.compiler.codegen.cpu.gemm import GemmSpec, emit_gemm
from kiln.compiler.codegen.cpu.pack import pack_b
from kiln.compiler.fusion.convs import is_channels_last, is_pointwise_conv
from kiln.compiler.fusion.program import Kernel
from kiln.compiler.ir.graph import Node


def flat_operand(op: Operand, shape: tuple[int, ...]) -> Operand:
    """Strides over (n, c, *spatial) as strides over (n, c, spatial flattened); ValueError
    when the spatial dims do not flatten."""
    sn, sc, *sp = op.strides
    dims = [(size, st) for size, st in zip(shape[2:], sp) if size != 1]
    for (_, outer), (size, st) in zip(dims, dims[1:]):
        if outer != st * size:
            raise ValueError("spatial dims of a 1x1 conv operand do not flatten")
    inner = dims[-1][1] if dims else 1
    return Operand(op.ptr, op.dtype, op.offset, (sn, sc, inner))


def pointconv_kernel(gen: KernelState, k: Kernel, nodes: list[Node]) -> list[str]:
    """Lower a ``gemm`` kernel that starts with a 1x1 conv (then its epilogue)."""
    g, conv = gen.g, nodes[0]
    if not is_pointwise_conv(g, conv):
        raise ValueError("not a 1x1 conv")
    if is_channels_last(conv):
        return pointconv_nhwc_kernel(gen, k, nodes)
    out_shape = g.meta(conv.output).shape
    x_shape = g.meta(conv.inputs[0]).shape
    for e in nodes[1:]:
        if not supports_pointwise(e) or g.meta(e.output).shape != out_shape:
            raise ValueError(f"epilogue op {e.op} {g.meta(e.output).shape}")
    batch, c_out, c_in = out_shape[0], out_shape[1], x_shape[1]
    spatial = 1
    for s in out_shape[2:]:
        spatial *= s

    def filters() -> torch.Tensor:  # (c_out * c_in) weights, then c_out biases
        parts = [g.constants[v].float().reshape(-1) for v in conv.inputs[1:]]
        return torch.cat(parts).contiguous()

    weights = gen.prepared_param(("conv1x1", *conv.inputs[1:]), filters)
    ext = [v for v in gen.external_inputs(nodes[1:]) if v != conv.output]
    consts = gen.consts(ext)
    spec = GemmSpec(
        batch=batch,
        m=c_out,
        k=c_in,
        n=spatial,
        a=Operand(weights, torch.float32, 0, (0, c_in, 1)),
        b=flat_operand(gen.operand(conv.inputs[0], x_shape), x_shape),
        b_packed=None,
        acc_value=conv.output,
        epilogue=tuple(nodes[1:]),
        ext={v: flat_operand(gen.operand(v, out_shape), out_shape) for v in ext if v not in consts},
        consts=consts,
        outs={v: flat_operand(gen.out_operand(v), out_shape) for v in k.outputs},
        dtypes=gen.dtypes(),
        row_bias=f"({weights} + {c_out * c_in})" if len(conv.inputs) > 2 else None,
    )
    return emit_gemm(spec, gen.nr, gen.threads)


def rows_operand(op: Operand, shape: tuple[int, ...]) -> Operand:
    """Strides over (n, *spatial, c) as GEMM strides (0, pixel, c) over the pixels of the
    whole batch; ValueError when the pixel dims do not flatten into one."""
    *sp, sc = op.strides
    dims = [(size, st) for size, st in zip(shape[:-1], sp) if size != 1]
    for (_, outer), (size, st) in zip(dims, dims[1:]):
        if outer != st * size:
            raise ValueError("pixel dims of a channels-last 1x1 conv operand do not flatten")
    return Operand(op.ptr, op.dtype, op.offset, (0, dims[-1][1] if dims else 0, sc))


def pointconv_nhwc_kernel(gen: KernelState, k: Kernel, nodes: list[Node]) -> list[str]:
    """A channels-last 1x1 conv (then its epilogue) as one GEMM with a packed constant
    weight; the bias becomes the first epilogue op (an add of a (C_out,) row)."""
    g, conv = gen.g, nodes[0]
    out_shape = g.meta(conv.output).shape  # (N, *spatial, C_out)
    x_shape = g.meta(conv.inputs[0]).shape  # (N, *spatial, C_in)
    for e in nodes[1:]:
        if not supports_pointwise(e) or g.meta(e.output).shape != out_shape:
            raise ValueError(f"epilogue op {e.op} {g.meta(e.output).shape}")
    c_out, c_in = out_shape[-1], x_shape[-1]
    pixels = 1
    for s in out_shape[:-1]:
        pixels *= s
    w_name = conv.inputs[1]

    def packed() -> torch.Tensor:  # W^T (C_in, C_out) in column panels
        w = g.constants[w_name].float().reshape(c_out, c_in)
        return pack_b(w.t().contiguous()).reshape(-1)

    b_packed = gen.prepared_param(("conv1x1_nhwc", w_name, gen.nr), packed)
    a = rows_operand(gen.operand(conv.inputs[0], x_shape), x_shape)  # (0, pixel, c_in)
    epilogue, acc, dtypes = tuple(nodes[1:]), conv.output, gen.dtypes()
    ext = {}
    if len(conv.inputs) > 2:  # acc = conv + bias: a synthetic first epilogue op
        acc, bias = f"{conv.output}__acc", conv.inputs[2]
        epilogue = (Node(f"{conv.name}__bias", "add", (acc, bias), conv.output), *epilogue)
        dtypes[acc] = torch.float32
        ext[bias] = rows_operand(gen.operand(bias, out_shape), out_shape)
    outer = [v for v in gen.external_inputs(nodes[1:]) if v != conv.output]
    consts = gen.consts(outer)
    for v in outer:
        if v not in consts:
            ext[v] = rows_operand(gen.operand(v, out_shape), out_shape)
    spec = GemmSpec(
        batch=1,
        m=pixels,
        k=c_in,
        n=c_out,
        a=a,
        b=None,
        b_packed=b_packed,
        acc_value=acc,
        epilogue=epilogue,
        ext=ext,
        consts=consts,
        outs={v: rows_operand(gen.out_operand(v), out_shape) for v in k.outputs},
        dtypes=dtypes,
    )
    return emit_gemm(spec, gen.nr, gen.threads)
