"""ModelRegistry (lazy "module:Class" entries, overrides, errors) and entry-point
plugins, including a real plugin distribution loaded in a fresh interpreter."""
import json
import logging
import os
import subprocess
import sys
import textwrap
import uuid

import pytest
import torch.nn as nn

from lane import ModelRegistry

BUILTINS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
OVERWRITE_MSG = ("Model architecture {} is already registered, and will be overwritten "
                 "by the new model class {}.")


@pytest.fixture
def registry():
    """The process-wide registry, restored to its previous entries afterwards."""
    ModelRegistry.get_supported_archs()  # make sure the built-ins are in
    entries, classes = dict(ModelRegistry._entries), dict(ModelRegistry._classes)
    try:
        yield ModelRegistry
    finally:
        ModelRegistry._entries.clear()
        ModelRegistry._entries.update(entries)
        ModelRegistry._classes.clear()
        ModelRegistry._classes.update(classes)


@pytest.fixture
def tmp_module(tmp_path, monkeypatch):
    """Write an importable module with a unique name; return its name."""
    created = []

    def make(source: str) -> str:
        name = f"lane_test_mod_{uuid.uuid4().hex[:10]}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        created.append(name)
        return name

    monkeypatch.syspath_prepend(str(tmp_path))
    yield make
    for name in created:
        sys.modules.pop(name, None)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and r.name == "lane.registry"]


# -- built-ins ----------------------------------------------------------------

def test_builtins_listed_and_resolved(registry):
    archs = registry.get_supported_archs()
    assert set(BUILTINS) <= set(archs)
    assert archs == sorted(archs)
    for arch, mod in BUILTINS.items():
        cls, got = registry.resolve_model_cls([arch])
        assert got == arch
        assert cls.__module__ == f"lane.model_executor.models.{mod}"
        assert cls.__name__ == arch
        assert cls is getattr(sys.modules[cls.__module__], arch)
        assert issubclass(cls, nn.Module)
        assert registry.get_entry(arch).source == "built-in"
    # a plain string works as well as a list; the class is cached
    assert registry.resolve_model_cls("Qwen2ForCausalLM")[0] is registry.resolve_model_cls(["Qwen2ForCausalLM"])[0]


def test_first_registered_architecture_wins(registry):
    cls, arch = registry.resolve_model_cls(["NotAModelForCausalLM", "MistralForCausalLM", "LlamaForCausalLM"])
    assert arch == "MistralForCausalLM" and cls.__name__ == "MistralForCausalLM"


def test_builtins_are_imported_lazily():
    """Listing the registry imports no model code; resolving imports only what is needed."""
    code = textwrap.dedent("""
        import json, sys
        from lane import ModelRegistry
        def loaded():
            return sorted(m for m in sys.modules if m.startswith("lane.model_executor.models."))
        archs = ModelRegistry.get_supported_archs()
        before = loaded()
        cls, arch = ModelRegistry.resolve_model_cls(["Qwen3ForCausalLM"])
        print(json.dumps({"archs": archs, "before": before, "after": loaded()}))
    """)
    out, _ = run_python(code)
    assert set(BUILTINS) <= set(out["archs"])
    assert out["before"] == []
    assert "lane.model_executor.models.qwen3" in out["after"]
    assert "lane.model_executor.models.mistral" not in out["after"]
    assert "lane.model_executor.models.qwen2" not in out["after"]


def test_string_registration_is_lazy(registry, tmp_module, caplog):
    name = tmp_module("""
        import torch.nn as nn
        class TinyLM(nn.Module):
            pass
    """)
    with caplog.at_level(logging.WARNING):
        registry.register_model("TinyLMForTest", f"{name}:TinyLM")
    assert warnings_of(caplog) == []  # a new name overrides nothing
    assert name not in sys.modules
    assert "TinyLMForTest" in registry.get_supported_archs()
    assert registry.get_entry("TinyLMForTest").class_path == f"{name}:TinyLM"
    assert name not in sys.modules
    cls, arch = registry.resolve_model_cls(["TinyLMForTest"])
    assert name in sys.modules
    assert cls is sys.modules[name].TinyLM and arch == "TinyLMForTest"


def test_register_class_object(registry):
    class Direct(nn.Module):
        pass

    registry.register_model("DirectForTest", Direct)
    assert registry.resolve_model_cls("DirectForTest") == (Direct, "DirectForTest")
    assert registry.get_entry("DirectForTest").class_path == f"{__name__}:{Direct.__qualname__}"


# -- overriding -----------------------------------------------------------------

def test_override_with_class_warns_and_replaces(registry, caplog):
    from lane.model_executor.models.llama import LlamaForCausalLM

    class MyLlama(LlamaForCausalLM):
        pass

    builtin = registry.resolve_model_cls("LlamaForCausalLM")[0]  # cached before the override
    assert builtin is LlamaForCausalLM
    with caplog.at_level(logging.WARNING):
        registry.register_model("LlamaForCausalLM", MyLlama)
    path = f"{MyLlama.__module__}:{MyLlama.__qualname__}"
    assert warnings_of(caplog) == [OVERWRITE_MSG.format("LlamaForCausalLM", path)]
    assert registry.resolve_model_cls(["LlamaForCausalLM"]) == (MyLlama, "LlamaForCausalLM")
    entry = registry.get_entry("LlamaForCausalLM")
    assert entry.source == "register_model()"
    assert [e.class_path for e in entry.overrode] == ["lane.model_executor.models.llama:LlamaForCausalLM"]


def test_override_with_string_warns_and_chains(registry, tmp_module, caplog):
    name = tmp_module("""
        from lane.model_executor.models.qwen2 import Qwen2ForCausalLM
        class Q2a(Qwen2ForCausalLM):
            pass
        class Q2b(Qwen2ForCausalLM):
            pass
    """)
    with caplog.at_level(logging.WARNING):
        registry.register_model("Qwen2ForCausalLM", f"{name}:Q2a")
        registry.register_model("Qwen2ForCausalLM", f"{name}:Q2b")
    assert warnings_of(caplog) == [
        OVERWRITE_MSG.format("Qwen2ForCausalLM", f"{name}:Q2a"),
        OVERWRITE_MSG.format("Qwen2ForCausalLM", f"{name}:Q2b"),
    ]
    cls, _ = registry.resolve_model_cls("Qwen2ForCausalLM")
    assert cls.__qualname__ == "Q2b" and cls.__module__ == name
    assert [e.class_path for e in registry.get_entry("Qwen2ForCausalLM").overrode] == [
        f"{name}:Q2a", "lane.model_executor.models.qwen2:Qwen2ForCausalLM"]


def test_registry_fixture_restored_builtin():
    # runs after the override tests: the built-in entries are back
    from lane.model_executor.models.llama import LlamaForCausalLM
    from lane.model_executor.models.qwen2 import Qwen2ForCausalLM

    assert ModelRegistry.resolve_model_cls("LlamaForCausalLM")[0] is LlamaForCausalLM
    assert ModelRegistry.resolve_model_cls("Qwen2ForCausalLM")[0] is Qwen2ForCausalLM


# -- bad input ------------------------------------------------------------------

@pytest.mark.parametrize("arch", [None, 42, b"LlamaForCausalLM", ""])
def test_bad_arch_type(registry, arch):
    before = registry.get_supported_archs()
    with pytest.raises(TypeError, match="model_arch"):
        registry.register_model(arch, "lane.model_executor.models.llama:LlamaForCausalLM")
    assert registry.get_supported_archs() == before


@pytest.mark.parametrize("target", ["no_colon", "a:b:c", ":Cls", "pkg.mod:", ""])
def test_bad_target_string(registry, target):
    before = registry.get_supported_archs()
    with pytest.raises(ValueError, match="pkg.module:ClassName"):
        registry.register_model("BadForTest", target)
    assert registry.get_supported_archs() == before


@pytest.mark.parametrize("target", [int, object, nn.Linear(2, 2), 3.5, None])
def test_bad_target_class(registry, target):
    with pytest.raises(TypeError, match="nn.Module subclass"):
        registry.register_model("BadForTest", target)
    assert registry.get_entry("BadForTest") is None


@pytest.mark.parametrize("archs", [["NopeForCausalLM"], "NopeForCausalLM", [], None])
def test_unregistered_architecture(registry, archs):
    with pytest.raises(ValueError) as ei:
        registry.resolve_model_cls(archs)
    msg = str(ei.value)
    if archs:
        assert "NopeForCausalLM" in msg
    assert "Registered architectures" in msg
    for arch in BUILTINS:
        assert arch in msg


def test_missing_module_reported_at_resolve(registry):
    target = f"no_such_pkg_{uuid.uuid4().hex[:8]}.model:Ghost"
    registry.register_model("GhostForCausalLM", target)  # lazy: fine until resolved
    for _ in range(2):  # a failed import is not cached
        with pytest.raises(ValueError) as ei:
            registry.resolve_model_cls(["GhostForCausalLM"])
        assert target in str(ei.value) and "GhostForCausalLM" in str(ei.value)


def test_missing_class_reported_at_resolve(registry):
    registry.register_model("NoClassForCausalLM", "lane.model_executor.models.llama:NoSuchClass")
    with pytest.raises(ValueError, match="lane.model_executor.models.llama:NoSuchClass"):
        registry.resolve_model_cls("NoClassForCausalLM")


# -- plugins: a real distribution on sys.path, in a fresh interpreter -------------

PLUGIN_INIT = '''
from lane import ModelRegistry

CALLS = []


def register():
    CALLS.append("register")
    ModelRegistry.register_model("LlamaForCausalLM", "fake_lane_plugin.model:PluginLlama")


def broken():
    raise RuntimeError("plugin exploded")
'''

PLUGIN_MODEL = '''
from lane.model_executor.models.llama import LlamaForCausalLM


class PluginLlama(LlamaForCausalLM):
    instances = 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        PluginLlama.instances += 1
        self.built_by_plugin = True
'''

PLUGIN_PLATFORMS = '''
class FakePlatform:
    device_type = "fake"


def present():
    return "fake_lane_plugin.platforms:FakePlatform"


def absent():
    return None


def boom():
    raise RuntimeError("platform probe exploded")
'''

# a platform that picks its own attention backend: dense paged attention whose layer
# counts its calls and always takes the plain-torch decode path
PLUGIN_BACKEND = '''
from lane.attention.backends import PagedSDPABackend
from lane.model_executor.layers import attention
from lane.platform import AttentionBackendChoice, Platform

CALLS = []


class TorchPagedAttention(attention.Attention):
    def forward(self, q, k, v):
        CALLS.append(q.shape[0])
        usable, attention.cpu_kernels.usable = attention.cpu_kernels.usable, lambda t: False
        try:
            return super().forward(q, k, v)
        finally:
            attention.cpu_kernels.usable = usable


class TorchPagedBackend(PagedSDPABackend):
    name = "torch_paged"
    impl = "fake_lane_plugin.backend:TorchPagedAttention"


class BackendPlatform(Platform):
    def get_attn_backend(self, hf_config):
        return AttentionBackendChoice("fake_lane_plugin.backend:TorchPagedBackend", "the plugin platform's choice")


def present():
    return "fake_lane_plugin.backend:BackendPlatform"
'''

DEFAULT_GENERAL = {"fake": "fake_lane_plugin:register"}
DEFAULT_PLATFORM = {"fake_present": "fake_lane_plugin.platforms:present",
                    "fake_absent": "fake_lane_plugin.platforms:absent"}


def make_plugin_dist(root, general=DEFAULT_GENERAL, platform=DEFAULT_PLATFORM):
    """An installed-looking distribution: a package plus its .dist-info with entry points."""
    pkg = root / "fake_lane_plugin"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(PLUGIN_INIT)
    (pkg / "model.py").write_text(PLUGIN_MODEL)
    (pkg / "platforms.py").write_text(PLUGIN_PLATFORMS)
    (pkg / "backend.py").write_text(PLUGIN_BACKEND)
    dist = root / "fake_lane_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-lane-plugin\nVersion: 0.1\n")
    lines = ["[lane.general_plugins]", *(f"{k} = {v}" for k, v in general.items()), "",
             "[lane.platform_plugins]", *(f"{k} = {v}" for k, v in platform.items()), ""]
    (dist / "entry_points.txt").write_text("\n".join(lines))
    return root


def run_python(code: str, path=None, env_extra=None, timeout=180):
    env = dict(os.environ)
    env.pop("LANE_PLUGINS", None)
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_VERBOSITY"] = "error"
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in [str(path), env.get("PYTHONPATH", "")] if p)
    env.update(env_extra or {})
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, f"subprocess failed:\n{r.stdout}\n{r.stderr}"
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


RESOLVE_CODE = textwrap.dedent("""
    import json, logging, sys
    logging.basicConfig(level=logging.INFO)
    from lane import ModelRegistry, plugins
    cls, arch = ModelRegistry.resolve_model_cls(["LlamaForCausalLM"])
    plugins.load_general_plugins()
    plugins.load_general_plugins()
    calls = sys.modules["fake_lane_plugin"].CALLS if "fake_lane_plugin" in sys.modules else None
    entry = ModelRegistry.get_entry("LlamaForCausalLM")
    from lane.model_executor.models.llama import LlamaForCausalLM
    print(json.dumps({
        "cls": f"{cls.__module__}:{cls.__qualname__}",
        "arch": arch,
        "subclass_of_builtin": issubclass(cls, LlamaForCausalLM),
        "calls": calls,
        "source": entry.source,
        "overrode": [e.class_path for e in entry.overrode],
        "loaded": plugins.loaded_general_plugins,
        "current_plugin": plugins.current_plugin,
        "platforms": plugins.load_platform_plugins(),
    }))
""")

PLUGIN_WARNING = OVERWRITE_MSG.format("LlamaForCausalLM", "fake_lane_plugin.model:PluginLlama")


def test_plugin_distribution_overrides_builtin(tmp_path):
    root = make_plugin_dist(tmp_path)
    out, err = run_python(RESOLVE_CODE, root)
    assert out["cls"] == "fake_lane_plugin.model:PluginLlama"
    assert out["arch"] == "LlamaForCausalLM"
    assert out["subclass_of_builtin"]
    assert PLUGIN_WARNING in err
    assert "WARNING" in err and "[registry.py:" in err  # logged by lane.registry at WARNING
    # resolve loaded the plugin; two more calls to load_general_plugins did nothing
    assert out["calls"] == ["register"]
    assert err.count(PLUGIN_WARNING) == 1
    assert out["source"] == "fake (fake_lane_plugin:register)"
    assert out["overrode"] == ["lane.model_executor.models.llama:LlamaForCausalLM"]
    assert out["loaded"] == {"fake": "fake_lane_plugin:register"}
    assert out["current_plugin"] is None
    # platform plugins: the one whose device is absent (returns None) is left out
    assert out["platforms"] == {"fake_present": "fake_lane_plugin.platforms:FakePlatform"}


def test_plugin_load_does_not_import_model_module(tmp_path):
    root = make_plugin_dist(tmp_path)
    code = textwrap.dedent("""
        import json, sys
        from lane import ModelRegistry, plugins
        plugins.load_general_plugins()
        registered = "fake_lane_plugin" in sys.modules
        before = "fake_lane_plugin.model" in sys.modules
        cls, _ = ModelRegistry.resolve_model_cls("LlamaForCausalLM")
        after = "fake_lane_plugin.model" in sys.modules
        print(json.dumps({"registered": registered, "before": before, "after": after,
                          "cls": cls.__qualname__}))
    """)
    out, _ = run_python(code, root)
    assert out == {"registered": True, "before": False, "after": True, "cls": "PluginLlama"}


def test_broken_plugins_are_logged_and_skipped(tmp_path):
    root = make_plugin_dist(
        tmp_path,
        general={"broken": "fake_lane_plugin:broken", "missing": "fake_lane_plugin:nope",
                 "fake": "fake_lane_plugin:register"},
        platform={"fake_boom": "fake_lane_plugin.platforms:boom", **DEFAULT_PLATFORM})
    out, err = run_python(RESOLVE_CODE, root)
    assert out["cls"] == "fake_lane_plugin.model:PluginLlama"
    assert out["calls"] == ["register"]
    assert out["loaded"] == {"fake": "fake_lane_plugin:register"}
    assert out["current_plugin"] is None
    assert out["platforms"] == {"fake_present": "fake_lane_plugin.platforms:FakePlatform"}
    assert "Failed to load general plugin broken = fake_lane_plugin:broken" in err
    assert "RuntimeError: plugin exploded" in err
    assert "Failed to load general plugin missing = fake_lane_plugin:nope" in err
    assert "Failed to load platform plugin fake_boom" in err


def test_lane_plugins_env_selects_plugins(tmp_path):
    root = make_plugin_dist(tmp_path)
    out, err = run_python(RESOLVE_CODE, root, {"LANE_PLUGINS": "fake_absent, fake_present"})
    assert out["cls"] == "lane.model_executor.models.llama:LlamaForCausalLM"
    assert out["calls"] is None  # the plugin package was never imported
    assert out["loaded"] == {}
    assert out["source"] == "built-in"
    assert PLUGIN_WARNING not in err
    assert out["platforms"] == {"fake_present": "fake_lane_plugin.platforms:FakePlatform"}


# -- end to end: the plugin's class is the model an LLM runs --------------------

@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lane.config import ModelConfig, default_model_path

    d = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    LlamaForCausalLM(cfg).save_pretrained(d)
    ModelConfig(default_model_path()).get_tokenizer().save_pretrained(d)
    return d


def test_plugin_model_class_used_by_llm(tmp_path, tiny_llama_dir):
    root = make_plugin_dist(tmp_path / "site")
    code = textwrap.dedent(f"""
        import json, logging
        logging.basicConfig(level=logging.WARNING)
        from lane import LLM, SamplingParams
        llm = LLM({str(tiny_llama_dir)!r}, dtype="float32", kv_cache_memory_bytes=64 << 20,
                  show_progress=False)
        model = llm.engine.worker.model
        from fake_lane_plugin.model import PluginLlama
        out = llm.generate("hello", SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
        c = out[0].outputs[0]
        print(json.dumps({{
            "cls": f"{{type(model).__module__}}:{{type(model).__qualname__}}",
            "is_plugin": type(model) is PluginLlama,
            "marker": getattr(model, "built_by_plugin", False),
            "instances": PluginLlama.instances,
            "token_ids": list(c.token_ids),
            "finish_reason": c.finish_reason,
        }}))
    """)
    out, err = run_python(code, root, timeout=300)
    assert out["cls"] == "fake_lane_plugin.model:PluginLlama"
    assert out["is_plugin"] and out["marker"]
    assert out["instances"] == 1
    assert len(out["token_ids"]) == 3
    assert all(0 <= t < 49152 for t in out["token_ids"])
    assert out["finish_reason"] == "length"
    assert PLUGIN_WARNING in err


def test_platform_plugin_swaps_the_attention_backend(tmp_path, tiny_llama_dir):
    """A platform plugin's Platform subclass chooses the backend: its layer class is the one
    the model runs, traces and `lane explain` name it, and greedy tokens stay the same."""
    from lane import LLM, SamplingParams

    root = make_plugin_dist(tmp_path / "site", general={}, platform={"backend": "fake_lane_plugin.backend:present"})
    code = textwrap.dedent(f"""
        import json
        from lane import LLM, SamplingParams
        from lane.entrypoints.explain import explain
        from lane.platform import current_platform
        llm = LLM({str(tiny_llama_dir)!r}, dtype="float32", kv_cache_memory_bytes=64 << 20, show_progress=False)
        out = llm.generate({{"prompt_token_ids": list(range(5, 45))}}, SamplingParams(max_tokens=8, temperature=0),
                           use_tqdm=False)
        from fake_lane_plugin import backend
        attn = llm.engine.worker.model.model.layers[0].self_attn.attn
        print(json.dumps({{"platform": type(current_platform()).__name__, "layer": type(attn).__name__,
                          "calls": len(backend.CALLS), "trace": llm.engine.worker.runner.attention_attrs[27],
                          "explain": explain({str(tiny_llama_dir)!r}, "float32", 16, 64 << 20),
                          "tokens": list(out[0].outputs[0].token_ids)}}))
    """)
    out, _ = run_python(code, root, timeout=300)
    assert out["platform"] == "BackendPlatform" and out["layer"] == "TorchPagedAttention"
    assert out["calls"] >= 2 * 8  # every layer, every step
    assert out["trace"] == {"backend": "torch_paged", "why": "the plugin platform's choice"}
    assert "backend: torch_paged (the plugin platform's choice)" in out["explain"]
    llm = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory_bytes=64 << 20, show_progress=False)
    assert type(llm.engine.worker.model.model.layers[0].self_attn.attn).__name__ == "Attention"
    ref = llm.generate({"prompt_token_ids": list(range(5, 45))}, SamplingParams(max_tokens=8, temperature=0),
                       use_tqdm=False)
    assert out["tokens"] == list(ref[0].outputs[0].token_ids)
