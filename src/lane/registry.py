"""ModelRegistry: architecture name -> implementation class (seed step 3).

Entries are ``"pkg.module:Class"`` strings imported on first use (lazy, as in
vLLM: importing model code early would initialise devices in the parent of a
forked process). A later registration of the same name overrides the earlier
one with a logged warning; that is how a plugin replaces a built-in model.
"""
from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field

import torch.nn as nn

from lane import plugins

logger = logging.getLogger(__name__)


def _known_unsupported() -> dict[str, str]:
    """The models table's known-and-refused names (imported when needed, as the table is)."""
    from lane.model_executor.models import KNOWN_UNSUPPORTED

    return KNOWN_UNSUPPORTED


@dataclass
class RegistryEntry:
    target: str | type  # "module:Class" or an nn.Module subclass
    source: str  # "built-in" or the plugin that registered it
    overrode: list["RegistryEntry"] = field(default_factory=list)

    @property
    def class_path(self) -> str:
        if isinstance(self.target, str):
            return self.target
        return f"{self.target.__module__}:{self.target.__qualname__}"


class _ModelRegistry:
    def __init__(self) -> None:
        self._entries: dict[str, RegistryEntry] = {}
        self._classes: dict[str, type] = {}
        self._builtins_loaded = False

    def _ensure_builtins(self) -> None:
        if self._builtins_loaded:
            return
        self._builtins_loaded = True
        from lane.model_executor.models import BUILTIN_MODELS

        for arch, target in BUILTIN_MODELS.items():
            self._entries.setdefault(arch, RegistryEntry(target, "built-in"))

    def register_model(self, model_arch: str, model_cls: str | type) -> None:
        """Register ``model_arch`` -> ``"pkg.module:Class"`` (or a class)."""
        if not isinstance(model_arch, str) or not model_arch:
            raise TypeError(f"model_arch must be a non-empty str, got {model_arch!r}")
        if isinstance(model_cls, str):
            parts = model_cls.split(":")
            if len(parts) != 2 or not all(parts):
                raise ValueError(
                    f"Expected a string of the form 'pkg.module:ClassName' for "
                    f"{model_arch}, got {model_cls!r}"
                )
        elif not (isinstance(model_cls, type) and issubclass(model_cls, nn.Module)):
            raise TypeError(
                f"model_cls for {model_arch} must be 'pkg.module:ClassName' or an "
                f"nn.Module subclass, got {model_cls!r}"
            )
        self._ensure_builtins()
        source = plugins.current_plugin or "register_model()"
        entry = RegistryEntry(model_cls, source)
        if model_arch in self._entries:
            old = self._entries[model_arch]
            entry.overrode = [old, *old.overrode]
            logger.warning(
                "Model architecture %s is already registered, and will be "
                "overwritten by the new model class %s.", model_arch, entry.class_path)
        self._entries[model_arch] = entry
        self._classes.pop(model_arch, None)

    def get_supported_archs(self) -> list[str]:
        self._ensure_builtins()
        return sorted(self._entries)

    def get_entry(self, model_arch: str) -> RegistryEntry | None:
        self._ensure_builtins()
        return self._entries.get(model_arch)

    def resolve_model_cls(self, architectures: list[str] | str) -> tuple[type, str]:
        """Return (class, arch) for the first registered name in ``architectures``."""
        plugins.load_general_plugins()
        self._ensure_builtins()
        archs = [architectures] if isinstance(architectures, str) else list(architectures or [])
        for arch in archs:
            if arch in self._entries:
                cls = self._load(arch)
                if getattr(cls, "draft_of", None):  # a draft checkpoint (MTP layers alone), not a model
                    from lane.model_executor.models.deepseek_mtp import refusal

                    raise ValueError(refusal(arch, cls.draft_of))
                return cls, arch
        for arch in archs:
            if arch in _known_unsupported():
                raise ValueError(f"Model architecture {arch} is known and not supported: {_known_unsupported()[arch]}")
        raise ValueError(
            f"Model architectures {archs} are not supported. Registered architectures: "
            f"{', '.join(self.get_supported_archs())}. A plugin can add one with "
            f"ModelRegistry.register_model(name, 'pkg.module:Class') from a "
            f"'{plugins.GENERAL_PLUGINS_GROUP}' entry point."
        )

    def check_servable(self, architectures: list[str]) -> None:
        """Refuse, before anything loads, a draft checkpoint served as a model or an architecture
        lane knows and does not implement (unregistered ones are refused when the model loads)."""
        self._ensure_builtins()
        registered = [a for a in architectures if a in self._entries]
        if registered or any(a in _known_unsupported() for a in architectures):
            self.resolve_model_cls(registered[:1] or architectures)

    def model_class(self, arch: str) -> type:
        """The class registered for ``arch`` (imported now)."""
        self._ensure_builtins()
        return self._load(arch)

    def _load(self, arch: str) -> type:
        if arch not in self._classes:
            target = self._entries[arch].target
            if isinstance(target, str):
                module_name, cls_name = target.split(":")
                try:
                    cls = getattr(importlib.import_module(module_name), cls_name)
                except (ImportError, AttributeError) as e:
                    raise ValueError(
                        f"Cannot import {target} registered for {arch}: {e}") from e
            else:
                cls = target
            self._classes[arch] = cls
        return self._classes[arch]


ModelRegistry = _ModelRegistry()
