"""How every process of a command logs: :func:`configure_logging`."""

from __future__ import annotations

import logging

__all__ = ["configure_logging"]


class _Plain(logging.Formatter):
    """"asyncinfer: [level: ]message", or another library's name in front."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        source = "asyncinfer" if record.name.partition(".")[0] == "asyncinfer" else record.name
        level = "" if record.levelno <= logging.INFO else record.levelname.lower() + ": "
        return f"{source}: {level}{text}"


def configure_logging(verbose: bool, process: str = "") -> None:
    """Log to stderr: our INFO lines plain, others' from WARNING; ``verbose``: every INFO
    line with level and logger (in a child, ``process``, also time and name)."""
    root = logging.getLogger()
    if root.handlers:
        return
    handler = logging.StreamHandler()
    if not verbose:
        handler.setFormatter(_Plain())
    elif process:
        handler.setFormatter(logging.Formatter(
            f"%(asctime)s %(levelname)s [{process}] %(name)s: %(message)s"))
    else:
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.INFO if verbose else logging.WARNING)
    logging.getLogger("asyncinfer").setLevel(logging.INFO)
