"""ServeConfig's auth_file: tenants and admin keys read from a mounted Secret (deploy/rayservice.yaml), once."""

import pytest
import yaml

from serve.config import key_digest, parse_config
from serve.errors import ConfigError


def test_auth_file_adds_its_tenants_and_admin_keys_and_is_read_once(tmp_path):
    auth = tmp_path / "auth.yaml"
    auth.write_text(yaml.safe_dump({"tenants": [{"name": "b", "key_sha256": [key_digest("kb")]}],
                                    "admin_key_sha256": [key_digest("admin")]}))
    config = parse_config({"store": "s3://x/store", "auth_file": str(auth),
                           "tenants": [{"name": "a", "key_sha256": [key_digest("ka")]}]})
    assert [t.name for t in config.tenants] == ["a", "b"] and config.admin_key_sha256 == [key_digest("admin")]
    auth.unlink()  # a replica parsing the dumped config does not need the file, nor adds its entries twice
    assert parse_config(config.model_dump(mode="json")) == config


def test_a_missing_or_malformed_auth_file_is_one_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"^config: auth_file .*nope.yaml: cannot read \(No such file"):
        parse_config({"store": "s3://x/store", "auth_file": str(tmp_path / "nope.yaml")})
    (tmp_path / "bad.yaml").write_text("tenants: []\nstore: /elsewhere\n")
    with pytest.raises(ConfigError, match="expected a mapping of tenants and admin_key_sha256 only"):
        parse_config({"store": "s3://x/store", "auth_file": str(tmp_path / "bad.yaml")})
