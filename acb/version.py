"""acb's version (one place: the package, the CLI's ``--version`` and telemetry's instrumentation
scope read it from here)."""

__version__ = "0.1.0"
