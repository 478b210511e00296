"""Entry-point plugins, loaded once per process (seed step 3).

Two groups, as vLLM has them:
- ``lane.general_plugins``: each entry is a function called with no arguments
  (typically it calls ``ModelRegistry.register_model``).
- ``lane.platform_plugins``: each entry is a function returning a
  ``"pkg.module:PlatformClass"`` string, or None when its device is absent.

Every process that resolves a model (offline LLM, engine core, workers) calls
``load_general_plugins()``; the guard flag makes repeat calls free.
"""
from __future__ import annotations

import logging
import os
from importlib.metadata import EntryPoint, entry_points
from typing import Callable

logger = logging.getLogger(__name__)

GENERAL_PLUGINS_GROUP = "lane.general_plugins"
PLATFORM_PLUGINS_GROUP = "lane.platform_plugins"

_general_plugins_loaded = False
# name of each loaded general plugin -> its entry point value, for `lane explain`
loaded_general_plugins: dict[str, str] = {}
# set while a plugin function runs, so the registry can say who registered what
current_plugin: str | None = None


def _selected(group: str) -> list[EntryPoint]:
    eps = list(entry_points(group=group))
    allowed = os.environ.get("LANE_PLUGINS")
    if allowed is not None:
        names = {n.strip() for n in allowed.split(",") if n.strip()}
        eps = [ep for ep in eps if ep.name in names]
    return eps


def load_general_plugins() -> None:
    """Call every ``lane.general_plugins`` entry once in this process."""
    global _general_plugins_loaded, current_plugin
    if _general_plugins_loaded:
        return
    _general_plugins_loaded = True
    for ep in _selected(GENERAL_PLUGINS_GROUP):
        try:
            func: Callable[[], None] = ep.load()
            current_plugin = f"{ep.name} ({ep.value})"
            func()
            loaded_general_plugins[ep.name] = ep.value
            logger.info("Loaded general plugin %s = %s", ep.name, ep.value)
        except Exception:
            logger.exception("Failed to load general plugin %s = %s", ep.name, ep.value)
        finally:
            current_plugin = None


def load_platform_plugins() -> dict[str, str]:
    """Return {plugin name: "module:Class"} for every platform plugin whose device is present."""
    found: dict[str, str] = {}
    for ep in _selected(PLATFORM_PLUGINS_GROUP):
        try:
            target = ep.load()()
        except Exception:
            logger.exception("Failed to load platform plugin %s = %s", ep.name, ep.value)
            continue
        if target is not None:
            found[ep.name] = target
    return found
