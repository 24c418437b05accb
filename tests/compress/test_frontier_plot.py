"""The frontier plot: a valid PNG of sensible size, no global matplotlib state touched."""

from __future__ import annotations

import struct
from pathlib import Path

import matplotlib
import pytest

from kiln.compress.allocate import FrontierPoint, Option, pareto_frontier
from kiln.compress.frontier_plot import plot_frontier

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the PNG's IHDR chunk, which must come first."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def toy_frontier() -> list[FrontierPoint]:
    """A small real frontier: 6 layers, dense / int8 / int4 sizes, made-up losses (%)."""
    groups = [
        [
            Option("dense", 4_000_000, 0.0),
            Option("int8", 1_000_000, 0.05 * (k + 1)),
            Option("int4", 560_000, 0.4 * (k + 1)),
        ]
        for k in range(6)
    ]
    return pareto_frontier(groups)


def test_plot_writes_a_sensible_png(tmp_path: Path) -> None:
    backend = matplotlib.get_backend()
    frontier = toy_frontier()
    uniform = {"dense": (24e6, 0.0), "int8": (6e6, 1.2), "int4 g128": (3.36e6, 9.5)}
    chosen = {"plan @ 1%": (4.2e6, 0.93)}
    out = plot_frontier(
        frontier, tmp_path / "sub" / "frontier.png", uniform=uniform, chosen=chosen,
        title="toy: size vs perplexity increase",
    )  # fmt: skip
    assert out == tmp_path / "sub" / "frontier.png" and out.exists()
    width, height = png_size(out)
    assert (width, height) == (1125, 720)  # 7.5 x 4.8 inches at 150 dpi
    assert 20_000 < out.stat().st_size < 2_000_000  # drawn content, not a blank canvas
    assert matplotlib.get_backend() == backend  # the process-wide backend is untouched


def test_plot_accepts_empty_inputs_and_scales(tmp_path: Path) -> None:
    out = plot_frontier([], tmp_path / "empty.png", uniform={})
    assert png_size(out)[0] > 0
    out = plot_frontier(
        toy_frontier(), tmp_path / "scaled.png", uniform={"int8": (6e6, 1.2)}, y_scale=100.0,
        x_scale=1e-3, x_label="size (kB)", y_label="loss (%)",
    )  # fmt: skip
    assert out.stat().st_size > 10_000


def test_plot_rejects_non_finite_values(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="uniform"):
        plot_frontier([], tmp_path / "x.png", uniform={"bad": (1.0, float("nan"))})
    with pytest.raises(ValueError, match="x_scale"):
        plot_frontier([], tmp_path / "x.png", uniform={}, x_scale=0.0)


def test_log_axis_plot(tmp_path: Path) -> None:
    """Outliers thousands of percent up must not flatten the budget-sized points."""
    from kiln.compress.allocate import FrontierPoint
    from kiln.compress.frontier_plot import plot_frontier

    frontier = [FrontierPoint(4e8, 0.0, (0,)), FrontierPoint(1e8, 0.5, (1,))]
    out = plot_frontier(frontier, tmp_path / "f.png", uniform={"lowrank": (1.7e8, 16000.0)},
                        chosen={"mixed": (1e8, 0.4)}, y_log=True)  # fmt: skip
    assert out.read_bytes()[:4] == b"\x89PNG"
