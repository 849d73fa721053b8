"""ui/ builds figures and rows from data: it reads the engine's torch-free run description (engine.config:
what a live run is, and whether the engine accepts it) but never the engine's run machinery (launch, run,
cli, the workers) nor torch."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ui_imports_only_the_engines_config_and_no_torch():
    modules = sorted(p.stem for p in (ROOT / "ui").glob("*.py") if p.stem != "__init__")
    code = (f"import sys, importlib; [importlib.import_module('ui.' + m) for m in {modules!r}]; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'engine'), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split() == ["['engine',", "'engine.config']", "False"], out.stdout
