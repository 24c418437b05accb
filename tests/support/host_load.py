"""A stand-in for ``kiln.core.host_load.OtherLoad`` that reads a share the test sets, so a
test of what is cached does not depend on what else this machine runs."""

from __future__ import annotations


class FixedLoad:
    """``FixedLoad.share`` (a class attribute the test sets) is what every window reads."""

    share = 0.0

    def __enter__(self) -> FixedLoad:
        return self

    def __exit__(self, *_: object) -> None:
        pass
