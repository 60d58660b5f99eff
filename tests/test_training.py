"""The training script runs a few steps on a tiny configuration and writes a GGUF that loads.

Marked ``training``: needs JAX and optax (the ``test`` extra installs them on Python >= 3.10);
``pytest -m "not training"`` leaves it out.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from recurrent_cache.models import ReferenceRun, load_gguf

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "train_byte_mamba.py"

pytestmark = pytest.mark.training


def test_tiny_training_run_writes_a_model_the_package_reproduces(tmp_path):
    for module in ("jax", "optax", "gguf"):
        pytest.importorskip(module, reason="the training script needs jax, optax and gguf")
    result = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--steps", "3", "--out-dir", str(tmp_path),
                             "--log-dir", str(tmp_path), "--reference-out", str(tmp_path / "reference.npz")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    model = load_gguf(tmp_path / "byte_mamba.gguf")
    assert model.hparams.n_vocab == 256 and model.vocab.kind == "bytes" and model.hparams.n_layer == 1
    recorded = np.load(tmp_path / "reference.npz")
    logits = ReferenceRun(model).feed(recorded["tokens"].tolist())
    assert np.abs(logits - recorded["logits"]).max() <= 1e-4
    facts = json.loads((tmp_path / "byte_mamba.json").read_text())
    assert facts["tokens_seen"] == 3 * 2 * 32 and facts["prompts"] and 0 < facts["held_out_bits_per_byte"] < 9
    log = (tmp_path / "train_log.txt").read_text()
    assert "step      3" in log and "final: held-out" in log
