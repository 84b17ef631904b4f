"""How every process of a command logs: :func:`configure_logging`."""

from __future__ import annotations

import logging

__all__ = ["configure_logging"]


class _Plain(logging.Formatter):
    """"asyncinfer: message" for our lines, "asyncinfer: warning: message" above INFO,
    another library's under its name."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        source = "asyncinfer" if record.name.partition(".")[0] == "asyncinfer" else record.name
        level = "" if record.levelno <= logging.INFO else record.levelname.lower() + ": "
        return f"{source}: {level}{text}"


def configure_logging(verbose: bool, process: str = "") -> None:
    """Log to stderr: our INFO lines plain and other libraries' from WARNING, or with
    ``verbose`` every INFO line with level, logger and (in a child, ``process``) time and name.

    Logging that the caller set up already is left as it is.
    """
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
