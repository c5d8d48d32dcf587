from pathlib import Path

import pytest
import yaml

from serve.config import ServeConfig, load_config, parse_config
from serve.errors import ConfigError

DEPLOY = Path(__file__).parent.parent / "deploy"


def test_serve_config_yaml_args_are_a_valid_serve_config():
    doc = yaml.safe_load((DEPLOY / "serve-config.yaml").read_text())
    app = doc["applications"][0]
    assert app["import_path"] == "serve.app:build_app"
    config = parse_config(app["args"])
    assert config.store == Path.home() / ".cache" / "manyfold" / "demo-store"
    assert config.deployments["minilm"].autoscaling.max_replicas == 2


@pytest.mark.parametrize("data,fragment", [
    ({}, "store: Field required"),
    ({"store": "/s", "bogus": 1}, "bogus: Extra inputs are not permitted"),
    ({"store": "/s", "deployment": {"autoscaling": {"min_replicas": 3, "max_replicas": 2}}}, "min_replicas (3)"),
    ({"store": "/s", "tenants": [{"name": "a", "key_sha256": ["0" * 64]}, {"name": "b", "key_sha256": ["0" * 64]}]},
     "also a key of tenant 'a'"),
    ({"store": "/s", "neuzip_decoded_mib": "half"}, "neuzip_decoded_mib: a number of MiB or auto"),
    ({"store": "/s", "deployment": {"memory_target_mib": 0}}, "memory_target_mib"),
])
def test_bad_configs_are_one_line(data, fragment):
    with pytest.raises(ConfigError, match="^config: ") as e:
        parse_config(data)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_load_config_overrides_and_errors(tmp_path):
    (tmp_path / "c.yaml").write_text("store: /data/store\nport: 9000\n")
    assert load_config(tmp_path / "c.yaml", port=9100).port == 9100
    (tmp_path / "bad.yaml").write_text("store: [\n")
    with pytest.raises(ConfigError, match="not valid yaml"):
        load_config(tmp_path / "bad.yaml")
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    assert isinstance(load_config(tmp_path / "c.yaml"), ServeConfig)
