import pytest

from rollout_gateway.errors import InvalidArgument
from rollout_gateway.settings import load_settings


def test_env_overrides_file_and_engines_parse(tmp_path, monkeypatch):
    cfg = tmp_path / "gw.toml"
    cfg.write_text('store_url = "redis://127.0.0.1:6379/0"\n'
                   '[[engines]]\nid = "a"\nurl = "http://127.0.0.1:1"\n'
                   '[timeouts]\ngenerate_s = 9\n[admission]\nmax_staleness = 2\n')
    monkeypatch.setenv("ROLLOUT_GATEWAY_ADMISSION__MAX_STALENESS", "5")
    monkeypatch.setenv("ROLLOUT_GATEWAY_TIMEOUTS__CONNECT_S", "1.5")
    s = load_settings(cfg)
    assert s.store_url == "redis://127.0.0.1:6379/0"
    assert s.admission.max_staleness == 5
    assert [e.id for e in s.engines] == ["a"]
    assert s.timeouts.generate_s == 9 and s.timeouts.connect_s == 1.5


def test_engines_from_comma_separated_env(monkeypatch):
    monkeypatch.setenv("ROLLOUT_GATEWAY_ENGINES", "http://h:1,http://h:2/")
    s = load_settings()
    assert [(e.id, e.url) for e in s.engines] == [("engine-0", "http://h:1"),
                                                  ("engine-1", "http://h:2")]


def test_bad_settings_are_clear_errors(tmp_path):
    with pytest.raises(InvalidArgument, match="max_staleness"):
        load_settings(admission={"max_staleness": -1})
    with pytest.raises(InvalidArgument, match="unique"):
        load_settings(engines=[{"id": "a", "url": "http://x:1"}, {"id": "a", "url": "http://x:2"}])
    bad = tmp_path / "gw.json"
    bad.write_text("{not json")
    with pytest.raises(InvalidArgument, match="not valid json"):
        load_settings(bad)
    unknown = tmp_path / "gw.yaml"
    unknown.write_text("no_such_field: 1\n")
    with pytest.raises(InvalidArgument, match="no_such_field"):
        load_settings(unknown)
