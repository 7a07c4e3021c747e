"""Workspace loading: valid files parse, every bad input names the file and the field."""

import pytest
from conftest import ROOT

from gatekeeper.battery import suites as battery
from gatekeeper.battery.suites import all_suites
from gatekeeper.errors import GatekeeperError
from gatekeeper.workspace import Workspace


def test_repository_root_is_a_valid_workspace():
    ws = Workspace(ROOT)
    assert set(ws.policies) >= {"prefix_cache"}
    for name in ("torch", "mlx", "auto"):
        assert ws.engine(name).name == name
    assert battery.read(ws)


def test_init_templates_match_the_shipped_workspace(tmp_path):
    from gatekeeper.setup.scaffold import init_workspace

    workspace = tmp_path / "ws"
    init_workspace(workspace)
    for folder in ("engines", "policies"):
        for f in (workspace / folder).iterdir():
            assert f.read_text() == (ROOT / folder / f.name).read_text(), f


def test_policy_fields(workspace):
    p = Workspace(workspace).policy("prefix_cache")
    assert p.default is False and p.gate == "byte_equivalence" and p.baseline_repeats == 2
    assert p.exercise_floor.min_cached_share == 0.5 and p.approvals.required == 1


@pytest.mark.parametrize(
    "folder, name, text, expected",
    [
        ("engines", "torch.yaml", "adapter: torch\ndtype: : x\n", "not valid YAML (line 2"),
        ("engines", "torch.yaml", "adapter: torch\nturbo: true\n", "field 'turbo': unknown key"),
        ("engines", "torch.yaml", "adapter: torch\ndtype: float8\n", "field 'dtype'"),
        ("engines", "torch.yaml", "model: default\n", "field 'adapter': required"),
        ("engines", "torch.yaml", "adapter: torch\nsnapshots: sometimes\n", "field 'snapshots'"),
    ],
)
def test_bad_engine_profile(workspace, folder, name, text, expected):
    (workspace / folder / name).write_text(text)
    with pytest.raises(GatekeeperError) as e:
        Workspace(workspace).engine("torch")
    assert str(workspace / folder / name) in str(e.value) and expected in str(e.value)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("default: on\n", "field 'default'"),
        ("approvals: {required: 0}\n", "field 'approvals.required'"),
        ("gate: vibes\n", "field 'gate'"),
        ("hash_parts: [flags, weather]\n", "field 'hash_parts.1'"),
    ],
)
def test_bad_policy(workspace, text, expected):
    path = workspace / "policies" / "prefix_cache.yaml"
    base = path.read_text().replace("default: off\n", "").replace("gate: byte_equivalence", "#")
    base = "\n".join(l for l in base.splitlines() if not l.startswith(text.split(":")[0] + ":"))
    path.write_text(base + "\n" + ("gate: byte_equivalence\n" if not text.startswith("gate") else "") + text)
    with pytest.raises(GatekeeperError) as e:
        Workspace(workspace).policies
    assert str(path) in str(e.value) and expected in str(e.value)


def test_policy_file_name_must_match_flag(workspace):
    (workspace / "policies" / "other.yaml").write_text("flag: prefix_cache\ngate: byte_equivalence\n")
    with pytest.raises(GatekeeperError, match="field 'flag'"):
        Workspace(workspace).policies


def test_unknown_flag_and_engine(workspace):
    ws = Workspace(workspace)
    with pytest.raises(GatekeeperError, match="unknown flag 'turbo'"):
        ws.policy("turbo")
    with pytest.raises(GatekeeperError, match="no engine profile 'vllm'"):
        ws.engine("vllm")


SUITE = """suite: s
stage: s
prompt:
  - {role: system, static: true, text: "rules"}
  - {role: user, static: false, text: "{query}"}
cases:
  - id: a
    vars: {query: "hi"}
    assert:
"""


@pytest.mark.parametrize(
    "assertion, expected",
    [
        ("{type: regex, value: '(unclosed'}", "case 'a', assertion 1 (regex): 'value' is not a valid regular expression"),
        ("{type: sounds-right, value: x}", "unknown assertion type 'sounds-right'"),
        ("{type: max-length, value: long, name: short}", "case 'a', assertion 1 (short): 'value' must be a non-negative integer"),
        ("{type: contains-any, value: yes}", "must be a list of strings"),
        ("{type: contains, value: x, weight: 2}", "unknown key"),
    ],
)
def test_bad_assertions(workspace, assertion, expected):
    path = workspace / "assertions" / "s.yaml"
    path.write_text(SUITE + f"      - {assertion}\n")
    with pytest.raises(GatekeeperError) as e:
        battery.read(Workspace(workspace), ["s"])
    assert expected in str(e.value) and str(path) in str(e.value)


def test_missing_var_names_suite_and_case(workspace):
    (workspace / "assertions" / "s.yaml").write_text(SUITE.replace('vars: {query: "hi"}', "vars: {}") + "      - {type: contains, value: x}\n")
    with pytest.raises(GatekeeperError, match=r"suite 's', case 'a': missing vars \['query'\]"):
        battery.read(Workspace(workspace), ["s"])


def test_missing_segment_file(workspace):
    (workspace / "prompts" / "assistant_system.txt").unlink()
    with pytest.raises(GatekeeperError, match=r"field 'prompt.1.file': prompts/assistant_system.txt not found"):
        all_suites(Workspace(workspace))


def test_duplicate_case_ids(workspace):
    (workspace / "assertions" / "s.yaml").write_text(SUITE + "      - {type: contains, value: x}\n  - id: a\n    vars: {query: q}\n")
    with pytest.raises(GatekeeperError, match="case id 'a' appears twice"):
        all_suites(Workspace(workspace))


def test_battery_digest_follows_segment_files(workspace):
    ws = Workspace(workspace)
    before = battery.battery_digest(ws, battery.read(ws))
    (workspace / "prompts" / "assistant_system.txt").write_text("other rules\n")
    ws = Workspace(workspace)
    assert battery.battery_digest(ws, battery.read(ws)) != before
