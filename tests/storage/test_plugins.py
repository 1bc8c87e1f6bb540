"""Plugins through Python entry points (runtime/plugins.py): a storage backend (group
``distckpt.backends``) and an entry kind (group ``distckpt.kinds``) kept in a distribution of
their own are found by every process, the command line included, with no import by hand; a
plugin that fails to import is a ConfigError naming it.

Each test installs a tiny distribution into a temporary directory (a module and a .dist-info
holding entry_points.txt) and runs fresh interpreters with it on PYTHONPATH."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PLUGIN_MODULE = '''
"""A backend opening plugprobe://<path> as that local directory, and a kind for Reservoir."""
from distckpt.state.kinds import Kind, PER_RANK, register_kind
from distckpt.storage.local import LocalStorage
from distckpt.storage.registry import BackendSpec, register_backend


def open_probe(url, options):
    return LocalStorage("/" + url.split("://", 1)[1].lstrip("/"))


SPEC = BackendSpec(
    name="plugprobe", schemes=("plugprobe",), open=open_probe, exclusive_create=True, container=None,
    client_packages=(), install_hint="", jitter_modules=(), secret_env=(), secret_options=(),
    credential_env_prefixes=(), selected_by=())
if REGISTER_ON_IMPORT:
    register_backend(SPEC)


class Reservoir:
    def __init__(self, seen=0):
        self.seen = seen


class ReservoirKind(Kind):
    name = "plugprobe_reservoir"
    scope = PER_RANK

    def matches(self, key, obj):
        return isinstance(obj, Reservoir)

    def capture(self, entry):
        return {"seen": entry.target.seen}

    def restore(self, entry, value, state, release):
        entry.target.seen = value["seen"]
        return []

    def summary(self, state):
        return {"seen": state.get("seen")}
'''


def _install(root: Path, entry_points: str, register_on_import: bool = True, broken: bool = False) -> dict:
    """A distribution 'plugprobe' in `root`: its module and its metadata; the environment that
    puts it on the path of a fresh interpreter."""
    module = PLUGIN_MODULE.replace("REGISTER_ON_IMPORT", str(register_on_import))
    if broken:
        module = "import a_module_that_is_not_installed_anywhere\n" + module
    (root / "plugprobe_plugin.py").write_text(module)
    info = root / "plugprobe-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: plugprobe\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}


def _python(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=240)


SAVE = """
import sys, torch, distckpt
with distckpt.CheckpointManager(sys.argv[1]) as mgr:
    mgr.save(1, {"w": torch.ones(3)})
"""


@pytest.mark.parametrize("declared", ["the module", "its BackendSpec"])
def test_a_backend_declared_as_an_entry_point_is_used_by_jobs_and_the_command_line(tmp_path, declared):
    """Neither the job nor the CLI imports the backend: its entry point does. Before, the CLI said
    "unknown scheme 'plugprobe'"."""
    value = "plugprobe_plugin" if declared == "the module" else "plugprobe_plugin:SPEC"
    env = _install(tmp_path, f"[distckpt.backends]\nplugprobe = {value}\n", register_on_import=declared == "the module")
    url = f"plugprobe://{tmp_path}/ckpt"
    saved = _python(env, "-c", SAVE, url)
    assert saved.returncode == 0, saved.stderr
    assert (tmp_path / "ckpt" / "step-000000001" / "COMMITTED").exists()
    listed = _python(env, "-m", "distckpt", "ls", url, "--json")
    assert listed.returncode == 0, listed.stderr
    assert [row["step"] for row in json.loads(listed.stdout)] == [1]


def test_a_kind_declared_as_an_entry_point_is_known_to_jobs_and_the_command_line(tmp_path):
    """A job saves an object of the plugin's kind with no import of the kind; inspect shows its
    summary, which only the kind itself knows (an unknown kind shows nothing of it)."""
    env = _install(tmp_path, "[distckpt.kinds]\nreservoir = plugprobe_plugin:ReservoirKind\n")
    root = str(tmp_path / "ckpt")
    saved = _python(env, "-c", "import sys, distckpt, plugprobe_plugin as p\n"
                    "with distckpt.CheckpointManager(sys.argv[1]) as mgr:\n"
                    "    mgr.save(1, {'r': p.Reservoir(7)})\n", root)
    assert saved.returncode == 0, saved.stderr
    shown = _python(env, "-m", "distckpt", "inspect", root, "--json")
    assert shown.returncode == 0, shown.stderr
    entry = json.loads(shown.stdout)["ranks"][0]["entries"]["r"]
    assert entry == {"kind": "plugprobe_reservoir", "seen": 7}


@pytest.mark.parametrize("group", ["distckpt.backends", "distckpt.kinds"])
def test_a_plugin_that_fails_to_import_is_a_clear_error_naming_it(tmp_path, group):
    env = _install(tmp_path, f"[{group}]\nprobe = plugprobe_plugin\n", broken=True)
    root = str(tmp_path / "ckpt")
    done = _python(env, "-c", "import sys, torch, distckpt\n"
                   "try:\n"
                   "    with distckpt.CheckpointManager(sys.argv[1]) as mgr:\n"
                   "        mgr.save(1, {'w': torch.ones(3)})\n"
                   "except distckpt.ConfigError as e:\n"
                   "    print('ConfigError:', e)\n", root)
    assert done.returncode == 0, done.stderr
    assert f"ConfigError: the {group} plugin 'probe' = 'plugprobe_plugin' (declared by the distribution " \
           "'plugprobe') failed to import: ModuleNotFoundError" in done.stdout, done.stdout
    assert not (tmp_path / "ckpt" / "step-000000001" / "COMMITTED").exists()
