"""The argparse types of `asyncinfer bench serve`'s flags: each refuses, naming the bound, a
value out of range."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

from asyncinfer.bench.traffic import parse_mix


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def at_least_int(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``low``."""

    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text}")
        return value

    return parse


def above_zero(what: str) -> Callable[[str], float]:
    """An argparse type: a number > 0 (``inf`` included), ``what`` naming it in the error."""

    def parse(text: str) -> float:
        value = float(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"expected {what} > 0, got {text}")
        return value

    return parse


rate = above_zero("requests/s (or 'inf')")
seconds = above_zero("seconds")


def fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction with 0 <= F < 1, got {text}")
    return value


def share(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction with 0 <= F <= 1, got {text}")
    return value


def at_least(low: float) -> Callable[[str], float]:
    """An argparse type: a finite number >= ``low``."""

    def parse(text: str) -> float:
        value = float(text)
        if not low <= value < math.inf:
            raise argparse.ArgumentTypeError(f"expected a number >= {low:g}, got {text}")
        return value

    return parse


def mix(key: Callable[[str], Any], what: str,
        name: str = "NAME") -> Callable[[str], dict[Any, float]]:
    """An argparse type: ``NAME:VALUE,...`` (see ``parse_mix``)."""

    def parse(text: str) -> dict[Any, float]:
        try:
            return parse_mix(text, key, what, name)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def length_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    try:
        bounds = int(lo), int(hi)
    except ValueError:
        bounds = (0, 0)
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"expected LO,HI with 1 <= LO <= HI, got {text!r}")
    return bounds


def rate_range(text: str) -> tuple[float, float]:
    """``LO:HI`` requests/s with ``0 < LO < HI``, both finite."""
    lo, _, hi = text.partition(":")
    try:
        bounds = float(lo), float(hi)
    except ValueError:
        bounds = (0.0, 0.0)
    if not 0 < bounds[0] < bounds[1] < math.inf:
        raise argparse.ArgumentTypeError(f"expected LO:HI requests/s with 0 < LO < HI, "
                                         f"got {text!r}")
    return bounds
