"""The models' structure: architectures register themselves (a new family is one module, no dispatch elsewhere),
and no import circle inside models/."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

import recurrent_cache as rc
from recurrent_cache.models import MambaModel, ModelError, load_gguf, random_model, write_gguf
from recurrent_cache.models import _registry as registry
from recurrent_cache.models.mamba import FAMILY as MAMBA

MODELS = Path(__file__).resolve().parents[2] / "src" / "recurrent_cache" / "models"


class SilentMamba(MambaModel):
    """A family of its own: Mamba-1's weights, a mixer that adds nothing to the residual."""

    def mixer(self, xp, w, u, conv, ssm, storage_r, storage_s, m):
        out, conv, ssm, steps = super().mixer(xp, w, u, conv, ssm, storage_r, storage_s, m)
        return out * 0.0, conv, ssm, steps


def silent_from_gguf(read, sizes, head, dtype, vocab):
    model = MAMBA.from_gguf(read, sizes, head, dtype, vocab)
    return SilentMamba(model.hparams, model.token_embd, model.layers, model.output_norm,
                       None if model.tied else model.output, dtype=dtype, vocab=vocab)


@pytest.fixture
def silent_family(monkeypatch):
    monkeypatch.setattr("recurrent_cache.models._registry._FAMILIES", list(registry.families()))
    return registry.register(registry.Family(
        label="Silent Mamba", gguf_arch="silent-mamba", hf_architecture="SilentMambaForCausalLM",
        model_class=SilentMamba, from_gguf=silent_from_gguf, from_hf=MAMBA.from_hf, gguf_layout=MAMBA.gguf_layout,
        write_gguf_keys=MAMBA.write_gguf_keys))


def test_a_registered_family_is_written_loaded_and_run_with_no_other_change(silent_family, tmp_path):
    pytest.importorskip("gguf", reason="writing GGUF files needs the gguf package")
    base = random_model(seed=3, n_vocab=40, n_embd=16, n_layer=2, d_state=4)
    model = SilentMamba(base.hparams, base.token_embd, base.layers, base.output_norm, base.output)
    path = tmp_path / "silent.gguf"
    write_gguf(model, path)
    loaded = load_gguf(path)
    assert type(loaded) is SilentMamba
    tokens = [1, 2, 3]
    logits = loaded.forward(loaded.new_cache().init_batch(rc.Batch(token=tokens, logits=[1] * 3)))
    # the mixers add nothing: each token's logits are those of its own embedding
    np.testing.assert_allclose(logits, loaded.logits(loaded.token_embd[tokens]), rtol=1e-6)
    assert registry.of_model(base) is MAMBA


def test_a_family_registers_once():
    with pytest.raises(ValueError, match="'mamba' is registered twice"):
        registry.register(MAMBA)


def test_an_unknown_architecture_names_the_registered_ones():
    with pytest.raises(ModelError, match=r"architecture 'llama'.*'mamba' \(Mamba-1\) and 'mamba2' \(Mamba-2\)"):
        registry.by_gguf_arch("llama")


def imports_inside_models() -> dict[str, set[str]]:
    """Each module of models/ -> the modules of models/ it imports, at the top level or in a function."""
    names = {path.stem for path in MODELS.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in MODELS.glob("*.py"):
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    targets.add(node.module.split(".")[0])
                else:
                    targets.update(alias.name for alias in node.names)
        graph[path.stem] = {t for t in targets if t in names and t != path.stem and t != "__init__"}
    return graph


def test_no_import_circle_inside_models():
    graph = imports_inside_models()
    assert not (graph["hf"] | graph["gguf_io"] | graph["torch_forward"]) & {"mamba", "mamba2"}   # no family named

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in graph[start])
    circles = sorted(module for module in graph if reaches(module, module, {module}))
    assert circles == []
