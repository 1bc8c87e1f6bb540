"""distckpt.integrations: each module imports without its framework (DESIGN.md §4.2), and a
function that needs the framework names the package to install when it is missing."""

from __future__ import annotations

import subprocess
import sys

import pytest

# (module, a call that needs the framework, the modules blocked, the package named)
CASES = [
    ("accelerate", "make_accelerator()", ["accelerate"], "pip install accelerate"),
    ("fabric", "make_fabric()", ["lightning_fabric", "lightning"], "pip install lightning-fabric"),
    ("timm", "create_loader([])", ["timm"], "pip install timm"),
    ("hf_trainer", "trainer_class()", ["transformers"], "pip install transformers"),
]


@pytest.mark.parametrize("module, call, blocked, package", CASES, ids=[c[0] for c in CASES])
def test_an_integration_imports_without_its_framework_and_names_it_when_used(module, call, blocked, package):
    script = (f"import sys\nfor name in {blocked!r}:\n    sys.modules[name] = None  # as if not installed\n"
              "from distckpt.integrations import accelerate, fabric, hf_trainer, timm\n"
              "import distckpt\n"
              "try:\n"
              f"    {module}.{call}\n"
              "except distckpt.ConfigError as e:\n"
              "    print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith(f"refused: distckpt.integrations.{module} needs ") and package in out.stdout, out.stdout


def test_importing_the_integrations_does_not_import_the_frameworks():
    script = ("import sys\nfrom distckpt.integrations import accelerate, fabric, hf_trainer, timm\n"
              "print(sorted(m for m in ('accelerate', 'lightning_fabric', 'timm', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
