"""colab/quickstart.ipynb runs top to bottom in quick mode (nbclient, a real Jupyter kernel);
colab/tpu_gpu.ipynb (not executed: needs an accelerator and a checkpoint) is valid and its code
cells parse."""

import repo_paths  # tests/repo_paths.py
import pytest
import ast
import json
import os

import nbformat
from nbclient import NotebookClient

from sao_jax.train import metric_defs

ROOT = repo_paths.ROOT


def _code(nb):
  return [c for c in nb.cells if c.cell_type == "code"]


@pytest.mark.slow
def test_quickstart_runs_in_quick_mode(tmp_path, monkeypatch):
  nb = nbformat.read(os.path.join(ROOT, "colab", "quickstart.ipynb"), as_version=4)
  run_dir = tmp_path / "run"
  monkeypatch.setenv("SAO_QUICKSTART_QUICK", "1")
  monkeypatch.setenv("SAO_QUICKSTART_RUN_DIR", str(run_dir))
  monkeypatch.setenv("PYTHONPATH", ROOT)
  NotebookClient(nb, timeout=300, kernel_name="python3",
                 resources={"metadata": {"path": ROOT}}).execute()
  outputs = [o for c in _code(nb) for o in c.outputs]
  assert not [o for o in outputs if o.output_type == "error"]
  text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
  assert "quick mode: True" in text
  # DIS cell: tokens 2 (ratio 6.686 > 1 + 5) and 4 (0.223 < 1 - 0.3) are masked: 2 of 5 actions
  assert "masked_fraction 0.4" in text
  # GAE cell, hand-worked (gamma 1, lambda 0.9, V = .4 .5 .6 | .8 .9, r = 1 on the last action):
  # A_7 = 1 - .9 = .1; A_6 = (.9 - .8) + .9 * .1 = .19; A_2 = (.8 - .6) + .9 * .19 = .371
  assert "0.371" in text and "0.19" in text
  assert "attention q_proj unchanged: True" in text
  assert "Held-out evaluation" in text and "pass@2" in text
  records = [json.loads(l) for l in open(run_dir / "metrics.jsonl")]
  assert [r["step"] for r in records if "policy_loss" in r] == [1, 2, 3]
  for key in {k for r in records for k in r} - {"step"}:
    metric_defs.describe(key)  # every logged name is in the one vocabulary (raises if not)
  hist = [r["staleness_hist"] for r in records if "policy_loss" in r]
  assert [sum(h) for h in hist] == [r["action_tokens"] for r in records if "policy_loss" in r]
  assert (run_dir / "plots" / "dashboard.png").stat().st_size > 50_000
  images = [o for o in outputs if "image/png" in o.get("data", {})]
  assert len(images) >= 3  # GAE picture, four curves, dashboard


def test_tpu_gpu_notebook_is_valid_and_parses():
  nb = nbformat.read(os.path.join(ROOT, "colab", "tpu_gpu.ipynb"), as_version=4)
  nbformat.validate(nb)
  assert _code(nb)
  for cell in _code(nb):
    src = "\n".join(l for l in cell.source.splitlines() if not l.lstrip().startswith(("!", "%")))
    ast.parse(src)
