"""The training tool: where it writes (no JAX needed), and a few steps on a tiny configuration.

The run is marked ``training`` and needs the ``train`` extra (JAX, optax): the ``test``
extra leaves them out, so it skips there and CI runs it with ``pytest -m training``
after installing ``.[train]``.  The option tests run everywhere: they stop before
JAX is imported.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from recurrent_cache.models import ReferenceRun, load_gguf

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "train_byte_mamba.py"
SHIPPED = [REPO / "src" / "recurrent_cache" / "models" / "data" / "byte_mamba.gguf",
           REPO / "src" / "recurrent_cache" / "models" / "data" / "byte_mamba.json",
           REPO / "tests" / "data" / "byte_mamba_reference.npz",
           REPO / "tools" / "training" / "train_log.txt"]


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("train_byte_mamba", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def digests() -> dict[Path, str]:
    return {path: hashlib.sha256(path.read_bytes()).hexdigest() for path in SHIPPED}


def test_by_default_everything_goes_into_a_run_directory_beside_the_user(tool, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    options = tool.parse_args([])
    outputs = [options.out_dir, options.log_dir, options.reference_out]
    assert all((tmp_path / path).resolve().is_relative_to(tmp_path / "training-run") for path in outputs), outputs


def test_overwrite_shipped_names_the_shipped_files(tool):
    options = tool.parse_args(["--overwrite-shipped"])
    written = {options.out_dir / "byte_mamba.gguf", options.out_dir / "byte_mamba.json",
               options.reference_out, options.log_dir / "train_log.txt"}
    assert written == set(SHIPPED)


@pytest.mark.parametrize("arguments", [
    ["--out-dir", "src/recurrent_cache/models/data"],
    ["--out-dir", "tests/data/"],
    ["--out-dir", "{elsewhere}", "--reference-out", "tests/data/byte_mamba_reference.npz"],
    ["--out-dir", "{elsewhere}", "--log-dir", "tools/training"],
    ["--out-dir", "{elsewhere}", "--params-out", "src/recurrent_cache/models/data/params.npz"],
    ["--tiny", "--out-dir", "src/recurrent_cache/models/data/../data"],
    ["--overwrite-shipped", "--tiny"],
    ["--overwrite-shipped", "--out-dir", "{elsewhere}"],
])
def test_a_path_into_the_shipped_files_is_refused_in_one_line_and_nothing_is_written(arguments, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    before = digests()
    done = subprocess.run([sys.executable, str(SCRIPT), *(a.format(elsewhere=elsewhere) for a in arguments),
                           "--steps", "1"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stderr.startswith("tools/train_byte_mamba.py: ") and "--overwrite-shipped" in done.stderr
    assert digests() == before
    assert not Path("{elsewhere}").exists()


@pytest.mark.training
def test_tiny_training_run_writes_a_model_the_package_reproduces(tmp_path):
    for module in ("jax", "optax", "gguf"):
        pytest.importorskip(module, reason=f"the training run needs {module}: pip install '.[train]'")
    before = digests()
    result = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--steps", "3"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "training-run"
    model = load_gguf(run / "byte_mamba.gguf")
    assert model.hparams.n_vocab == 256 and model.vocab.kind == "bytes" and model.hparams.n_layer == 1
    recorded = np.load(run / "reference_logits.npz")
    logits = ReferenceRun(model).feed(recorded["tokens"].tolist())
    assert np.abs(logits - recorded["logits"]).max() <= 1e-4
    facts = json.loads((run / "byte_mamba.json").read_text())
    assert facts["tokens_seen"] == 3 * 2 * 32 and facts["prompts"] and 0 < facts["held_out_bits_per_byte"] < 9
    log = (run / "train_log.txt").read_text()
    assert "step      3" in log and "final: held-out" in log
    assert digests() == before
