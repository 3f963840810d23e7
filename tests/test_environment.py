"""The three places that name dependencies agree: pyproject.toml (honest ranges), constraints.txt
(tested pins) and environment.yml (conda users)."""
import pathlib
import re
import tomllib

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _project():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _requirements():
    p = _project()
    return [Requirement(r) for r in p["dependencies"] + sum(p["optional-dependencies"].values(), [])]


def _pins():
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.strip().split("==")
            pins[name.lower()] = version
    return pins


def _conda_pins():
    pins = {}
    for line in (ROOT / "environment.yml").read_text().splitlines():
        m = re.match(r"\s+- ([A-Za-z0-9_.-]+)==(\S+)$", line)
        if m:
            pins[m.group(1).lower()] = m.group(2)
    return pins


def test_environment_yml_lists_exactly_the_project_dependencies_at_the_tested_versions():
    wanted = {r.name.lower() for r in _requirements()}
    conda = _conda_pins()
    assert set(conda) == wanted, f"environment.yml differs: {sorted(set(conda) ^ wanted)}"
    pins = _pins()
    for name, version in conda.items():
        assert pins[name] == version, f"{name}: environment.yml {version}, constraints.txt {pins[name]}"


def test_pins_satisfy_pyprojects_ranges():
    pins = _pins()
    for req in _requirements():
        assert req.name.lower() in pins, f"{req.name} has no tested pin in constraints.txt"
        assert req.specifier.contains(Version(pins[req.name.lower()])), (req, pins[req.name.lower()])


def test_torch_is_pinned_to_the_tested_release():
    assert _pins()["torch"] == "2.13.0"
