"""python -m kiln.cli: the kiln command (what the torchrun line of kiln run starts)."""

from kiln.cli import app

app(prog_name="kiln")
