"""``kiln run`` over several machines: the torchrun line every machine starts."""

from __future__ import annotations

from kiln.parallel.launch import torchrun_command


def torchrun_line(
    *,
    checkpoint: str,
    prompt: str,
    max_new_tokens: int,
    tp: int,
    pp: int,
    nnodes: int,
    rdzv_endpoint: str,
) -> list[str]:
    """The torchrun command that runs ``kiln run`` on tp x pp ranks spread evenly over
    ``nnodes`` machines meeting at ``rdzv_endpoint`` (HOST:PORT); ``ValueError`` when
    the ranks do not split evenly or the endpoint is not HOST:PORT."""
    if tp * pp % nnodes:
        raise ValueError(f"tp x pp = {tp * pp} ranks do not split over {nnodes} machines")
    program = ["-m", "kiln.cli", "run", checkpoint, "--tp", str(tp), "--pp", str(pp),
               "--prompt", prompt, "-n", str(max_new_tokens)]  # fmt: skip
    return torchrun_command(nnodes, tp * pp // nnodes, rdzv_endpoint, program)
